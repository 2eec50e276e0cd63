"""Elasticity with real processes: lost nodes, leaving nodes, new nodes,
worker failures, a spent restart budget, a frozen server and a closed job.

Workers run scripts/loop.py: one gloo all_reduce every ``--interval`` seconds,
one ``step S rank R world W restart C pid P`` line per step.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from rdzv_common.protocol import DEFAULT_HEARTBEAT_TIMEOUT_S as HEARTBEAT_TIMEOUT_S
from tests.helpers.cluster import Cluster
from tests.helpers.procs import Proc, wait_until

pytestmark = pytest.mark.e2e


def _ran(agent: Proc, restart: int, world: int, step: int = 1) -> bool:
    """Some worker of ``agent`` reached ``step`` in round ``restart`` with ``world`` ranks."""
    return any(s.restart == restart and s.world == world and s.step >= step for s in agent.steps())


def _all_running(agents: list[Proc], restart: int, world: int, step: int = 1, timeout: float = 60.0) -> None:
    wait_until(
        lambda: all(_ran(a, restart, world, step) for a in agents),
        timeout,
        f"every agent's workers at step {step} of restart {restart} with world {world}",
    )


@pytest.mark.timeout(90)
@pytest.mark.parametrize("on_error", ["hang", "exit"], ids=["survivors-hang", "survivors-exit"])
def test_sigkilled_node_is_replaced_by_a_smaller_round(cluster: Cluster, on_error: str) -> None:
    """SIGKILL group rank 0 of 3 (agent and workers, and with them the
    workers' TCPStore): the other two re-form with world 2 and a new master
    within a few seconds and train on; REST shows round 1, opened because that
    node was lost, and no restart spent. The survivors' workers either hang in
    their failed collective (so only the server can tell the agents) or exit
    at once when it fails, so that their agents' failure reports race the dead
    node's disconnect grace (and must not be charged as a worker failure).
    The second case's server runs on asyncio's own event loop, the first on the
    default (uvloop, installed with rdzv): both loops serve a real job."""
    loop = "asyncio" if on_error == "exit" else "uvloop"
    server = cluster.start_server("--event-loop", loop)
    server.wait_log(f"event loop: {loop}", timeout=5)
    agents = [
        cluster.start_agent(
            server,
            "kill",
            "loop.py",
            "--steps",
            "400",
            "--interval",
            "0.05",
            "--on-collective-error",
            on_error,
            nnodes="2:3",
        )
        for _ in range(3)
    ]
    _all_running(agents, restart=0, world=3, step=2)
    view = server.job("kill")
    victim_id = next(n["node_id"] for n in view["nodes"] if n["group_rank"] == 0)
    old_master = (view["master_addr"], view["master_port"])
    victim = next(a for a in agents if f"node {victim_id}:" in a.text())
    survivors = [a for a in agents if a is not victim]
    killed_at = time.time()
    cluster.kill_node(victim)
    view = server.wait_job("kill", lambda v: v["round"] == 1 and v["state"] == "running", 20, "round 1 running")
    opened = view["history"][-1]
    # noticed when its connection dropped: a disconnect grace, not a heartbeat timeout
    assert opened["started_at"] - killed_at < 3.0, f"round 1 opened {opened['started_at'] - killed_at:.2f}s after"
    assert victim_id in opened["reason"] and "lost" in opened["reason"], opened["reason"]
    assert (view["world_size"], view["restarts"]) == (2, 0), "losing a node is not a worker failure"
    assert (view["master_addr"], view["master_port"]) != old_master
    assert victim_id not in {n["node_id"] for n in view["nodes"]}
    _all_running(survivors, restart=1, world=2, step=3, timeout=30)
    for a in survivors:
        assert a.popen.poll() is None, a.text()


@pytest.mark.timeout(90)
def test_new_node_scales_a_running_job_up(cluster: Cluster) -> None:
    """A third agent arriving at a 2:3 job that runs with 2: all three re-form
    with world 3, and the scale-up does not count as a restart."""
    server = cluster.start_server()
    first = [
        cluster.start_agent(server, "grow", "loop.py", "--steps", "400", "--interval", "0.05", nnodes="2:3")
        for _ in range(2)
    ]
    _all_running(first, restart=0, world=2, step=2)
    late = cluster.start_agent(server, "grow", "loop.py", "--steps", "400", "--interval", "0.05", nnodes="2:3")
    _all_running([*first, late], restart=1, world=3, step=1, timeout=40)
    view = server.job("grow")
    assert (view["round"], view["world_size"], view["restarts"]) == (1, 3, 0), view
    assert "scale-up" in view["history"][-1]["reason"], view["history"]
    assert sorted(n["group_rank"] for n in view["nodes"]) == [0, 1, 2]
    assert not any(s.restart == 0 for s in late.steps()), "the late node never ran round 0"


@pytest.mark.timeout(90)
def test_worker_failure_restarts_every_node_once(cluster: Cluster, tmp_path) -> None:
    """A worker that exits 1 once: every node restarts with
    TORCHELASTIC_RESTART_COUNT 1 (the same everywhere), the job then
    succeeds, and REST counts exactly one restart."""
    server = cluster.start_server()
    marker = tmp_path / "failed-once"
    agents = [
        cluster.start_agent(
            server,
            "once",
            "loop.py",
            "--steps",
            "8",
            "--interval",
            "0.05",
            "--fail-once",
            str(marker),
            "--fail-rank",
            "1",
            nproc=2,
        )
        for _ in range(2)
    ]
    for a in agents:
        assert a.wait_exit(75) == 0, a.text()
    assert marker.exists()
    for a in agents:
        assert {s.restart for s in a.steps() if s.step == 1} == {0, 1}
        final = [s for s in a.steps() if s.step == 8]
        assert len(final) == 2 and {s.restart for s in final} == {1}, final
        assert {s.world for s in final} == {4}
        assert "round 1: worker failure" in a.text()
        assert "injected one-time failure on rank 1" in a.text()
    view = server.job("once")
    assert (view["state"], view["round"], view["restarts"]) == ("succeeded", 1, 1), view
    assert "worker failure" in view["history"][-1]["reason"] and "rank 1" in view["history"][-1]["reason"]


@pytest.mark.timeout(90)
def test_spent_budget_fails_every_agent_with_the_root_cause(cluster: Cluster) -> None:
    """--max-restarts 1 and a node whose worker always fails: every agent
    exits 1 and prints the root cause (that node, its rank, how it exited, the
    error file's message), not the peers' cascading connection errors."""
    server = cluster.start_server()
    args = ("loop.py", "--steps", "200", "--interval", "0.1", "--fail-if-env", "E2E_ALWAYS_FAIL")
    good = cluster.start_agent(server, "budget", *args, flags=("--max-restarts", "1"))
    bad = cluster.start_agent(server, "budget", *args, flags=("--max-restarts", "1"), env={"E2E_ALWAYS_FAIL": "1"})
    for a in (good, bad):
        assert a.wait_exit(75) == 1, a.text()
    m = bad.wait_log(r"node (\S+): round 1: group rank (\d) of 2, ranks (\d)-", timeout=1)[0]
    bad_id, bad_rank = m.group(1), int(m.group(3))
    for a in (good, bad):
        line = a.wait_log(r"^\[rdzv-agent\] job budget failed: .*$", timeout=1)[0].group(0)
        assert "restart budget of 1 spent" in line, line
        assert f"node {bad_id}" in line and f"rank {bad_rank} " in line, (bad_id, bad_rank, line)
        # exit 1 after the traceback; or SIGABRT when the peer's agent stops its
        # worker while this one's interpreter tears down (gloo's thread sees the
        # closed pair and aborts): either way the error file's message is the cause
        assert re.search(r"failed with (exit code 1|signal SIGABRT): ", line), line
        assert "injected failure on rank" in line, line
        assert "Connection closed" not in line, line
    view = server.job("budget")
    assert (view["state"], view["restarts"], view["round"]) == ("failed", 1, 1), view
    assert bad_id in view["root_cause"], view["root_cause"]
    assert not cluster.leftovers()


@pytest.mark.timeout(90)
def test_sigterm_agent_leaves_and_the_rest_reform_at_once(cluster: Cluster) -> None:
    """SIGTERM to one agent of 3: it exits 128+15 and the other two re-form
    with world 2 right away (the leave is news), well before a heartbeat
    timeout could have told the server; the history says it left."""
    server = cluster.start_server()
    agents = [
        cluster.start_agent(server, "term", "loop.py", "--steps", "400", "--interval", "0.05", nnodes="2:3")
        for _ in range(3)
    ]
    _all_running(agents, restart=0, world=3, step=2)
    leaver, survivors = agents[1], [agents[0], agents[2]]
    leaver_id = leaver.wait_log(r"node (\S+): joining", timeout=1)[0].group(1)
    leaver_workers = cluster.workers_of(leaver)
    assert leaver_workers
    sent_at = time.time()
    os.kill(leaver.pid, signal.SIGTERM)
    assert leaver.wait_exit(20) == 128 + signal.SIGTERM, leaver.text()
    view = server.wait_job("term", lambda v: v["round"] == 1 and v["state"] == "running", 20, "round 1 running")
    opened = view["history"][-1]
    assert "left" in opened["reason"] and leaver_id in opened["reason"], opened
    assert opened["started_at"] - sent_at < 3.0, f"round 1 opened {opened['started_at'] - sent_at:.2f}s after SIGTERM"
    assert opened["started_at"] - sent_at < HEARTBEAT_TIMEOUT_S / 2
    assert (view["world_size"], view["restarts"]) == (2, 0), view
    _all_running(survivors, restart=1, world=2, step=1, timeout=30)
    assert not set(leaver_workers) & set(cluster.leftovers()), "the leaver's workers outlived it"


@pytest.mark.timeout(90)
def test_frozen_server_does_not_restart_workers(cluster: Cluster) -> None:
    """The server stopped (SIGSTOP) for 4 s, then continued: no round
    changes, no worker is restarted (same pids, never restart 1), and
    training runs on to success."""
    server = cluster.start_server()
    agents = [
        cluster.start_agent(server, "freeze", "loop.py", "--steps", "160", "--interval", "0.05") for _ in range(2)
    ]
    _all_running(agents, restart=0, world=2, step=3)
    os.kill(server.pid, signal.SIGSTOP)
    try:
        frozen_at_step = max(s.step for s in agents[0].steps())
        # the workers do not need the server: they keep stepping while it is frozen
        wait_until(
            lambda: max(s.step for s in agents[0].steps()) >= frozen_at_step + 10,
            15,
            "steps while the server is frozen",
        )
        time.sleep(max(0.0, 4.0 - 0.05 * 10))  # the freeze itself is the input here, not a wait for a result
    finally:
        os.kill(server.pid, signal.SIGCONT)
    for a in agents:
        assert a.wait_exit(60) == 0, a.text()
    view = server.job("freeze")
    assert (view["state"], view["round"], view["restarts"]) == ("succeeded", 0, 0), view
    for a in agents:
        steps = a.steps()
        assert {s.restart for s in steps} == {0}
        assert len({s.pid for s in steps}) == 1, "a worker was restarted"
        assert max(s.step for s in steps) == 160


@pytest.mark.timeout(90)
def test_closing_the_job_stops_every_agent_and_worker(cluster: Cluster) -> None:
    """POST /v1/jobs/{id}/close: every agent stops its workers and exits 1,
    and no worker process is left behind."""
    server = cluster.start_server()
    agents = [
        cluster.start_agent(server, "closeme", "loop.py", "--steps", "1000", "--interval", "0.05", nproc=2)
        for _ in range(2)
    ]
    _all_running(agents, restart=0, world=4, step=2)
    workers = [p for a in agents for p in cluster.workers_of(a)]
    assert len(workers) >= 4, workers
    assert server.close_job("closeme")["state"] == "closed"
    for a in agents:
        assert a.wait_exit(30) == 1, a.text()
        assert "job closeme closed" in a.text()
    assert not cluster.leftovers(), "worker processes outlived their agents"
    assert server.job("closeme")["state"] == "closed"
