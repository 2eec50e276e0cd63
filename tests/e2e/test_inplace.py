"""In-place re-formation (issue 14) with real agents, a real server and real
gloo workers running examples/train_inplace.py: on a round change the
survivors' worker processes stay (their pids are asserted), get the next
round over the worker channel, form a fresh gloo group and take the state of
the most advanced rank by broadcast (no checkpoint exists to read); the step
counter never goes back, and every rank holds the same weights after a step.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

from tests.helpers.cluster import Cluster
from tests.helpers.procs import ROOT, Proc, Server, alive, wait_until

pytestmark = pytest.mark.e2e

EXAMPLE = ROOT / "examples" / "train_inplace.py"
STEP_RE = re.compile(r"^\[\d+\]: step (\d+) rank (\d+) world (\d+) round (\d+) pid (\d+) sum (\S+)$", re.M)
SYNCED_RE = re.compile(r"^\[\d+\]: synced round (\d+) rank (\d+) world (\d+) step (\d+) fresh (\d) t \S+$", re.M)
IN_PLACE = ("--restart-mode", "in-place", "--in-place-timeout", "5")


@dataclass(frozen=True)
class Line:
    step: int
    rank: int
    world: int
    round: int
    pid: int
    sum: str


def lines(agent: Proc) -> list[Line]:
    return [Line(int(a), int(b), int(c), int(d), int(e), f) for a, b, c, d, e, f in STEP_RE.findall(agent.text())]


def synced(agent: Proc) -> list[tuple[int, int, int, int, int]]:
    return [tuple(int(g) for g in m) for m in SYNCED_RE.findall(agent.text())]  # type: ignore[misc]


def start(cluster: Cluster, server: Server, job: str, nnodes: str, *args: str, steps: int = 100000) -> Proc:
    return cluster.start_agent(
        server,
        job,
        EXAMPLE,
        "--steps",
        str(steps),
        "--step-sleep",
        "0.05",
        *args,
        nnodes=nnodes,
        flags=IN_PLACE,
    )


def wait_steps(agents: list[Proc], round_no: int, world: int, step: int, timeout: float = 90.0) -> None:
    def ok() -> bool:
        return all(
            any(ln.round == round_no and ln.world == world and ln.step >= step for ln in lines(a)) for a in agents
        )

    wait_until(ok, timeout, f"every agent's worker past step {step} in round {round_no} with world {world}")


def pids(agent: Proc, round_no: int) -> set[int]:
    return {ln.pid for ln in lines(agent) if ln.round == round_no}


def check_training(agents: list[Proc], round_no: int, world: int) -> None:
    """Steps never go back in any process; in ``round_no`` every rank has the
    same weights after each step all of them printed."""
    for a in agents:
        by_pid: dict[int, list[int]] = {}
        for ln in lines(a):
            by_pid.setdefault(ln.pid, []).append(ln.step)
        for pid, steps in by_pid.items():
            assert steps == sorted(set(steps)), f"{a.name} pid {pid}: steps went back or repeated: {steps}"
    sums: dict[int, dict[int, str]] = {}
    for a in agents:
        for ln in lines(a):
            if ln.round == round_no:
                sums.setdefault(ln.step, {})[ln.rank] = ln.sum
    full = {s: v for s, v in sums.items() if len(v) == world}
    assert len(full) >= 3, f"fewer than 3 steps of round {round_no} printed by all {world} ranks: {sums}"
    for s, by_rank in full.items():
        assert len(set(by_rank.values())) == 1, f"round {round_no} step {s}: ranks hold different weights {by_rank}"


def rank0(agents: list[Proc]) -> Proc:
    return next(a for a in agents if any(ln.rank == 0 and ln.round == 0 for ln in lines(a)))


def last_step(agent: Proc, round_no: int) -> int:
    return max(ln.step for ln in lines(agent) if ln.round == round_no)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", ["other", "rank0"])
def test_node_loss_keeps_survivors_in_place(cluster: Cluster, victim: str) -> None:
    """SIGKILL one of three nodes (group rank 0, whose worker hosts the store,
    or another): the two survivors' workers keep their processes, form world 2
    in round 1 and train on from where they were, to the end; nothing is charged."""
    server = cluster.start_server()
    agents = [start(cluster, server, "ip", "2:3", steps=60) for _ in range(3)]
    wait_steps(agents, 0, 3, 5)
    dead = rank0(agents) if victim == "rank0" else next(a for a in agents if a is not rank0(agents))
    survivors = [a for a in agents if a is not dead]
    before = {a.name: pids(a, 0) for a in survivors}
    cluster.kill_node(dead)
    reached = max(last_step(a, 0) for a in survivors)
    wait_steps(survivors, 1, 2, reached + 5)
    for a in survivors:
        assert pids(a, 1) == before[a.name], f"{a.name}'s worker was restarted: {before[a.name]} -> {pids(a, 1)}"
        assert all(alive(p) for p in before[a.name])
        (sync,) = [s for s in synced(a) if s[0] == 1]
        assert sync[4] == 0, f"{a.name}: round 1's worker is a fresh process"
        assert sync[3] >= last_step(a, 0), f"{a.name}: synced step {sync[3]} is behind its own {last_step(a, 0)}"
    check_training(survivors, 1, 2)
    for a in survivors:
        assert a.wait_exit(60) == 0
        assert re.search(r"^\[\d+\]: done step 60 ", a.text(), re.M), f"{a.name} did not finish training"
    job = server.job("ip")
    assert job is not None and job["restarts"] == 0 and job["state"] == "succeeded", job
    assert not list(cluster.tmp.rglob("*.pt")), "a checkpoint was written"
    # the NCCL settings in-place workers get (unless set), said in the log
    assert "in-place mode: workers get TORCH_NCCL_ASYNC_ERROR_HANDLING=2 TORCH_NCCL_RETHROW_CUDA_ERRORS=0" in (
        survivors[0].text()
    )


@pytest.mark.timeout(120)
def test_scale_up_keeps_workers_and_the_newcomer_gets_the_state(cluster: Cluster) -> None:
    """A third node joins two that train: the two keep their processes, the
    newcomer's fresh worker gets the model by broadcast, and all three hold the
    same weights from the first step of world 3."""
    server = cluster.start_server()
    agents = [start(cluster, server, "up", "2:3") for _ in range(2)]
    wait_steps(agents, 0, 2, 5)
    before = {a.name: pids(a, 0) for a in agents}
    newcomer = start(cluster, server, "up", "2:3")
    wait_steps([*agents, newcomer], 1, 3, 1)
    reached = max(last_step(a, 0) for a in agents)
    for a in agents:
        assert pids(a, 1) == before[a.name], f"{a.name}'s worker was restarted"
    (sync,) = synced(newcomer)
    assert sync[0] == 1 and sync[4] == 1 and sync[3] >= reached, f"newcomer synced {sync}, survivors reached {reached}"
    wait_steps([*agents, newcomer], 1, 3, reached + 5)
    check_training([*agents, newcomer], 1, 3)


@pytest.mark.timeout(120)
def test_worker_exception_restarts_only_that_worker(cluster: Cluster) -> None:
    """A worker raises: it is a failure charged to the budget; its node starts
    a new worker (which takes the state by broadcast), the other node's worker
    stays in place."""
    server = cluster.start_server()
    agents = [start(cluster, server, "exc", "2", "--fail-at-step", "10", "--fail-rank", "1") for _ in range(2)]
    wait_steps(agents, 0, 2, 5)
    keeper, failer = rank0(agents), next(a for a in agents if a is not rank0(agents))
    before = pids(keeper, 0)
    wait_steps(agents, 1, 2, 15)
    assert pids(keeper, 1) == before, "the healthy node's worker was restarted"
    assert pids(failer, 1).isdisjoint(pids(failer, 0)), "the failed worker was not replaced"
    assert "chaos: rank 1 fails at step 10" in failer.text()
    check_training(agents, 1, 2)
    job = server.job("exc")
    assert job is not None and job["restarts"] == 1, job
    # the root cause is the exception, not the survivor's failed collective (its echo)
    (opened,) = [h for h in job["history"] if h["round"] == 1]
    assert "chaos: rank 1 fails at step 10" in opened["reason"], opened


@pytest.mark.timeout(120)
def test_worker_that_ignores_the_agent_is_escalated(cluster: Cluster) -> None:
    """A worker that never reaches its safe point is restarted the process way
    after --in-place-timeout; the other node's worker stays in place."""
    server = cluster.start_server()
    agents = [start(cluster, server, "esc", "2:3", "--ignore-at-step", "8", "--ignore-rank", "1") for _ in range(2)]
    wait_steps(agents, 0, 2, 5)
    keeper, stubborn = rank0(agents), next(a for a in agents if a is not rank0(agents))
    stubborn.wait_log(r"ignoring the agent from step 8", 60)
    before_keeper, before_stubborn = pids(keeper, 0), pids(stubborn, 0)
    newcomer = start(cluster, server, "esc", "2:3")
    stubborn.wait_log(r"did not reach a safe point within 5s \(--in-place-timeout\)", 60)
    # item 8: the line names the call the worker was blocked in (its channel thread answered)
    stubborn.wait_log(r"\(--in-place-timeout\): local rank 0 blocked in train_inplace\.py:\d+ in chaos <- ", 1)
    wait_steps([keeper, stubborn, newcomer], 1, 3, 12)
    assert pids(keeper, 1) == before_keeper, "the well-behaved worker was restarted"
    assert pids(stubborn, 1).isdisjoint(before_stubborn), "the stubborn worker was not replaced"
    assert not any(alive(p) for p in before_stubborn)
    check_training([keeper, stubborn, newcomer], 1, 3)


@pytest.mark.timeout(120)
def test_a_drained_node_made_a_spare_stops_the_workers_it_kept(cluster: Cluster) -> None:
    """Drain: the drained node's agent keeps its worker over the round change
    (in place), rejoins and is made a spare; a spare runs no workers, so it
    stops them (they would hold the cordoned host's resources indefinitely)."""
    server = cluster.start_server()
    agents = {
        h: cluster.start_agent(
            server,
            "ipd",
            EXAMPLE,
            "--steps",
            "100000",
            "--step-sleep",
            "0.05",
            nnodes="2:2",
            flags=(*IN_PLACE, "--host-name", h),
            name=h,
        )
        for h in ("n1", "n2")
    }
    wait_steps(list(agents.values()), 0, 2, 3)
    agents["n3"] = cluster.start_agent(
        server,
        "ipd",
        EXAMPLE,
        "--steps",
        "100000",
        "--step-sleep",
        "0.05",
        nnodes="2:2",
        flags=(*IN_PLACE, "--host-name", "n3"),
        name="n3",
    )
    server.wait_job("ipd", lambda v: len(v["spares"]) == 1, 60, "n3 a spare")
    kept = pids(agents["n2"], 0)
    assert kept and all(alive(p) for p in kept)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rdzv_client.cli",
            "--endpoint",
            server.endpoint,
            "cordon",
            "n2",
            "--reason",
            "maint",
            "--drain",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done
    agents["n2"].wait_log(r"waiting as a spare: host n2 is cordoned", timeout=60)
    wait_until(lambda: not any(alive(p) for p in kept), 30, f"n2's kept worker(s) {kept} stopped")
    agents["n2"].wait_log(r"made a spare: stopping the workers kept in place", timeout=1)
    server.close_job("ipd")
    for agent in agents.values():
        assert agent.wait_exit(60) == 1


@pytest.mark.timeout(120)
def test_a_worker_whose_gpu_does_not_recover_is_restarted_the_others_stay(cluster: Cluster) -> None:
    """NCCL in place with a fake communicator (rdzv_client.inplace_nccl; no GPU here): on a round
    change (a third node joins) every kept worker aborts its communicator and checks the device; the
    one whose check fails with a sticky CUDA error exits 75 before it parks, its agent restarts that
    node's worker for the new round, the other node's worker stays in place."""
    server = cluster.start_server()
    script = "nccl_fake_inplace.py"
    keeper = cluster.start_agent(server, "nccl", script, nnodes="2:3", flags=IN_PLACE)
    broken = cluster.start_agent(
        server, "nccl", script, nnodes="2:3", flags=IN_PLACE, env={"FAKE_STICKY_CUDA_ERROR": "1"}
    )
    (k0,) = keeper.wait_log(r"round 0 rank \d world 2 pid (\d+)", 60)
    (b0,) = broken.wait_log(r"round 0 rank \d world 2 pid (\d+)", 60)
    newcomer = cluster.start_agent(server, "nccl", script, nnodes="2:3", flags=IN_PLACE)
    (k1,) = keeper.wait_log(r"round 1 rank \d world 3 pid (\d+)", 60)
    (b1,) = broken.wait_log(r"round 1 rank \d world 3 pid (\d+)", 60)
    assert k1.group(1) == k0.group(1), "the healthy worker was restarted"
    assert b1.group(1) != b0.group(1), "the worker whose GPU did not recover was kept"
    keeper.wait_log(rf"abort round 0 pid {k0.group(1)}", 1)
    keeper.wait_log(rf"synchronized pid {k0.group(1)}", 1)
    keeper.wait_log(r"rdzv: NCCL: 1 communicator\(s\) aborted in [0-9.]+s, GPU checked in [0-9.]+s", 1)
    broken.wait_log(rf"abort round 0 pid {b0.group(1)}", 1)
    broken.wait_log(
        r"local rank 0: CUDA error after the abort: CUDA error: an illegal memory access was encountered; "
        r"exiting 75 for a process restart",
        1,
    )
    broken.wait_log(
        r"kept local rank 0 exited 75 \(it asked for a process restart: NCCL or its GPU did not recover\)", 1
    )
    for a in (keeper, broken, newcomer):
        assert a.wait_exit(60) == 0, a.text()
    job = server.job("nccl")
    assert job is not None and job["restarts"] == 0 and job["state"] == "succeeded", job  # not charged
