"""Lock-step stragglers by their compute (issue 22) over the real app:
simulated agents send progress heartbeats with their ranks' timings; the rank
that computes 5x longer (same step rate as the others) is flagged in the job
view, the event stream, the log, /metrics, ``rdzv status`` and its host's
record; under ``replace`` a waiting spare takes its node's place."""

from __future__ import annotations

import asyncio
import logging

from rdzv_client.cli import render_job
from rdzv_common.protocol import HeartbeatMsg, JobSpec, JobView, RankTiming

from .conftest import join_msg
from .test_events import open_stream

DEADLINE = 10.0
FRACTIONS = (0.2, 0.2, 0.95)  # n2 computes nearly all its window: the others wait for it in the all-reduce


async def _view(client, job_id: str) -> dict:
    return await (await client.get(f"/v1/jobs/{job_id}")).json()


async def _form(connect, job_id: str, node_ids: list[str], spec: JobSpec) -> list:
    agents = [await connect() for _ in node_ids]
    for agent, node_id in zip(agents, node_ids):
        await agent.send(join_msg(job_id, node_id, spec=spec))
    for agent in agents:
        await agent.expect("joined")
        await agent.expect("assigned")
    return agents


def _beat(step: int, fraction: float) -> HeartbeatMsg:
    timing = RankTiming(local_rank=0, window_s=1.0, steps=10, compute_s=fraction, wait_s=1.0 - fraction)
    return HeartbeatMsg(step=step, rate=10.0, timings=[timing])  # lock-step: the same steps/s everywhere


async def _lock_step(client, job_id: str, agents: list) -> None:
    """Every node at 10 steps/s, n2 computing 0.95 of its time and the others
    0.2; once the server has all three nodes' timings (any order), more
    heartbeats from n0 for the checks after the window (the first slow check
    starts it)."""
    for agent, fraction in zip(agents, FRACTIONS):
        await agent.send(_beat(100, fraction))
    for _ in range(500):
        if all(n["timings"] is not None for n in (await _view(client, job_id))["nodes"]):
            break
        await asyncio.sleep(0.01)
    for i in range(1, 3):
        await agents[0].send(_beat(100 + i, FRACTIONS[0]))
        await asyncio.sleep(0.01)


async def test_a_rank_that_computes_5x_longer_is_flagged_in_the_view_event_log_metric_status_and_host(
    client, connect, monkeypatch, caplog
) -> None:
    from rdzv_server.rounds import progress

    monkeypatch.setattr(progress, "STRAGGLER_CHECK_S", 0.0)
    caplog.set_level(logging.INFO, logger="rdzv_server")
    spec = JobSpec(min_nodes=3, max_nodes=3, straggler_window_s=0.001)  # flag on the second slow check
    agents = await _form(connect, "ls", ["n0", "n1", "n2"], spec)
    stream = await open_stream(client, "/v1/jobs/ls/events")
    await _lock_step(client, "ls", agents)
    flagged = (await stream.until("straggler_flagged", DEADLINE))[-1]["data"]
    stream.close()
    assert flagged["node"] == "n2" and flagged["host"] == "n2" and flagged["rank"] == 2
    assert flagged["local_rank"] == 0 and abs(flagged["ratio"] - 0.2 / 0.95) < 1e-3
    assert flagged["compute_fraction"] == 0.95 and flagged["median_fraction"] == 0.2 and flagged["window_s"] > 0
    view = await _view(client, "ls")
    nodes = {n["node_id"]: n for n in view["nodes"]}
    assert nodes["n2"]["straggler"] and not nodes["n0"]["straggler"] and not nodes["n1"]["straggler"], nodes
    slow = nodes["n2"]["slow_rank"]
    assert slow["rank"] == 2 and abs(slow["ratio"] - 0.2 / 0.95) < 1e-3 and slow["window_s"] > 0
    assert nodes["n0"]["slow_rank"] is None
    # rdzv status
    text = render_job(JobView.model_validate(view))
    assert "STRAGGLER rank 2: compute score 0.21" in text, text
    # the log line: the event's
    lines = [r.getMessage() for r in caplog.records if getattr(r, "rdzv", {}).get("event") == "straggler_flagged"]
    assert len(lines) == 1 and "rank 2 (local rank 0) of node n2 (n2) is a straggler" in lines[0], lines
    # the metric
    metrics = await (await client.get("/metrics")).text()
    assert 'rdzv_stragglers_flagged_total{job_id="ls"} 1.0' in metrics
    # a failure of its host
    host = await (await client.get("/v1/hosts/n2")).json()
    assert host["failures_total"] == 1 and "straggler" in host["failures"][-1]["reason"], host
    assert (await client.get("/v1/hosts/n0")).status == 404
    # no more events while it stays slow
    await agents[2].send(_beat(103, FRACTIONS[2]))
    await agents[0].send(_beat(104, FRACTIONS[0]))
    await asyncio.sleep(0.05)
    metrics = await (await client.get("/metrics")).text()
    assert 'rdzv_stragglers_flagged_total{job_id="ls"} 1.0' in metrics


async def test_replace_a_waiting_spare_takes_the_slow_rank_s_node_s_place_no_restart_charged(
    client, connect, monkeypatch
) -> None:
    from rdzv_server.rounds import progress

    monkeypatch.setattr(progress, "STRAGGLER_CHECK_S", 0.0)
    spec = JobSpec(min_nodes=3, max_nodes=3, straggler_policy="replace", straggler_window_s=0.001)
    agents = await _form(connect, "lr", ["n0", "n1", "n2"], spec)
    spare = await connect()
    await spare.send(join_msg("lr", "n3", spec=spec))
    await spare.expect("joined")
    await spare.expect("spare")
    await _lock_step(client, "lr", agents)
    for agent in agents:
        restart = await agent.expect("restart")
        assert restart.round == 1 and "straggler: node(s) n2 (n2) replaced by a spare" in restart.reason
    await agents[2].send(join_msg("lr", "n2", spec=spec))
    await agents[2].expect("joined")
    told = await agents[2].expect("spare")
    assert told.reason is not None and "replaced as a straggler: rank 2 computes 0.950" in told.reason, told
    for agent, node_id in zip(agents[:2], ("n0", "n1")):
        await agent.send(join_msg("lr", node_id, spec=spec))
    for agent in agents[:2]:
        await agent.expect("joined")
        assert (await agent.expect("assigned")).assignment.round == 1
    assert (await spare.expect("assigned")).assignment.round == 1
    view = await _view(client, "lr")
    assert view["round"] == 1 and view["restarts"] == 0 and view["state"] == "running"
    assert sorted(n["node_id"] for n in view["nodes"]) == ["n0", "n1", "n3"]
    assert [n["node_id"] for n in view["spares"]] == ["n2"]


async def test_a_step_rate_flag_without_timings_counts_against_its_host_too(client, connect, monkeypatch) -> None:
    from rdzv_server.rounds import progress

    monkeypatch.setattr(progress, "STRAGGLER_CHECK_S", 0.0)
    spec = JobSpec(min_nodes=3, max_nodes=3, straggler_window_s=0.001)
    agents = await _form(connect, "lh", ["n0", "n1", "n2"], spec)
    for agent, rate in zip(agents, (10.0, 10.0, 1.0)):  # not lock-stepped, no timings
        await agent.send(HeartbeatMsg(step=100, rate=rate))
    for _ in range(500):
        if all(n["steps_per_s"] is not None for n in (await _view(client, "lh"))["nodes"]):
            break
        await asyncio.sleep(0.01)
    for i in range(1, 3):
        await agents[0].send(HeartbeatMsg(step=100 + i, rate=10.0))
        await asyncio.sleep(0.01)
    for _ in range(500):
        resp = await client.get("/v1/hosts/n2")
        if resp.status == 200:
            break
        await asyncio.sleep(0.01)
    host = await resp.json()
    assert host["failures_total"] == 1 and "is a straggler: 1 steps/s" in host["failures"][-1]["reason"], host
    nodes = {n["node_id"]: n for n in (await _view(client, "lh"))["nodes"]}
    assert nodes["n2"]["straggler"] and nodes["n2"]["slow_rank"] is None
