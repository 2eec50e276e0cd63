"""In-place re-formation of a Hugging Face accelerate script (issue 20): real
server, real agents (``--restart-mode in-place``), real gloo workers running
examples/train_accelerate_inplace.py (a plain accelerate loop with an
``InPlaceAccelerator`` made once per round). Two nodes train; a third joins
(scale-up): the two keep their processes and the newcomer takes their state
(``accelerator.sync_state``). Then that node is SIGKILLed mid-training: the
survivors' ``accelerator.backward`` fails inside DDP's comm hook, they keep
their processes, accelerate's state is set up again for world 2 (the
dataloader sharded over two ranks again), and they train on from the highest
step reached, with the same weights on every rank, to the end.
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
STEPS = 120
BATCHES = 4096 // 16  # the example's dataset and batch size: batches per epoch in world 1


def lines(agent: Proc) -> list[tuple[int, int, int, int, int, str]]:
    return [(int(a), int(b), int(c), int(d), int(e), f) for a, b, c, d, e, f in STEP_RE.findall(agent.text())]


def reached(agent: Proc, round_no: int) -> int:
    return max((ln[0] for ln in lines(agent) if ln[3] == round_no), default=-1)


def same_weights(agents: list[Proc], round_no: int) -> int:
    """Asserts every step of ``round_no`` that all ``agents`` printed shows one
    checksum on all of them; returns how many steps that was."""
    sums: dict[int, set[str]] = {}
    for a in agents:
        for ln in lines(a):
            if ln[3] == round_no:
                sums.setdefault(ln[0], set()).add(ln[5])
    every = [s for s in sums if all(any(ln[0] == s and ln[3] == round_no for ln in lines(a)) for a in agents)]
    for s in every:
        assert len(sums[s]) == 1, f"round {round_no} step {s}: the ranks hold different weights {sums[s]}"
    return len(every)


@pytest.mark.timeout(150)
def test_accelerate_keeps_its_processes_through_a_scale_up_and_a_node_loss(cluster: Cluster) -> None:
    """Round 0: two nodes, world 2. A third node joins (round 1, world 3): the
    two keep their pids, the newcomer starts from their step with their
    weights. SIGKILL of the newcomer's node (round 2, world 2): the two keep
    their pids again, steps never go back, the dataloader is sharded for each
    round's world, and the run ends at --steps; the job succeeds with no
    restart."""
    server = cluster.start_server()

    def node() -> Proc:
        return cluster.start_agent(
            server,
            "acc-inplace",
            EXAMPLE,
            "--steps",
            str(STEPS),
            "--step-sleep",
            "0.05",
            nnodes="2:3",
            flags=("--restart-mode", "in-place", "--in-place-timeout", "5", "--last-call", "1"),
        )

    first = [node(), node()]
    wait_until(lambda: all(reached(a, 0) >= 5 for a in first), 90, "both workers past step 5 in world 2")
    before = {a.name: {ln[4] for ln in lines(a)} for a in first}
    newcomer = node()
    top0 = lambda: max(reached(a, 0) for a in first)  # noqa: E731
    wait_until(
        lambda: all(reached(a, 1) >= top0() + 5 for a in [*first, newcomer]), 90, "all three past 5 steps in world 3"
    )
    assert min(ln[0] for ln in lines(newcomer)) > top0() >= 5, "the newcomer did not start from the others' step"
    assert same_weights([*first, newcomer], 1) >= 3
    cluster.kill_node(newcomer)
    top1 = max(reached(a, 1) for a in first)
    assert top1 < STEPS - 10, f"the kill came too late to leave a round 2: {top1}"
    for a in first:
        assert a.wait_exit(60) == 0, a.text()[-4000:]
    for a in first:
        mine = lines(a)
        assert {ln[4] for ln in mine} == before[a.name], f"{a.name}'s worker was restarted"
        rounds = [(int(c), int(w), int(b), int(p)) for c, w, _, b, p in ROUND_RE.findall(a.text())]
        assert [(c, w, b) for c, w, b, _ in rounds] == [
            (0, 2, BATCHES // 2),
            (1, 3, math.ceil(BATCHES / 3)),
            (2, 2, BATCHES // 2),
        ], f"{a.name}: the dataloader is not sharded for each round's world: {rounds}"
        assert {p for *_, p in rounds} == before[a.name], rounds
        steps = [ln[0] for ln in mine]
        assert steps == sorted(set(steps)), f"{a.name}: steps went back or repeated: {steps}"
        assert steps[-1] == STEPS, steps
        round2 = [ln for ln in mine if ln[3] == 2]
        assert {ln[2] for ln in round2} == {2}, f"{a.name}: round 2 is not world 2"
        assert round2 and round2[0][0] > top1, f"{a.name}: round 2 began at {round2[0][0]}, behind {top1}"
    assert same_weights(first, 2) >= 5
    view = server.wait_job("acc-inplace", lambda v: v["state"] == "succeeded", 20, "job succeeded")
    assert view["restarts"] == 0, view
