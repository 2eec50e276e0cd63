"""Bad hosts with real agents and real gloo workers: a host that fails three
times is cooled down while a spare takes over; cordon and drain from the CLI
mid-run; a failing health check keeps a node out while the job runs on the
others."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.cluster import Cluster
from tests.helpers.procs import Proc, wait_until


def cli(server, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rdzv_client.cli", "--endpoint", server.endpoint, *argv],
        capture_output=True,
        text=True,
        timeout=30,
    )


def members(view: dict) -> list[str]:
    return [n["host"] for n in view["nodes"]]


def host_agent(
    cluster: Cluster,
    server,
    job: str,
    host: str,
    *args: str,
    nnodes: str,
    flags: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> Proc:
    return cluster.start_agent(
        server, job, *args, nnodes=nnodes, flags=("--host-name", host, *flags), env=env, name=host
    )


@pytest.mark.timeout(120)
def test_a_host_that_fails_three_times_is_cooled_down_while_a_spare_takes_over(cluster: Cluster) -> None:
    server = cluster.start_server("--host-failures", "3", "--host-cooldown", "10m")
    args = ("loop.py", "--steps", "10", "--interval", "0.1", "--fail-if-env", "E2E_ALWAYS_FAIL")
    flags = ("--max-restarts", "5")
    bad = host_agent(cluster, server, "cool", "bad", *args, nnodes="2:2", flags=flags, env={"E2E_ALWAYS_FAIL": "1"})
    good = host_agent(cluster, server, "cool", "good", *args, nnodes="2:2", flags=flags)
    server.wait_job("cool", lambda v: v["state"] == "running", 60, "round 0 running")
    spare = host_agent(cluster, server, "cool", "spare", *args, nnodes="2:2", flags=flags)
    line = bad.wait_log(r"waiting as a spare: host bad is cooled down.*$", timeout=90)[0].group(0)
    assert "3 failures" in line and "injected failure" in line, line
    for agent in (good, spare):
        assert agent.wait_exit(60) == 0, agent.text()[-3000:]
    view = server.job("cool")
    assert view["state"] == "succeeded" and view["restarts"] == 3, view
    assert view["history"][-1]["nodes"] == 2
    assert sorted(members(view)) == ["good", "spare"], view
    status, host = server.request("GET", "/v1/hosts/bad")
    assert status == 200 and host["state"] == "cooled_down" and host["failures_total"] == 3, host
    assert all(f["job_id"] == "cool" and "injected failure" in f["reason"] for f in host["failures"]), host
    assert server.request("GET", "/v1/hosts/good")[0] == 404  # its failures were echoes: not counted
    assert bad.wait_exit(30) == 0, bad.text()[-2000:]  # the job succeeded: a held spare exits as spares do


@pytest.mark.timeout(120)
def test_cordon_and_drain_from_the_cli_mid_run(cluster: Cluster) -> None:
    server = cluster.start_server()
    args = ("loop.py", "--steps", "100000", "--interval", "0.05")
    agents = {h: host_agent(cluster, server, "drain", h, *args, nnodes="2:2") for h in ("n1", "n2")}
    server.wait_job("drain", lambda v: v["state"] == "running", 60, "round 0 running")
    agents["n3"] = host_agent(cluster, server, "drain", "n3", *args, nnodes="2:2")
    view = server.wait_job("drain", lambda v: len(v["spares"]) == 1, 60, "n3 a spare")
    assert sorted(members(view)) == ["n1", "n2"]
    done = cli(server, "cordon", "n2", "--reason", "bad DIMM", "--ttl", "2h", "--drain")
    assert done.returncode == 0 and "cordoned and drained" in done.stdout, done
    view = server.wait_job("drain", lambda v: v["round"] >= 1 and v["state"] == "running", 30, "round 1 running")
    assert sorted(members(view)) == ["n1", "n3"] and view["restarts"] == 0, view
    assert "drain" in view["history"][-1]["reason"] and "bad DIMM" in view["history"][-1]["reason"]
    agents["n2"].wait_log(r"waiting as a spare: host n2 is cordoned for \dh \d+m more: .*bad DIMM", timeout=30)
    agents["n2"].wait_log(r"round 1: drain: .*; stopping workers and rejoining", timeout=1)
    status = cli(server, "status", "drain")
    assert status.returncode == 0 and "waits: host n2 is cordoned" in status.stdout, status.stdout
    hosts = cli(server, "hosts")
    assert hosts.returncode == 0 and "n2" in hosts.stdout and "cordoned (drain)" in hosts.stdout, hosts.stdout
    back = cli(server, "uncordon", "n2")
    assert back.returncode == 0 and "host n2: ok" in back.stdout, back
    agents["n2"].wait_log(r"this host may be admitted again", timeout=30)
    server.close_job("drain")
    for agent in agents.values():
        assert agent.wait_exit(30) == 1
    audit = server.text()
    assert "host n2 cordoned for 7200s with drain" in audit and "host n2 uncordoned" in audit


@pytest.mark.timeout(120)
def test_a_failing_health_check_keeps_the_node_out_and_the_job_runs_on_the_others(cluster: Cluster) -> None:
    """The check passes once (the first join), then fails: after its worker
    failure the node leaves, says why, and its host record has the line; the
    other two nodes run the job to its end."""
    server = cluster.start_server()
    marker = cluster.tmp / "checked-once"
    check = f"if [ -e {marker} ]; then echo 'GPU 0: matmul failed'; exit 1; fi; touch {marker}"
    args = ("loop.py", "--steps", "40", "--interval", "0.1", "--fail-if-env", "E2E_ALWAYS_FAIL")
    good = [host_agent(cluster, server, "health", h, *args, nnodes="2:3") for h in ("g1", "g2")]
    sick = host_agent(
        cluster,
        server,
        "health",
        "sick",
        *args,
        nnodes="2:3",
        env={"E2E_ALWAYS_FAIL": "1"},
        flags=("--health-check", check, "--health-check-timeout", "10"),
    )
    sick.wait_log(r"health check failed: exit status 1: GPU 0: matmul failed; not joining", timeout=60)
    for agent in good:
        assert agent.wait_exit(90) == 0, agent.text()[-3000:]
    view = server.job("health")
    assert view["state"] == "succeeded" and sorted(members(view)) == ["g1", "g2"], view
    assert view["history"][-1]["nodes"] == 2  # round 1 formed without it: it left the forming round
    assert "(sick) left (health check failed: exit status 1: GPU 0: matmul failed)" in server.text()
    status, host = server.request("GET", "/v1/hosts/sick")
    assert status == 200, host
    assert any(
        f["reason"] == "health check failed: exit status 1: GPU 0: matmul failed" and f["job_id"] == "health"
        for f in host["failures"]
    ), host
    wait_until(
        lambda: len(sick.wait_log(r"health check failed: ", timeout=30, count=2)) >= 2,
        30,
        "the check retried with backoff",
    )
