"""The json log and the event stream tell the same story (the real app): every
event the stream carries is a log line with the same ``event``, job, round,
node and fields, in the same order, and no log line names an event the stream
did not carry. Both read the typed events the round machine returns."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from rdzv_common.logs import EVENTS, JsonFormatter
from rdzv_common.protocol import ExitRecord, FailedMsg, HeartbeatMsg, JobSpec, LeaveMsg, RankTiming, SucceededMsg
from rdzv_server.app import Settings
from tests.api.conftest import join_msg
from tests.api.test_events import open_stream

DEADLINE = 10.0
_CORE = ("id", "time", "type", "job", "run", "round", "node")
_LOG_CORE = ("time", "level", "logger", "job", "round", "node", "event", "message")


def _logged(caplog: pytest.LogCaptureFixture) -> list[dict]:
    """The captured lines that name an event, as the json format writes them."""
    rows = [json.loads(JsonFormatter().format(r)) for r in caplog.records]
    return [r for r in rows if r["event"] is not None]


def _key(event: str, data: dict) -> tuple:
    return (event, data["job"], data["round"], data["node"])


def _fields(data: dict, core: tuple[str, ...]) -> dict:
    return {k: v for k, v in data.items() if k not in core and k != "run"}


async def _read(stream, stop) -> list[dict]:
    got: list[dict] = []
    while not stop(got):
        got.append(await stream.next(DEADLINE))
    return got


async def test_a_connection_lost_past_the_grace_is_node_lost_in_the_log_and_the_stream(make_client, connect, caplog):
    """SIGKILL an agent (its connection drops) and wait past the grace: the
    stream says node_lost (docs/design.md); the json log said node_evicted."""
    caplog.set_level(logging.INFO)
    client = await make_client(Settings(disconnect_grace_s=0.2))
    agents = [await connect(on=client) for _ in range(2)]
    for agent, node in zip(agents, ("node1", "node2")):
        await agent.send(join_msg("ag1", node, (1, 2)))
    for agent in agents:
        await agent.expect("joined")
        await agent.expect("assigned")
    stream = await open_stream(client, "/v1/jobs/ag1/events")
    await agents[1].close()  # its connection drops
    got = await stream.until("round_opened", DEADLINE)
    stream.close()
    streamed = [e for e in got if e["data"]["node"] == "node2"]
    assert [e["event"] for e in streamed] == ["node_lost"] and "connection lost" in streamed[0]["data"]["reason"]
    logged = [r for r in _logged(caplog) if r["node"] == "node2" and r["event"] in ("node_lost", "node_evicted")]
    assert [r["event"] for r in logged] == ["node_lost"], logged
    assert logged[0]["reason"] == streamed[0]["data"]["reason"]


async def test_every_event_kind_is_the_same_in_the_log_and_the_stream(make_client, connect, caplog, monkeypatch):
    from rdzv_server.rounds import progress

    monkeypatch.setattr(progress, "STRAGGLER_CHECK_S", 0.0)
    caplog.set_level(logging.INFO)
    client = await make_client(Settings(disconnect_grace_s=0.2))
    stream = await open_stream(client, "/v1/events")
    assert (await client.post("/v1/hosts/h9/cordon", json={"reason": "bad disk", "ttl_s": 60})).status == 200
    assert (await client.post("/v1/hosts/h9/uncordon")).status == 200
    # a job of three: formed, a failure (charged, a new round), one leaves, one is lost, the rest succeed
    spec = JobSpec(min_nodes=1, max_nodes=3, max_restarts=3)
    agents = [await connect(on=client) for _ in range(3)]
    names = ["node1", "node2", "node3"]
    for agent, node in zip(agents, names):
        await agent.send(join_msg("ag2", node, spec=spec))
    for agent in agents:
        await agent.expect("joined")
        await agent.expect("assigned")
    rec = ExitRecord(local_rank=0, rank=1, pid=42, exit_code=3, message="boom")
    await agents[1].send(FailedMsg(round=0, failures=[rec]))
    for agent, node in zip(agents, names):
        await agent.expect("restart")
        if node == "node2":
            await agent.expect("ack")  # of its failure report
        await agent.send(join_msg("ag2", node, spec=spec))
        await agent.expect("joined")
    for agent in agents:
        await agent.expect("assigned")
    await agents[2].send(LeaveMsg(reason="agent got SIGTERM"))  # node_lost: it left
    await agents[1].close()  # node_lost: its connection stayed lost past the grace (round 2 is open by then)
    await agents[0].expect("restart", DEADLINE)
    await agents[0].send(join_msg("ag2", "node1", spec=spec))
    await agents[0].expect("joined")
    await agents[0].expect("assigned")
    await agents[0].send(SucceededMsg(round=2))
    # a lock-step job whose third rank computes 5x longer: straggler_flagged (rounds.slow_ranks)
    timed = JobSpec(min_nodes=3, max_nodes=3, straggler_window_s=0.001)
    lock = [await connect(on=client) for _ in range(3)]
    for agent, node in zip(lock, ("node5", "node6", "node7")):
        await agent.send(join_msg("ag4", node, spec=timed))
    for agent in lock:
        await agent.expect("joined")
        await agent.expect("assigned")
    for i in range(4):  # the second check after all three nodes' timings came flags it (any order)
        for agent, fraction in zip(lock, (0.2, 0.2, 0.95)):
            timing = RankTiming(local_rank=0, window_s=1.0, steps=10, compute_s=fraction, wait_s=1 - fraction)
            await agent.send(HeartbeatMsg(step=10 + i, rate=10.0, timings=[timing]))
        await asyncio.sleep(0.02)  # past the 1 ms window before the next round of checks
    # a silent node of another job: evicted (no heartbeat within its timeout)
    silent = JobSpec(min_nodes=1, max_nodes=1, heartbeat_timeout_s=0.3)
    quiet = await connect(on=client)
    await quiet.send(join_msg("ag3", "node4", spec=silent))
    got = await _read(
        stream,
        lambda g: (
            any(e["event"] == "node_evicted" for e in g)
            and any(e["event"] == "straggler_flagged" for e in g)
            and any(e["event"] == "job_state" and e["data"].get("state") == "succeeded" for e in g)
        ),
    )
    stream.close()
    kinds = {e["event"] for e in got}
    assert kinds == EVENTS, sorted(EVENTS - kinds)
    logged = _logged(caplog)
    assert {r["event"] for r in logged} <= EVENTS
    streamed = [(_key(e["event"], e["data"]), _fields(e["data"], _CORE)) for e in got]
    in_log = [(_key(r["event"], r), _fields(r, _LOG_CORE)) for r in logged][: len(streamed)]
    assert [k for k, _ in in_log] == [k for k, _ in streamed]
    for (key, log_fields), (_, stream_fields) in zip(in_log, streamed):
        assert log_fields == stream_fields, key
