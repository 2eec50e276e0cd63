"""In-place re-formation of a Hugging Face accelerate script (issue 20): real
server, three real agents (``--restart-mode in-place``), real gloo workers
running examples/train_accelerate_inplace.py (a plain accelerate loop with
``InPlaceAccelerator`` made once per round). A node is SIGKILLed mid-training:
the survivors' ``accelerator.backward`` fails inside DDP's comm hook, they keep
their processes, accelerate's state is set up again for world 2 (the
dataloader sharded over two ranks), and they train on from the highest step
reached, with the same weights on both ranks, to the end.
"""

from __future__ import annotations

import math
import re

import pytest

pytest.importorskip("accelerate")

from tests.helpers.cluster import Cluster
from tests.helpers.procs import ROOT, Proc, wait_until

pytestmark = pytest.mark.e2e

EXAMPLE = ROOT / "examples" / "train_accelerate_inplace.py"
STEP_RE = re.compile(r"^\[\d+\]: step (\d+) rank (\d+) world (\d+) round (\d+) pid (\d+) sum (\S+) t \S+$", re.M)
ROUND_RE = re.compile(r"^\[\d+\]: round (\d+) world (\d+) rank (\d+) batches (\d+) pid (\d+)$", re.M)
STEPS = 60
BATCHES = 4096 // 16  # the example's dataset and batch size: batches per epoch in world 1


def lines(agent: Proc) -> list[tuple[int, int, int, int, int, str]]:
    return [(int(a), int(b), int(c), int(d), int(e), f) for a, b, c, d, e, f in STEP_RE.findall(agent.text())]


def reached(agent: Proc, round_no: int) -> int:
    return max((ln[0] for ln in lines(agent) if ln[3] == round_no), default=-1)


@pytest.mark.timeout(120)
def test_accelerate_keeps_survivors_in_place_after_a_node_loss(cluster: Cluster) -> None:
    """SIGKILL a node that is not group rank 0's: the two survivors keep their
    processes, go on in world 2 from where they were (steps never go back),
    each with half the epoch's batches, in lock-step, and end at --steps; the
    job succeeds with no restart."""
    server = cluster.start_server()
    agents = [
        cluster.start_agent(
            server,
            "acc-inplace",
            EXAMPLE,
            "--steps",
            str(STEPS),
            "--step-sleep",
            "0.05",
            nnodes="2:3",
            flags=("--restart-mode", "in-place", "--in-place-timeout", "5", "--last-call", "30"),
        )
        for _ in range(3)
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
        rounds = [(int(c), int(w), int(b), int(p)) for c, w, _, b, p in ROUND_RE.findall(a.text())]
        assert [(c, w, b) for c, w, b, _ in rounds] == [
            (0, 3, math.ceil(BATCHES / 3)),
            (1, 2, BATCHES // 2),
        ], f"{a.name}: the dataloader is not sharded for each round's world: {rounds}"
        assert {p for *_, p in rounds} == before[a.name], rounds
        steps = [ln[0] for ln in mine]
        assert steps == sorted(set(steps)), f"{a.name}: steps went back or repeated: {steps}"
        assert steps[-1] == STEPS, steps
        round1 = [ln for ln in mine if ln[3] == 1]
        assert {ln[2] for ln in round1} == {2}, f"{a.name}: round 1 is not world 2"
        assert round1 and round1[0][0] > top, f"{a.name}: round 1 began at {round1[0][0]}, behind {top}"
        for ln in round1:
            sums.setdefault(ln[0], set()).add(ln[5])
    both = [s for s in sums if all(any(ln[0] == s and ln[3] == 1 for ln in lines(a)) for a in survivors)]
    assert len(both) >= 5, sums
    for s in both:
        assert len(sums[s]) == 1, f"step {s}: the ranks hold different weights {sums[s]}"
    view = server.wait_job("acc-inplace", lambda v: v["state"] == "succeeded", 20, "job succeeded")
    assert view["restarts"] == 0, view
