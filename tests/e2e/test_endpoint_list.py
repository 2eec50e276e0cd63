"""Endpoint lists with real processes (issue 11, client side): a real
rdzv-agent and the real ``rdzv`` command given ``--endpoint DEAD,SERVER``
go past the dead one; an agent whose server is SIGKILLed moves to the next
server of its list and says so. The servers are real standalone rdzv-servers
(memory): failover between HA replicas on etcd is the server's e2e tests'."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cluster import E2E_SCRIPTS, Cluster
from tests.helpers.procs import free_port, start_server

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(90)
def test_an_agent_goes_past_a_dead_endpoint_and_its_job_succeeds(cluster: Cluster, tmp_path: Path) -> None:
    server = cluster.start_server()
    dead = f"127.0.0.1:{free_port()}"
    out = tmp_path / "dumps"
    out.mkdir()
    argv = cluster.agent_argv(f"{dead}, {server.endpoint}", "listjob", "1", 2)
    agent = cluster.start("agent", [*argv, str(E2E_SCRIPTS / "env_dump.py"), str(out)])
    assert agent.wait_exit(60) == 0, agent.text()
    dumps = [json.loads(p.read_text()) for p in sorted(out.glob("env_rank*.json"))]
    assert [(d["rank"], d["world"], d["sum"]) for d in dumps] == [(0, 2, 3.0), (1, 2, 3.0)]  # a real all_reduce
    assert server.job("listjob")["state"] == "succeeded"
    assert f"link: leader is now {server.url}" in agent.text()


@pytest.mark.timeout(60)
def test_the_cli_goes_past_a_dead_endpoint(cluster: Cluster) -> None:
    server = cluster.start_server()
    dead = f"127.0.0.1:{free_port()}"

    def rdzv(endpoint: str, *argv: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "rdzv_client.cli", "--endpoint", endpoint, *argv]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=cluster.env(), check=False)

    done = rdzv(f"{dead},{server.endpoint}", "cordon", "node-x", "--reason", "via a list")
    assert done.returncode == 0, done.stderr
    done = rdzv(f"{dead},{server.endpoint}", "hosts", "--json")
    assert done.returncode == 0, done.stderr
    assert [(h["host"], h["cordon_reason"]) for h in json.loads(done.stdout)["hosts"]] == [("node-x", "via a list")]
    # every endpoint dead: one line naming the last one tried, exit 1
    other = f"127.0.0.1:{free_port()}"
    done = rdzv(f"{dead},{other}", "status")
    assert done.returncode == 1
    assert done.stderr.startswith(f"rdzv: cannot reach rdzv server at http://{other}"), done.stderr
    assert done.stderr.count("\n") == 1


@pytest.mark.timeout(90)
def test_an_agent_whose_server_dies_moves_to_the_next_of_its_list(cluster: Cluster) -> None:
    dirs = [cluster.tmp / "a", cluster.tmp / "b"]
    for d in dirs:
        d.mkdir()
    a, b = (start_server(d, env=cluster.env(), started=cluster.procs) for d in dirs)
    argv = cluster.agent_argv(f"{a.endpoint},{b.endpoint}", "moving", "1", 1)
    agent = cluster.start("agent", [*argv, str(E2E_SCRIPTS / "loop.py"), "--steps", "100000", "--interval", "0.1"])
    agent.wait_log(rf"link: leader is now {a.url}\b", timeout=30)
    agent.wait_log(r"step 1 ", timeout=30)
    os.kill(a.pid, signal.SIGKILL)
    a.wait_exit(10)
    agent.wait_log(rf"link: leader is now {b.url}\b", timeout=30)
    assert agent.popen.poll() is None, agent.text()  # it did not give up


@pytest.mark.timeout(60)
def test_a_host_of_the_list_that_does_not_resolve_is_said_and_skipped(cluster: Cluster) -> None:
    server = cluster.start_server()
    argv = cluster.agent_argv(f"no-such-host.invalid:29400,{server.endpoint}", "dnslist", "2", 1)
    agent = cluster.start("agent", [*argv, str(E2E_SCRIPTS / "loop.py")])
    agent.wait_log(r"'no-such-host\.invalid' does not resolve: .*; trying the other servers of --endpoint", 30)
    agent.wait_log(rf"link: leader is now {server.url}\b", 30)  # and it waits there for a second node
    # none resolves: a usage error at once, naming the first
    res = cluster.run_agent(
        "--endpoint", "no-such-host.invalid:1, also-not.invalid:2", "--job-id", "dns", "--nnodes", "1", "x.py"
    )
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if "rdzv-agent: error" in ln]
    assert len(lines) == 1 and "'no-such-host.invalid' does not resolve" in lines[0], res.stderr
    assert "Traceback" not in res.stderr
