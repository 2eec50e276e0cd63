"""A rank NCCL RAS sees behind (issue 22 item 4) over the real app: a
simulated agent whose workers call nothing sends heartbeats naming its local
rank 1 (``HeartbeatMsg.nccl_lag``); the server flags its node like a compute
straggler (rule nccl_lag) in the job view, the event stream, the log,
/metrics, ``rdzv status`` and its host's record, and lifts the flag when the
agent says none lags. Bogus reports are refused and change nothing."""

from __future__ import annotations

import asyncio
import json
import logging

from rdzv_client.cli import render_job
from rdzv_common.protocol import HeartbeatMsg, JobSpec, JobView, RankLag

from .conftest import form, join_msg
from .test_events import open_stream

DEADLINE = 10.0
LAG = RankLag(local_rank=1, share=0.8, readings=10, behind=1, window_s=10.0)


async def _nodes(client, job_id: str) -> dict:
    return {n["node_id"]: n for n in (await (await client.get(f"/v1/jobs/{job_id}")).json())["nodes"]}


async def test_a_rank_its_agent_sees_behind_in_nccl_ras_is_flagged_in_the_view_event_log_metric_status_and_host(
    client, connect, monkeypatch, caplog
) -> None:
    from rdzv_server.rounds import progress

    monkeypatch.setattr(progress, "STRAGGLER_CHECK_S", 0.0)
    caplog.set_level(logging.INFO, logger="rdzv_server")
    agents, assigned = await form(connect, "nl", ["n0", "n1"], nproc=2)
    stream = await open_stream(client, "/v1/jobs/nl/events")
    await agents[1].send(HeartbeatMsg(nccl_lag=[LAG]))
    flagged = (await stream.until("straggler_flagged", DEADLINE))[-1]["data"]
    stream.close()
    rank = assigned["n1"].rank_offset + 1
    assert flagged["node"] == "n1" and flagged["host"] == "n1" and flagged["rule"] == "nccl_lag"
    assert flagged["rank"] == rank and flagged["local_rank"] == 1 and flagged["lag_share"] == 0.8
    assert flagged["readings"] == 10 and flagged["collectives_behind"] == 1 and flagged["window_s"] == 10.0
    nodes = await _nodes(client, "nl")
    assert nodes["n1"]["straggler"] and not nodes["n0"]["straggler"], nodes
    slow = nodes["n1"]["slow_rank"]
    assert slow["rule"] == "nccl_lag" and slow["rank"] == rank and slow["lag_share"] == 0.8 and slow["ratio"] is None
    text = render_job(JobView.model_validate(await (await client.get("/v1/jobs/nl")).json()))
    assert f"STRAGGLER rank {rank}: behind in NCCL RAS 80% of 10 readings" in text, text
    lines = [r.getMessage() for r in caplog.records if getattr(r, "rdzv", {}).get("event") == "straggler_flagged"]
    assert len(lines) == 1 and f"rank {rank} (local rank 1) of node n1 (n1) is a straggler: NCCL RAS" in lines[0]
    metrics = await (await client.get("/metrics")).text()
    assert 'rdzv_stragglers_flagged_total{job_id="nl"} 1.0' in metrics
    host = await (await client.get("/v1/hosts/n1")).json()
    assert host["failures_total"] == 1 and "NCCL RAS" in host["failures"][-1]["reason"], host
    # renewed: no second flag; then none lags any more ([]): lifted
    await agents[1].send(HeartbeatMsg(nccl_lag=[LAG]))
    await agents[1].send(HeartbeatMsg(nccl_lag=[]))
    for _ in range(500):
        nodes = await _nodes(client, "nl")
        if not nodes["n1"]["straggler"]:
            break
        await asyncio.sleep(0.01)
    assert not nodes["n1"]["straggler"] and nodes["n1"]["slow_rank"] is None
    metrics = await (await client.get("/metrics")).text()
    assert 'rdzv_stragglers_flagged_total{job_id="nl"} 1.0' in metrics


async def test_bogus_nccl_lag_reports_are_refused_and_change_nothing(client, connect, monkeypatch) -> None:
    from rdzv_server.rounds import progress

    monkeypatch.setattr(progress, "STRAGGLER_CHECK_S", 0.0)
    agents, _ = await form(connect, "nb", ["n0", "n1"], nproc=2)
    stream = await open_stream(client, "/v1/jobs/nb/events")
    ok = LAG.model_dump(mode="json")
    for bad, says in (
        ([{**ok, "local_rank": 2}], "nccl_lag: local rank 2, but node 'n1' has 2 local rank(s)"),  # it has 2
        ([{**ok, "share": 5.0}], "share"),
        ([{**ok, "share": 0}], "share"),
        ([{**ok, "behind": -1}], "behind"),
        ([{**ok, "window_s": float("nan")}], "window_s"),
        ([{**ok, "local_rank": 1}, {**ok, "local_rank": 0}], "increasing local_rank order"),
        ([{**ok, "evil": True}], "evil"),
        ([ok] * 257, "nccl_lag"),  # more than MAX_TIMINGS
        ({"local_rank": 1}, "nccl_lag"),
    ):
        await agents[1].send(json.dumps({"op": "hb", "nccl_lag": bad}, allow_nan=True))
        err = await agents[1].expect("error")
        assert err.code.value == "validation_error" and says in err.message and "\n" not in err.message, err
    # nothing changed: not flagged, no event, no host record; the connection stays
    await agents[1].send(HeartbeatMsg(step=3, rate=1.0))
    for _ in range(500):
        nodes = await _nodes(client, "nb")
        if nodes["n1"]["step"] == 3:
            break
        await asyncio.sleep(0.01)
    assert not nodes["n1"]["straggler"] and nodes["n1"]["slow_rank"] is None
    assert (await client.get("/v1/hosts/n1")).status == 404
    assert not agents[1].ws.closed
    # the first flag the stream sees is the good report's that follows
    await agents[1].send(HeartbeatMsg(nccl_lag=[LAG.model_copy(update={"share": 0.5})]))
    flags = [e for e in await stream.until("straggler_flagged", DEADLINE) if e["event"] == "straggler_flagged"]
    stream.close()
    assert [e["data"]["lag_share"] for e in flags] == [0.5]


async def test_replace_a_waiting_spare_takes_the_lagging_node_s_place_no_restart_charged(
    client, connect, monkeypatch
) -> None:
    from rdzv_server.rounds import progress

    monkeypatch.setattr(progress, "STRAGGLER_CHECK_S", 0.0)
    spec = JobSpec(min_nodes=2, max_nodes=2, straggler_policy="replace")
    agents = [await connect() for _ in range(2)]
    for agent, node_id in zip(agents, ("n0", "n1")):
        await agent.send(join_msg("nr", node_id, (2, 2), nproc=2, spec=spec))
    for agent in agents:
        await agent.expect("joined")
        await agent.expect("assigned")
    spare = await connect()
    await spare.send(join_msg("nr", "n2", (2, 2), nproc=2, spec=spec))
    await spare.expect("joined")
    await spare.expect("spare")
    await agents[1].send(HeartbeatMsg(nccl_lag=[LAG]))
    for agent in agents:
        restart = await agent.expect("restart")
        assert restart.round == 1 and "straggler: node(s) n1 (n1) replaced by a spare" in restart.reason
    await agents[1].send(join_msg("nr", "n1", (2, 2), nproc=2, spec=spec))
    await agents[1].expect("joined")
    told = await agents[1].expect("spare")
    assert told.reason is not None and "behind its NCCL communicator in 80% of 10 RAS readings" in told.reason
    await agents[0].send(join_msg("nr", "n0", (2, 2), nproc=2, spec=spec))
    await agents[0].expect("joined")
    assert (await agents[0].expect("assigned")).assignment.round == 1
    assert (await spare.expect("assigned")).assignment.round == 1
    view = await (await client.get("/v1/jobs/nr")).json()
    assert view["round"] == 1 and view["restarts"] == 0 and view["state"] == "running"
    assert sorted(n["node_id"] for n in view["nodes"]) == ["n0", "n2"]
    assert [n["node_id"] for n in view["spares"]] == ["n1"] and not view["spares"][0]["straggler"]
