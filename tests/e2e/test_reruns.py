"""Re-runs of a finished job id (issue 12, item 3), with real processes: a
real ``rdzv-server`` (with a data dir), real ``rdzv-agent`` processes or stock
torchrun with ``--rdzv-backend=rdzv``, real gloo workers (scripts/loop.py).

The same command run again starts the job id's next run; an agent of an
ended run that is still retrying is told the run finished and exits, never
starting or joining another run."""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.helpers.cluster import Cluster
from tests.helpers.torchrun import WORKER, WORKER_ARGS, Rig, TorchrunProc

pytestmark = pytest.mark.e2e


def _done(text: str, world: int) -> bool:
    return re.search(rf"done rank \d world {world} restart 0", text) is not None


@pytest.mark.timeout(150)
def test_the_same_agent_command_run_twice_after_success_runs_twice(cluster: Cluster) -> None:
    server = cluster.start_server()
    for run in (1, 2):
        agents = [cluster.start_agent(server, "exp1", "loop.py", "--steps", "3", nnodes="2") for _ in range(2)]
        for agent in agents:
            assert agent.wait_exit(60) == 0, agent.text()[-3000:]
            assert _done(agent.text(), world=2), agent.text()[-3000:]
        view = server.wait_job("exp1", lambda v: v["state"] == "succeeded", 10, f"run {run} succeeded")
        assert view["run"] == run, view
    assert [(r["run"], r["state"], r["rounds"]) for r in view["runs"]] == [(1, "succeeded", 1)], view["runs"]
    assert view["history"][0]["reason"] == "run 2 started (run 1 succeeded)", view["history"]
    # an agent a scheduler started late (a Kubernetes pod) must not start run 3: --no-new-run
    late = cluster.start_agent(server, "exp1", "loop.py", "--steps", "3", nnodes="2", flags=("--no-new-run",))
    assert late.wait_exit(60) == 2, late.text()[-3000:]
    assert "may not start its next run" in late.text(), late.text()[-3000:]
    view = server.job("exp1")
    assert (view["run"], view["state"]) == (2, "succeeded"), view


@pytest.mark.timeout(150)
def test_a_late_agent_of_run_1_does_not_start_or_join_run_2(cluster: Cluster) -> None:
    """An agent frozen (SIGSTOP) long enough to be evicted; meanwhile its run
    is closed and the same command starts run 2. Woken up, it learns it was
    evicted and rejoins as a new node, as agents do: that join carries its run,
    so it is told run 1 is over and exits 2; run 2 never sees it."""
    server = cluster.start_server()
    flags = ("--heartbeat-timeout", "2")
    args = ("--steps", "100000", "--interval", "0.1")
    late = cluster.start_agent(server, "exp2", "loop.py", *args, nnodes="1:2", flags=flags)
    server.wait_job("exp2", lambda v: v["state"] == "running", 60, "run 1 running")
    os.kill(late.pid, signal.SIGSTOP)
    try:
        server.wait_job("exp2", lambda v: not v["nodes"], 30, "the frozen agent's node evicted")
        assert server.close_job("exp2")["state"] == "closed"
        fresh = cluster.start_agent(server, "exp2", "loop.py", *args, nnodes="1:2", flags=flags)
        view = server.wait_job("exp2", lambda v: v["run"] == 2 and v["state"] == "running", 60, "run 2 running")
        run2_nodes = [n["node_id"] for n in view["nodes"]]
    finally:
        os.kill(late.pid, signal.SIGCONT)
    assert late.wait_exit(60) == 2, late.text()[-3000:]
    assert "run 1" in late.text(), late.text()[-3000:]
    view = server.job("exp2")
    assert (view["run"], view["state"]) == (2, "running"), view
    assert [n["node_id"] for n in view["nodes"] + view["spares"]] == run2_nodes, view
    assert [(r["run"], r["state"]) for r in view["runs"]] == [(1, "closed")], view["runs"]
    assert server.close_job("exp2")["state"] == "closed"
    assert fresh.wait_exit(30) == 1, fresh.text()[-3000:]


@pytest.mark.timeout(150)
def test_torchruns_default_job_id_runs_twice_under_the_plugin(rig: Rig) -> None:
    """torchrun without ``--rdzv-id`` uses the job id ``none`` (as accelerate
    does): the second run of the same command starts run 2."""
    rig.start_server()
    for run in (1, 2):
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--rdzv-backend=rdzv",
            f"--rdzv-endpoint={rig.endpoint}",
            "--nnodes=1",
            "--nproc-per-node=1",
            "--monitor-interval=0.1",
            "--local-addr=127.0.0.1",
            str(WORKER),
            *WORKER_ARGS,
            "--steps",
            "3",
        ]
        node = rig.start(f"run{run}", argv, cls=TorchrunProc)
        assert node.wait_exit(90) == 0, node.text()[-3000:]
        assert _done(node.text(), world=1), node.text()[-3000:]
        view = rig.wait_job("none", lambda v: v["state"] == "succeeded", 10, f"run {run} succeeded")
        assert view["run"] == run, view
    assert [(r["run"], r["state"]) for r in view["runs"]] == [(1, "succeeded")], view["runs"]


@pytest.mark.timeout(150)
def test_an_owned_job_id_reruns_only_with_its_job_secret(cluster: Cluster) -> None:
    """Issue 19 item 3: run 1 of "nightly" had a job secret. A stranger's agent
    (no secret, or its own) exits 2 at once saying how the id is reused, and
    the job still shows run 1; the team's same command starts run 2."""
    server = cluster.start_server()
    owner = {"RDZV_JOB_SECRET": "team-nightly-0123456789"}
    args = ("loop.py", "--steps", "3")
    first = cluster.start_agent(server, "nightly", *args, nnodes="1", env=owner)
    assert first.wait_exit(60) == 0, first.text()[-3000:]
    server.wait_job("nightly", lambda v: v["state"] == "succeeded", 10, "run 1 succeeded")
    base = ["--endpoint", server.endpoint, "--job-id", "nightly", "--local-addr", "127.0.0.1", "--nnodes", "1:2"]
    script = str(Path(__file__).parent / "scripts" / "loop.py")
    for env in ({}, {"RDZV_JOB_SECRET": "stranger-0123456789abc"}):
        proc = cluster.run_agent(*base, script, env=env)
        assert proc.returncode == 2, (env, proc.stderr[-3000:])
        errors = [line for line in proc.stderr.splitlines() if "error" in line]
        assert len(errors) == 1 and "owned by its run 1" in errors[0], proc.stderr[-3000:]
        assert "rdzv delete nightly" in errors[0] and "team-nightly" not in proc.stderr, errors
    view = server.job("nightly")
    assert (view["run"], view["state"]) == (1, "succeeded"), view
    second = cluster.start_agent(server, "nightly", *args, nnodes="1", env=owner)
    assert second.wait_exit(60) == 0, second.text()[-3000:]
    view = server.wait_job("nightly", lambda v: v["state"] == "succeeded", 10, "run 2 succeeded")
    assert view["run"] == 2 and [(r["run"], r["state"]) for r in view["runs"]] == [(1, "succeeded")], view


@pytest.mark.timeout(90)
def test_a_restarted_pod_after_a_failed_run_does_not_start_a_lone_run(cluster: Cluster) -> None:
    """Issue 25, item 2: in a Kubernetes pod (KUBERNETES_SERVICE_HOST) the default is --no-new-run: the pod a
    scheduler restarts after its job failed exits 2 at once, naming how to start a new run, and the job id stays
    at its failed run (before: it started run 2 alone and waited out the join timeout)."""
    server = cluster.start_server()
    fail = {"RDZV_TEST_FAIL": "1"}
    args = ("--steps", "3", "--fail-if-env", "RDZV_TEST_FAIL")
    first = cluster.start_agent(server, "podjob", "loop.py", *args, nnodes="1", flags=("--max-restarts", "0"), env=fail)
    assert first.wait_exit(60) == 1, first.text()[-3000:]
    server.wait_job("podjob", lambda v: v["state"] == "failed", 10, "run 1 failed")
    pod = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "RDZV_NO_NEW_RUN": ""}
    restarted = cluster.start_agent(server, "podjob", "loop.py", "--steps", "3", nnodes="1", env=pod)
    assert restarted.wait_exit(30) == 2, restarted.text()[-3000:]
    assert "may not start its next run" in restarted.text() and "--new-run" in restarted.text(), restarted.text()
    view = server.job("podjob")
    assert (view["run"], view["state"]) == (1, "failed"), view
