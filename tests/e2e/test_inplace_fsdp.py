"""In-place re-formation of an FSDP2 loop (issue 20): real server, three real
agents, real gloo workers running examples/train_fsdp_inplace.py (a plain
FSDP2 loop, ``fully_shard`` on a mesh over the round's interruptible group,
DCP saves every few steps). The node of rank 0 (the round's store host and
DCP's coordinator) is SIGKILLed mid-training: the survivors' FSDP2
collectives fail, they keep their processes, shard a fresh model on the new
round's group and load the last complete save resharded from 3 ranks to 2.
"""

from __future__ import annotations

import re

import pytest

from tests.helpers.cluster import Cluster
from tests.helpers.procs import ROOT, Proc, alive, wait_until

pytestmark = pytest.mark.e2e

EXAMPLE = ROOT / "examples" / "train_fsdp_inplace.py"
LINE_RE = re.compile(r"^\[\d+\]: (step|resumed) (\d+) rank (\d+) world (\d+) round (\d+) pid (\d+) sum (\S+)", re.M)
SAVE_EVERY = 4


def lines(agent: Proc) -> list[tuple[str, int, int, int, int, int, str]]:
    return [(k, int(s), int(r), int(w), int(c), int(p), x) for k, s, r, w, c, p, x in LINE_RE.findall(agent.text())]


def steps_of(agent: Proc, round_no: int) -> set[int]:
    return {ln[1] for ln in lines(agent) if ln[0] == "step" and ln[4] == round_no}


def reached(agent: Proc, round_no: int) -> int:
    return max((ln[1] for ln in lines(agent) if ln[0] == "step" and ln[4] == round_no), default=-1)


@pytest.mark.timeout(120)
def test_fsdp2_survivors_stay_in_place_and_resume_from_the_last_save(cluster: Cluster) -> None:
    """SIGKILL rank 0's node: the two survivors keep their pids, resume in
    world 2 from the newest save complete before the kill or a later one
    (never an older one: steps go back to it, not before it), with the
    parameters as they were at that step in world 3 (the lost rank's shards
    included), and train on in lock-step."""
    server = cluster.start_server()
    ckpt = cluster.tmp / "ckpt"
    agents = [
        cluster.start_agent(
            server,
            "fsdp",
            EXAMPLE,
            "--steps",
            "100000",
            "--step-sleep",
            "0.05",
            "--ckpt",
            str(ckpt),
            "--save-every",
            str(SAVE_EVERY),
            nnodes="2:3",
            flags=("--restart-mode", "in-place", "--in-place-timeout", "5"),
        )
        for _ in range(3)
    ]
    wait_until(lambda: all(reached(a, 0) >= 2 * SAVE_EVERY + 1 for a in agents), 90, "every worker past a save")
    dead = next(a for a in agents if any(ln[2] == 0 and ln[4] == 0 for ln in lines(a)))
    survivors = [a for a in agents if a is not dead]
    before = {a.name: {ln[5] for ln in lines(a)} for a in survivors}
    cluster.kill_node(dead)
    # a step line is printed after that step's save returned: saved (complete) before the kill
    saved = max(
        s for a in survivors for k, s, _, _, c, _, _ in lines(a) if k == "step" and c == 0 and s % SAVE_EVERY == 0
    )
    sums0 = {ln[1]: ln[6] for a in agents for ln in lines(a) if ln[0] == "step" and ln[4] == 0}
    wait_until(
        lambda: all(reached(a, 1) >= saved + 5 for a in survivors), 60, f"survivors past step {saved + 5} in round 1"
    )
    sums1: dict[int, set[str]] = {}
    for a in survivors:
        mine = lines(a)
        assert {ln[5] for ln in mine} == before[a.name], f"{a.name}'s worker was restarted"
        assert all(alive(p) for p in before[a.name])
        resumed = [ln for ln in mine if ln[0] == "resumed" and ln[4] == 1]
        assert len(resumed) == 1 and resumed[0][3] == 2, resumed
        start = resumed[0][1]
        assert start >= saved and start % SAVE_EVERY == 0, f"{a.name} resumed at {start}, the last save was {saved}"
        assert resumed[0][6] == sums0[start], f"{a.name}: step {start}'s parameters did not come back"
        steps1 = [ln[1] for ln in mine if ln[0] == "step" and ln[4] == 1]
        assert steps1 == list(range(start + 1, start + 1 + len(steps1))), steps1
        for ln in mine:
            if ln[0] == "step" and ln[4] == 1:
                assert ln[3] == 2, ln
                sums1.setdefault(ln[1], set()).add(ln[6])
    both = [
        s for s, xs in sums1.items() if sum(1 for a in survivors if s in {ln[1] for ln in lines(a) if ln[4] == 1}) == 2
    ]
    assert len(both) >= 3, sums1
    for s in both:
        assert len(sums1[s]) == 1, f"step {s}: the ranks hold different parameters {sums1[s]}"
    job = server.job("fsdp")
    assert job is not None and job["restarts"] == 0, job
