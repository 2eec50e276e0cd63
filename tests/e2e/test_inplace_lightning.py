"""In-place re-formation of a PyTorch Lightning ``Trainer.fit`` (issue 20):
real server, three real agents (``--restart-mode in-place``), real gloo
workers running examples/train_lightning_inplace.py (a plain Lightning script
with ``strategy=InPlaceDDPStrategy()``). A node is SIGKILLed mid-fit: the
survivors' ``fit`` goes on in the same processes, in world 2, from the
highest ``global_step`` reached (the most advanced rank's checkpoint, in
memory), with the same weights on both ranks, and finishes.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("pytorch_lightning")

from tests.helpers.cluster import Cluster
from tests.helpers.procs import ROOT, Proc, wait_until

pytestmark = pytest.mark.e2e

EXAMPLE = ROOT / "examples" / "train_lightning_inplace.py"
STEP_RE = re.compile(r"^\[\d+\]: step (\d+) rank (\d+) world (\d+) round (\d+) pid (\d+) sum (\S+) t \S+$", re.M)
DONE_RE = re.compile(r"^\[\d+\]: done rank \d+ global_step (\d+) pid (\d+)$", re.M)
STEPS = 60


def lines(agent: Proc) -> list[tuple[int, int, int, int, int, str]]:
    return [(int(a), int(b), int(c), int(d), int(e), f) for a, b, c, d, e, f in STEP_RE.findall(agent.text())]


def reached(agent: Proc, round_no: int) -> int:
    return max((ln[0] for ln in lines(agent) if ln[3] == round_no), default=-1)


@pytest.mark.timeout(120)
def test_lightning_fit_keeps_survivors_in_place_after_a_node_loss(cluster: Cluster) -> None:
    """SIGKILL a node that is not group rank 0's: the two survivors keep their
    processes, their fit() goes on in world 2 from where it was (global_step
    never goes back), in lock-step, and ends at max_steps; the job succeeds
    with no restart."""
    server = cluster.start_server()
    agents = [
        cluster.start_agent(
            server,
            "lit-inplace",
            EXAMPLE,
            "--steps",
            str(STEPS),
            "--step-sleep",
            "0.05",
            "--root",
            str(cluster.tmp / f"root{i}"),
            nnodes="2:3",
            flags=("--restart-mode", "in-place", "--in-place-timeout", "5", "--last-call", "30"),
        )
        for i in range(3)
    ]
    wait_until(lambda: all(reached(a, 0) >= 5 for a in agents), 90, "every worker past step 5 in world 3")
    hosts = [a for a in agents if any(ln[1] == 0 and ln[3] == 0 for ln in lines(a))]
    dead = next(a for a in agents if a not in hosts)
    survivors = [a for a in agents if a is not dead]
    before = {a.name: {ln[4] for ln in lines(a)} for a in survivors}
    cluster.kill_node(dead)
    top = max(reached(a, 0) for a in survivors)
    assert top < STEPS - 10, f"the kill came too late to leave a round 1: {top}"
    for a in survivors:
        assert a.wait_exit(60) == 0, a.text()[-4000:]
    sums: dict[int, set[str]] = {}
    for a in survivors:
        mine = lines(a)
        assert {ln[4] for ln in mine} == before[a.name], f"{a.name}'s worker was restarted"
        assert {int(p) for _, p in DONE_RE.findall(a.text())} == before[a.name], a.text()[-3000:]
        assert [int(s) for s, _ in DONE_RE.findall(a.text())] == [STEPS], a.text()[-3000:]
        steps = [ln[0] for ln in mine]
        assert steps == sorted(set(steps)), f"{a.name}: global_step went back or repeated: {steps}"
        assert steps[-1] == STEPS, steps
        round1 = [ln for ln in mine if ln[3] == 1]
        assert {ln[2] for ln in round1} == {2}, f"{a.name}: round 1 is not world 2"
        assert round1 and round1[0][0] >= top, f"{a.name}: round 1 began at {round1[0][0]}, behind {top}"
        for ln in round1:
            sums.setdefault(ln[0], set()).add(ln[5])
    both = [s for s in sums if all(any(ln[0] == s and ln[3] == 1 for ln in lines(a)) for a in survivors)]
    assert len(both) >= 5, sums
    for s in both:
        assert len(sums[s]) == 1, f"step {s}: the ranks hold different weights {sums[s]}"
    view = server.wait_job("lit-inplace", lambda v: v["state"] == "succeeded", 20, "job succeeded")
    assert view["restarts"] == 0, view
