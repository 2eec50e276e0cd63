"""Plain DDP in place (issue 20) beyond a node's loss: real server, real
agents, real gloo workers running examples/train_ddp_inplace.py. A third node
joins two that train; a peer freezes (SIGSTOP) under ``--hang-timeout``. The
nodes that did nothing wrong keep their processes and their in-memory state:
their steps never go back and every rank holds the same weights after.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from tests.helpers.cluster import Cluster
from tests.helpers.procs import ROOT, Proc, Server, alive, wait_until

pytestmark = pytest.mark.e2e

EXAMPLE = ROOT / "examples" / "train_ddp_inplace.py"
STEP_RE = re.compile(r"^\[\d+\]: step (\d+) rank (\d+) world (\d+) round (\d+) pid (\d+) sum (\S+) t (\S+)$", re.M)


class Line:
    def __init__(self, m: tuple[str, ...]) -> None:
        self.step, self.rank, self.world, self.round, self.pid = (int(g) for g in m[:5])
        self.sum, self.t = m[5], float(m[6])


def lines(agent: Proc) -> list[Line]:
    return [Line(m) for m in STEP_RE.findall(agent.text())]


def start(cluster: Cluster, server: Server, job: str, *flags: str) -> Proc:
    return cluster.start_agent(
        server,
        job,
        EXAMPLE,
        "--steps",
        "100000",
        "--step-sleep",
        "0.05",
        nnodes="2:3",
        flags=("--restart-mode", "in-place", "--in-place-timeout", "5", *flags),
    )


def past(agents: list[Proc], step: int, rounds: range, world: int) -> bool:
    return all(any(ln.step >= step and ln.round in rounds and ln.world == world for ln in lines(a)) for a in agents)


def pids(agent: Proc) -> set[int]:
    return {ln.pid for ln in lines(agent)}


def check_training(agents: list[Proc], after_round: int, world: int) -> None:
    """Per process, steps only go up; after ``after_round``, every step that
    all ``world`` ranks printed has one checksum."""
    for a in agents:
        by_pid: dict[int, list[int]] = {}
        for ln in lines(a):
            by_pid.setdefault(ln.pid, []).append(ln.step)
        for pid, steps in by_pid.items():
            assert steps == sorted(set(steps)), f"{a.name} pid {pid}: steps went back or repeated: {steps}"
    sums: dict[tuple[int, int], dict[int, str]] = {}
    for a in agents:
        for ln in lines(a):
            if ln.round > after_round and ln.world == world:
                sums.setdefault((ln.round, ln.step), {})[ln.rank] = ln.sum
    full = {k: v for k, v in sums.items() if len(v) == world}
    assert len(full) >= 3, f"fewer than 3 steps printed by all {world} ranks after round {after_round}: {sums}"
    for k, by_rank in full.items():
        assert len(set(by_rank.values())) == 1, f"round/step {k}: ranks hold different weights {by_rank}"


@pytest.mark.timeout(120)
def test_plain_ddp_scale_up_keeps_workers_and_the_newcomer_gets_the_state(cluster: Cluster) -> None:
    """2 -> 3: the two nodes that train keep their processes (nobody restarts,
    nothing is charged), the newcomer's fresh worker takes the state by
    sync_state (its first step is past theirs) and all three hold the same
    weights from the first step of world 3."""
    server = cluster.start_server()
    agents = [start(cluster, server, "ddpup") for _ in range(2)]
    wait_until(lambda: past(agents, 5, range(0, 1), 2), 90, "both workers past step 5 in world 2")
    before = {a.name: pids(a) for a in agents}
    newcomer = start(cluster, server, "ddpup")
    wait_until(lambda: past([*agents, newcomer], 1, range(1, 99), 3), 60, "a step in world 3")
    reached = max(ln.step for a in agents for ln in lines(a) if ln.round == 0)
    wait_until(lambda: past([*agents, newcomer], reached + 4, range(1, 99), 3), 60, f"all past step {reached + 4}")
    for a in agents:
        assert pids(a) == before[a.name], f"{a.name}'s worker was restarted: {before[a.name]} -> {pids(a)}"
        assert all(alive(p) for p in before[a.name])
    first = min(ln.step for ln in lines(newcomer))
    assert first > reached, f"the newcomer started at step {first}, the others had reached {reached}: no state"
    check_training([*agents, newcomer], 0, 3)
    job = server.job("ddpup")
    assert job is not None and job["restarts"] == 0, job
    gap = min(ln.t for ln in lines(agents[0]) if ln.round >= 1) - max(ln.t for ln in lines(agents[0]) if ln.round == 0)
    print(f"scale-up 2->3: {gap:.3f}s between a survivor's last step in world 2 and its first in world 3")


@pytest.mark.timeout(120)
def test_a_frozen_peer_is_replaced_and_the_others_keep_their_processes(cluster: Cluster) -> None:
    """SIGSTOP one node's worker mid-training under --hang-timeout: the other
    two block in DDP's all-reduce on it, but only the frozen rank is hung (a
    rank waiting in the library's collective tells its agent so); its agent
    stops it and reports the hang, the server opens a round, and the others'
    pending all-reduce is failed by their agents' stop: they keep their
    processes and their steps, and the frozen node's new worker takes the state."""
    server = cluster.start_server()
    agents = [start(cluster, server, "ddpfrz", "--hang-timeout", "2") for _ in range(3)]
    wait_until(lambda: past(agents, 5, range(0, 1), 3), 90, "every worker past step 5 in world 3")
    victim = next(a for a in agents if not any(ln.rank == 0 for ln in lines(a)))
    others = [a for a in agents if a is not victim]
    before = {a.name: pids(a) for a in others}
    (frozen,) = pids(victim)
    os.kill(frozen, signal.SIGSTOP)
    stopped_at = time.time()
    try:
        victim.wait_log(r"hung: no progress\(\) for", 30)
        wait_until(lambda: not alive(frozen), 30, f"the frozen worker {frozen} stopped")
    finally:
        if alive(frozen):
            os.kill(frozen, signal.SIGCONT)
    reached = max(ln.step for a in others for ln in lines(a) if ln.round == 0)
    wait_until(lambda: past(agents, reached + 4, range(1, 99), 3), 60, f"all three past step {reached + 4} in world 3")
    for a in others:
        assert pids(a) == before[a.name], f"{a.name}'s worker was restarted: {before[a.name]} -> {pids(a)}"
        assert all(alive(p) for p in before[a.name])
        judged = re.search(r"pid \d+ hung: no progress", a.text())
        assert not judged, f"{a.name}: a rank that waited on the frozen peer was judged hung"
    assert pids(victim) - {frozen}, "the frozen node has no new worker"
    check_training(agents, 0, 3)
    job = server.job("ddpfrz")
    assert job is not None and job["restarts"] == 1, job  # a hang is a failure, charged
    assert any("hung after step" in h["reason"] for h in job["history"]), job["history"]
    back = min(ln.t for a in others for ln in lines(a) if ln.round >= 1)
    print(f"frozen peer: {back - stopped_at:.3f}s from SIGSTOP to the survivors' first step in the next round")
