"""Stragglers with real agents, a real server and real gloo workers (issue 15):
2 nodes + 1 spare, one node's workers step 10x slower (the ranks do not
synchronize every step, so each progresses at its own pace).
``--straggler-policy replace``: the spare takes the straggler's place in a new
round, and the job trains on to its end; ``warn``: the node is flagged and
nothing else changes.

No timed assertions: every wait has a generous deadline.
"""

from __future__ import annotations

import pytest

from tests.helpers.cluster import Cluster
from tests.helpers.procs import Proc

SLOW = {"E2E_STEP_INTERVAL": "0.5"}  # 2 steps/s against the others' 20


def _agent(cluster: Cluster, server, job: str, host: str, policy: str, steps: int, env=None) -> Proc:
    return cluster.start_agent(
        server,
        job,
        "progress_loop.py",
        "--steps",
        str(steps),
        "--later-steps",  # round 1 (after a replacement) only has to reach its end
        "40",
        "--interval",
        "0.05",
        "--sync-every",
        "0",
        nnodes="2:2",
        flags=(
            "--host-name",
            host,
            "--straggler-policy",
            policy,
            "--straggler-window-s",
            "4",
            "--max-restarts",
            "0",  # a replacement is not charged to the budget
        ),
        env=env,
        name=host,
    )


def _members(view: dict) -> list[str]:
    return sorted(n["host"] for n in view["nodes"])


def _start(cluster: Cluster, server, job: str, policy: str, steps: int) -> dict[str, Proc]:
    agents = {h: _agent(cluster, server, job, h, policy, steps, SLOW if h == "slow" else None) for h in ("slow", "f1")}
    server.wait_job(job, lambda v: v["state"] == "running", 60, "round 0 running")
    agents["f2"] = _agent(cluster, server, job, "f2", policy, steps)
    view = server.wait_job(job, lambda v: len(v["spares"]) == 1, 60, "f2 a spare")
    assert _members(view) == ["f1", "slow"] and view["spares"][0]["host"] == "f2", view
    return agents


@pytest.mark.timeout(120)
def test_policy_replace_the_spare_takes_the_stragglers_place_and_the_job_trains_on(cluster: Cluster) -> None:
    server = cluster.start_server()
    agents = _start(cluster, server, "repl", "replace", steps=300)
    view = server.wait_job("repl", lambda v: v["round"] >= 1 and v["state"] == "running", 90, "round 1 running")
    assert _members(view) == ["f1", "f2"] and view["restarts"] == 0, view
    assert (
        "straggler: node(s)" in view["history"][-1]["reason"]
        and "(slow) replaced by a spare" in (view["history"][-1]["reason"])
    ), view["history"]
    slow = agents["slow"]
    slow.wait_log(r"round 1: straggler: node\(s\) \S+ \(slow\) replaced by a spare; stopping workers", timeout=30)
    line = slow.wait_log(r"waiting as a spare: replaced as a straggler: .*$", timeout=30)[0].group(0)
    assert "below 0.5 x the job's median" in line and "for 4s" in line, line
    assert "is a straggler" in server.text()
    # the job trains on with the spare, to its end; the replaced node exits as a spare does
    for host in ("f1", "f2"):
        assert agents[host].wait_exit(90) == 0, agents[host].text()[-3000:]
    assert "done rank 1 world 2 restart 1" in agents["f1"].text() + agents["f2"].text()
    view = server.job("repl")
    assert view["state"] == "succeeded" and view["round"] == 1 and view["restarts"] == 0, view
    assert slow.wait_exit(30) == 0, slow.text()[-2000:]


@pytest.mark.timeout(120)
def test_policy_warn_flags_the_straggler_and_changes_nothing(cluster: Cluster) -> None:
    server = cluster.start_server()
    agents = _start(cluster, server, "warn", "warn", steps=100000)

    def flagged(v: dict) -> bool:
        return any(n["host"] == "slow" and n["straggler"] for n in v["nodes"])

    view = server.wait_job("warn", flagged, 90, "the slow node flagged")
    assert view["round"] == 0 and view["restarts"] == 0 and _members(view) == ["f1", "slow"], view
    assert [s["host"] for s in view["spares"]] == ["f2"] and view["state"] == "running", view
    assert not any(n["straggler"] for n in view["nodes"] if n["host"] != "slow"), view
    assert "(slow) is a straggler" in server.text() and "straggler policy warn" in server.text()
    assert "replaced" not in agents["slow"].text()
    server.close_job("warn")
    for agent in agents.values():
        assert agent.wait_exit(30) == 1
    view = server.job("warn")
    assert view["round"] == 0 and len(view["history"]) == 1, view


@pytest.mark.timeout(120)
def test_lock_step_the_rank_that_computes_5x_longer_is_flagged_and_only_it(cluster: Cluster) -> None:
    """3 nodes in lock-step (an all_reduce every step: the same steps/s for
    all), one rank's compute (``worker.compute()``) 5x longer: its node, and
    only it, is flagged by its compute (issue 22)."""
    server = cluster.start_server()
    agents = {
        host: cluster.start_agent(
            server,
            "lock",
            "progress_loop.py",
            "--steps",
            "100000",
            "--interval",
            "0.05",
            "--compute",
            nnodes="3:3",
            flags=("--host-name", host, "--straggler-window-s", "2"),
            env={"E2E_STEP_INTERVAL": "0.25"} if host == "slow" else None,
            name=host,
        )
        for host in ("f1", "slow", "f2")
    }

    def flagged(v: dict) -> bool:
        return any(n["straggler"] for n in v["nodes"])

    view = server.wait_job("lock", flagged, 90, "a node flagged")
    nodes = {n["host"]: n for n in view["nodes"]}
    assert [h for h, n in nodes.items() if n["straggler"]] == ["slow"], view
    slow = nodes["slow"]["slow_rank"]
    assert slow is not None and slow["rank"] == nodes["slow"]["group_rank"] and slow["ratio"] < 0.75, slow
    rates = [n["steps_per_s"] for n in nodes.values()]
    assert max(rates) < 1.5 * min(rates), rates  # lock-step: the step-rate rule could not see it
    assert "(slow) is a straggler: compute score" in server.text()
    assert view["round"] == 0 and view["restarts"] == 0, view
    server.close_job("lock")
    for agent in agents.values():
        assert agent.wait_exit(30) == 1
