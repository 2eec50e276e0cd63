"""Issue 19, items 1 and 6 (event streams), against the real app: a failure
loop with 4-byte-character messages keeps the ring, every event and the job's
SQLite row under their byte caps; a ``?since=0`` answer is bounded and says
how to go on; a stream that never reads is dropped (its queue released) when
its socket does not drain; one client address holds a bounded number of
streams."""

from __future__ import annotations

import asyncio
import json
import socket
import sqlite3

import aiohttp

from rdzv_common.protocol import ExitRecord, FailedMsg, JobSpec
from rdzv_common.sizes import MAX_REASON_BYTES, TRUNCATED, json_len
from rdzv_server.app import Settings
from rdzv_server.events import MAX_EVENT_BYTES
from rdzv_server.keys import EVENTS
from rdzv_server.sse import MAX_SINCE_BYTES
from tests.api.conftest import join_msg
from tests.api.test_events import open_stream

DEADLINE = 10.0
WIDE = "\U0001f600"  # 12 bytes once JSON-escaped


async def until(check, what: str, deadline: float = DEADLINE) -> None:
    for _ in range(int(deadline / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not within {deadline} s: {what}")


async def next_op(agent) -> str:
    """The next message's op, acks and joined aside."""
    while (msg := await agent.recv()).op in ("ack", "joined"):
        pass
    return msg.op


async def test_a_failure_loop_with_wide_messages_stays_under_the_byte_caps(make_client, connect, tmp_path):
    ring_bytes = 200 * 1024
    client = await make_client(Settings(data_dir=tmp_path, event_ring_bytes=ring_bytes))
    events = client.app[EVENTS]
    agent = await connect(on=client)
    spec = JobSpec(min_nodes=1, max_nodes=1, max_restarts=10_000, storm_restarts=0)
    await agent.send(join_msg("loop", "node1", (1, 1), spec=spec))
    await agent.expect("joined")
    await agent.expect("assigned")
    message = WIDE * 2000  # 24 KB once JSON-escaped
    loops = 40
    for i in range(loops):
        fails = [ExitRecord(local_rank=r, rank=r, pid=10 + r, exit_code=1, message=message) for r in range(2)]
        await agent.send(FailedMsg(round=i, failures=fails))
        assert await next_op(agent) == "restart"
        await agent.send(join_msg("loop", "node1", (1, 1), spec=spec))
        assert await next_op(agent) == "assigned"
    assert events.ring_bytes <= ring_bytes and len(events.ring) < 6 * loops  # the oldest went
    failed = [json.loads(e.data) for e in events.ring if e.type == "node_failed"]
    assert failed and all(len(e.data) <= MAX_EVENT_BYTES for e in events.ring)
    assert all(f["truncated"] and f["cause"].endswith(TRUNCATED) for f in failed)
    view = await (await client.get("/v1/jobs/loop")).json()
    assert view["restarts"] == loops
    assert all(json_len(h["reason"]) <= MAX_REASON_BYTES for h in view["history"])
    with sqlite3.connect(tmp_path / "rdzv.db") as db:
        (row,) = db.execute("SELECT record FROM jobs WHERE job_id = 'loop'").fetchone()
    # before: ~6 KB more per failure (500 characters of 12 bytes, per round record)
    assert len(row) <= (loops + 1) * (MAX_REASON_BYTES + 200) + 4096, len(row)


async def test_since_zero_is_bounded_and_says_how_to_go_on(make_client):
    client = await make_client(Settings(event_ring=100_000, event_ring_bytes=64 * 1024 * 1024))
    events = client.app[EVENTS]
    for i in range(2000):  # ~14 MB held
        events.emit("host_cordoned", None, host=f"h{i}", reason="x" * 7000)
    held = [e.id for e in events.ring]
    got: list[int] = []
    since, answers = 0, 0
    while True:
        resp = await client.get("/v1/events", params={"since": str(since)})
        assert resp.status == 200 and resp.content_type == "application/json"
        raw = await resp.read()
        assert len(raw) <= MAX_SINCE_BYTES + MAX_EVENT_BYTES + 1024
        body = json.loads(raw)
        assert body["gap"] is False
        got += [e["id"] for e in body["events"]]
        answers += 1
        since = body["last_id"]
        if not body["more"]:
            break
        assert answers < 20
    assert answers >= 3 and got == held
    body = await (await client.get("/v1/events", params={"since": str(since)})).json()
    assert body == {"events": [], "gap": False, "last_id": since, "more": False}


async def test_a_stream_that_never_reads_its_replay_is_dropped_and_released(make_client):
    settings = Settings(event_write_timeout_s=0.5, event_ring=100_000, event_ring_bytes=64 * 1024 * 1024)
    client = await make_client(settings)
    events = client.app[EVENTS]
    for i in range(4000):  # ~28 MB to replay: more than the kernel's socket buffers take
        events.emit("host_cordoned", None, host=f"h{i}", reason="x" * 7000)
    fast = await open_stream(client)
    slow = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
    slow.settimeout(DEADLINE)
    slow.connect((client.host, client.port))
    slow.sendall(b"GET /v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\nLast-Event-ID: 0\r\n\r\n")
    await until(lambda: len(events.subscribers) == 2, "the slow stream subscribed")
    subs = list(events.subscribers)
    # live events meanwhile: queued for it, within its byte budget
    for i in range(5):
        events.emit("host_uncordoned", None, host=f"live{i}")
        assert (await fast.next())["data"]["host"] == f"live{i}"
    await until(lambda: len(events.subscribers) == 1, "the never-reading stream dropped")
    assert events.dropped_total == 1
    gone = [s for s in subs if s not in events.subscribers]
    assert len(gone) == 1 and gone[0].dropped and gone[0].queued_bytes == 0 and not gone[0].queue
    assert "took nothing" in gone[0].why
    # its connection was aborted: after what the kernel buffered, it ends
    try:
        while slow.recv(1 << 20):
            pass
    except ConnectionResetError:
        pass
    slow.close()
    events.emit("host_uncordoned", None, host="after")
    assert (await fast.next())["data"]["host"] == "after"
    assert (await client.get("/healthz")).status == 200
    fast.close()


async def test_one_address_cannot_hold_every_stream(make_client):
    client = await make_client(Settings(max_event_streams_per_addr=2, max_event_streams=10))
    mine = [await open_stream(client), await open_stream(client)]
    resp = await client.get("/v1/events")
    assert resp.status == 503
    body = await resp.json()
    assert body["code"] == "unavailable"
    assert "from 127.0.0.1" in body["message"] and "limit for one client address (2)" in body["message"]
    # another address still gets one (the dashboard of the issue)
    connector = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
    async with aiohttp.ClientSession(connector=connector) as other:
        resp = await other.get(f"http://{client.host}:{client.port}/v1/events")
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        assert {s.addr for s in client.app[EVENTS].subscribers} == {"127.0.0.1", "127.0.0.2"}
        resp.close()
    mine[0].close()
    await until(lambda: client.app[EVENTS].streams_from("127.0.0.1") == 1, "a stream closed")
    again = await open_stream(client)
    again.close()
    mine[1].close()
