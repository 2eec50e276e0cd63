"""Direct re-formation with real agents and gloo workers (design.md "Direct
re-formation"): a node loss and a scale-up are formed by the server in the step
that opened them, each survivor's ``restart`` carries its place, and rank 0's
store moves to a port its workers never listened on; an agent with a health
check joins again as before."""

from __future__ import annotations

import pytest

from tests.helpers.cluster import Cluster
from tests.helpers.procs import wait_until

pytestmark = pytest.mark.e2e


def _ran(agent, restart: int, world: int, step: int = 1) -> bool:
    return any(s.restart == restart and s.world == world and s.step >= step for s in agent.steps())


def _all_running(agents, restart: int, world: int, step: int = 1, timeout: float = 60.0) -> None:
    wait_until(
        lambda: all(_ran(a, restart, world, step) for a in agents),
        timeout,
        f"every agent's workers at step {step} of restart {restart} with world {world}",
    )


def _start(cluster: Cluster, server, job: str, flags: tuple[str, ...] = ()):
    args = ("--steps", "600", "--interval", "0.05", "--on-collective-error", "exit")
    return cluster.start_agent(server, job, "loop.py", *args, nnodes="2:3", flags=flags)


@pytest.mark.timeout(120)
def test_a_lost_node_and_a_new_one_reform_without_joins_and_rank0_moves_its_store(cluster: Cluster) -> None:
    server = cluster.start_server()
    agents = [_start(cluster, server, "direct") for _ in range(3)]
    _all_running(agents, restart=0, world=3, step=2)
    view = server.job("direct")
    ranks = {n["node_id"]: n["group_rank"] for n in view["nodes"]}
    head = next(nid for nid, r in ranks.items() if r == 0)
    victim = next(a for a in agents if f"node {next(nid for nid, r in ranks.items() if r == 2)}:" in a.text())
    ports = [view["master_port"]]
    cluster.kill_node(victim)
    view = server.wait_job("direct", lambda v: v["round"] == 1 and v["state"] == "running", 20, "round 1 running")
    survivors = [a for a in agents if a is not victim]
    _all_running(survivors, restart=1, world=2, step=3, timeout=30)
    for a in survivors:
        a.wait_log(r"round 1: node .* lost.*; stopping workers and taking its place", timeout=5)
        assert "rejoining" not in a.text(), a.text()
    # the same node holds rank 0 (MASTER_ADDR stays), its store on a port of its join's offer
    assert {n["node_id"]: n["group_rank"] for n in view["nodes"]}[head] == 0
    assert view["master_port"] not in ports
    ports.append(view["master_port"])
    rec = view["history"][-1]
    assert rec["completed_at"] == rec["started_at"], "formed in the step that opened it"
    late = _start(cluster, server, "direct")
    _all_running([*survivors, late], restart=2, world=3, step=2, timeout=40)
    view = server.job("direct")
    assert (view["round"], view["restarts"]) == (2, 0)
    assert view["master_port"] not in ports
    for a in survivors:
        a.wait_log(r"round 2: scale-up.*; stopping workers and taking its place", timeout=5)
    for a in [*survivors, late]:
        assert a.popen.poll() is None, a.text()


@pytest.mark.timeout(120)
def test_an_agent_with_a_health_check_joins_again_after_a_restart(cluster: Cluster) -> None:
    server = cluster.start_server()
    agents = [_start(cluster, server, "checked", ("--health-check", "true")) for _ in range(3)]
    _all_running(agents, restart=0, world=3, step=2)
    cluster.kill_node(agents[2])
    server.wait_job("checked", lambda v: v["round"] == 1 and v["state"] == "running", 20, "round 1 running")
    _all_running(agents[:2], restart=1, world=2, step=2, timeout=30)
    for a in agents[:2]:
        a.wait_log(r"round 1: .*; stopping workers and rejoining", timeout=5)
