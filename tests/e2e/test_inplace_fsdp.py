"""In-place re-formation of an FSDP2 loop (issue 20): real server, three real
agents, real gloo workers running examples/train_fsdp_inplace.py (a plain
FSDP2 loop, ``fully_shard`` on a mesh over the round's interruptible group,
DCP saves every few steps). The node of rank 0 (the round's store host and
DCP's coordinator) is SIGKILLed mid-training: the survivors' FSDP2
collectives fail, they keep their processes, shard a fresh model on the new
round's group and load the last complete save resharded from 3 ranks to 2;
then a node joins and all three load the last save of world 2 the same way.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.cluster import Cluster
from tests.helpers.procs import ROOT, Proc, Server, alive, wait_until

pytestmark = pytest.mark.e2e

EXAMPLE = ROOT / "examples" / "train_fsdp_inplace.py"
LINE_RE = re.compile(
    r"^\[\d+\]: (step|resumed|saved) (\d+) rank (\d+) world (\d+) round (\d+) pid (\d+) sum (\S+)", re.M
)
SAVE_EVERY = 4


def lines(agent: Proc) -> list[tuple[str, int, int, int, int, int, str]]:
    return [(k, int(s), int(r), int(w), int(c), int(p), x) for k, s, r, w, c, p, x in LINE_RE.findall(agent.text())]


def steps_of(agent: Proc, round_no: int) -> set[int]:
    return {ln[1] for ln in lines(agent) if ln[0] == "step" and ln[4] == round_no}


def rounds(agent: Proc) -> set[int]:
    return {ln[4] for ln in lines(agent) if ln[0] == "resumed"}


def reached(agent: Proc, round_no: int) -> int:
    return max((ln[1] for ln in lines(agent) if ln[0] == "step" and ln[4] == round_no), default=-1)


def saved_by(agents: list[Proc], round_no: int) -> int:
    """The newest save complete in ``round_no`` by what ``agents`` printed (a
    ``saved`` line comes after that step's save returned; a newer one may be
    complete on disk without its line)."""
    return max((ln[1] for a in agents for ln in lines(a) if ln[0] == "saved" and ln[4] == round_no), default=-1)


def check_resumed(agents: list[Proc], round_no: int, world: int, saved: int, sums_before: dict[int, str]) -> None:
    """Every one of ``agents`` resumed once in ``round_no`` (world ``world``)
    from the same save, ``saved`` or a newer one (never an older one), holding
    the parameters printed at that step before, then stepped on from it one by
    one, every rank with the same parameters at every step."""
    sums: dict[int, set[str]] = {}
    starts = set()
    for a in agents:
        mine = lines(a)
        resumed = [ln for ln in mine if ln[0] == "resumed" and ln[4] == round_no]
        assert len(resumed) == 1 and resumed[0][3] == world, (a.name, resumed)
        start = resumed[0][1]
        starts.add(start)
        assert start >= saved and start % SAVE_EVERY == 0, f"{a.name} resumed at {start}, the last save was {saved}"
        assert resumed[0][6] == sums_before[start], f"{a.name}: step {start}'s parameters did not come back"
        steps = [ln for ln in mine if ln[0] == "step" and ln[4] == round_no]
        assert [ln[1] for ln in steps] == list(range(start + 1, start + 1 + len(steps))), steps
        for ln in steps:
            assert ln[3] == world, ln
            sums.setdefault(ln[1], set()).add(ln[6])
    assert len(starts) == 1, starts
    common = [s for s, xs in sums.items() if len(xs) > 1 or all(s in steps_of(a, round_no) for a in agents)]
    assert len(common) >= 3, sums
    for s in common:
        assert len(sums[s]) == 1, f"step {s}: the ranks hold different parameters {sums[s]}"


def start(cluster: Cluster, server: Server, ckpt: Path) -> Proc:
    return cluster.start_agent(
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


@pytest.mark.timeout(150)
def test_fsdp2_node_loss_and_scale_up_stay_in_place_and_resume_from_the_last_save(cluster: Cluster) -> None:
    """SIGKILL rank 0's node (the round's store host, DCP's coordinator):
    the two survivors keep their pids and resume in world 2 from the newest
    save complete before the kill or a later one, with the parameters as
    they were at that step in world 3 (the lost rank's shards included:
    resharded 3 -> 2). Then a third node joins: the survivors keep their pids
    again, and all three, the newcomer included, resume in world 3 from the
    newest save of world 2 (resharded 2 -> 3)."""
    server = cluster.start_server()
    ckpt = cluster.tmp / "ckpt"
    agents = [start(cluster, server, ckpt) for _ in range(3)]
    wait_until(lambda: all(reached(a, 0) >= 2 * SAVE_EVERY + 1 for a in agents), 90, "every worker past a save")
    dead = next(a for a in agents if any(ln[2] == 0 and ln[4] == 0 for ln in lines(a)))
    survivors = [a for a in agents if a is not dead]
    pids = {a.name: {ln[5] for ln in lines(a)} for a in survivors}
    cluster.kill_node(dead)
    saved = saved_by(survivors, 0)
    sums0 = {ln[1]: ln[6] for a in agents for ln in lines(a) if ln[0] == "step" and ln[4] == 0}
    wait_until(lambda: all(reached(a, 1) >= saved + 5 for a in survivors), 60, f"both past step {saved + 5} in round 1")
    check_resumed(survivors, 1, 2, saved, sums0)

    newcomer = start(cluster, server, ckpt)
    wait_until(lambda: rounds(newcomer), 60, "the newcomer in a round")
    last = max(rounds(newcomer))
    saved = saved_by(survivors, 1)  # the survivors stopped when the newcomer joined, before its worker started
    sums1 = {ln[1]: ln[6] for a in survivors for ln in lines(a) if ln[0] == "step" and ln[4] == 1}
    everyone = [*survivors, newcomer]
    wait_until(lambda: all(reached(a, last) >= saved + 5 for a in everyone), 60, f"all three past {saved + 5}")
    check_resumed(everyone, last, 3, saved, sums1)
    for a in survivors:
        assert {ln[5] for ln in lines(a)} == pids[a.name], f"{a.name}'s worker was restarted"
        assert all(alive(p) for p in pids[a.name])
    job = server.job("fsdp")
    assert job is not None and job["restarts"] == 0, job
