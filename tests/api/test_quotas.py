"""Per-client quotas and connection limits of issue 19 on the real app: the
waiting-jobs cap a client used as a lever, host records, connections per
address (the real Listener), joined sockets that carry nothing, heartbeat
floods, trickled and missing request bodies."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import WSCloseCode, WSMsgType, web

from rdzv_common.protocol import AGENT_PATH, HEARTBEAT_FRAME, JobSpec, LeaveMsg
from rdzv_server import agent_conn
from rdzv_server.app import Settings, create_app
from rdzv_server.hosts import HostRules
from rdzv_server.listener import Listener
from rdzv_server.quotas import HEALTH_REPORT_BURST

from .conftest import Agent, join_msg

WEEK = 7 * 24 * 3600.0


async def _closed(agent: Agent, timeout: float = 5.0):
    """The close frame the server sent (skipping messages before it)."""
    while True:
        frame = await asyncio.wait_for(agent.ws.receive(), timeout)
        if frame.type != WSMsgType.TEXT:
            return frame


async def test_a_client_that_joins_and_leaves_cannot_make_a_new_job_wait(make_client):
    """The issue's probe: join 1:1 with a 7-day join timeout, leave, until --max-waiting-jobs is
    full. A legitimate new job used to be refused for up to 7 days; now it is created."""
    client = await make_client(Settings(max_waiting_jobs=4))
    spec = JobSpec(min_nodes=1, max_nodes=1, join_timeout_s=WEEK, heartbeat_timeout_s=WEEK)
    for i in range(4):
        attacker = Agent(await client.ws_connect(AGENT_PATH))
        await attacker.send(join_msg(f"junk{i}", "x", spec=spec))
        await attacker.expect("joined")
        await attacker.expect("assigned")
        await attacker.send(LeaveMsg(reason="bye"))
        await attacker.expect("ack")
        await attacker.close()
    waiting = (await (await client.get("/v1/jobs?state=waiting")).json())["jobs"]
    assert len(waiting) == 4, waiting

    team = Agent(await client.ws_connect(AGENT_PATH))
    await team.send(join_msg("team", "n0", (1, 1)))
    await team.expect("joined")  # before: error unavailable "4 jobs are waiting for nodes"
    await team.expect("assigned")
    view = await (await client.get("/v1/jobs/junk3")).json()
    assert view["state"] == "closed", view  # the newest job no connected node held
    await team.close()


async def test_an_operators_cordon_finds_room_after_made_up_health_reports(make_client):
    client = await make_client(Settings(host_rules=HostRules(max_hosts=5, failures=1)))
    for i in range(5):
        resp = await client.post(f"/v1/hosts/fake{i}/health", json={"reason": "made up"})
        assert resp.status == 200
        assert (await resp.json())["state"] == "cooled_down"
    resp = await client.post("/v1/hosts/real-host/cordon", json={"reason": "bad GPU"})
    assert resp.status == 200, await resp.text()  # 503 "the host table is full" before
    assert (await resp.json())["state"] == "cordoned"


async def test_health_reports_are_rate_limited_per_address(client):
    statuses = []
    for i in range(HEALTH_REPORT_BURST + 5):
        resp = await client.post(f"/v1/hosts/h{i}/health", json={"reason": "x"})
        statuses.append(resp.status)
        if resp.status == 429:
            body = await resp.json()
            assert body["code"] == "rate_limited" and "health reports" in body["message"], body
            assert int(resp.headers["Retry-After"]) >= 1
    assert statuses[:HEALTH_REPORT_BURST] == [200] * HEALTH_REPORT_BURST, statuses
    assert statuses[-1] == 429, statuses  # all 200 before
    hosts = (await (await client.get("/v1/hosts?limit=1000")).json())["hosts"]
    assert len(hosts) < HEALTH_REPORT_BURST + 5


async def test_a_joined_socket_that_sends_nothing_is_closed_whatever_its_heartbeat_timeout(make_client):
    client = await make_client(Settings(idle_timeout_s=0.5))
    spec = JobSpec(min_nodes=2, max_nodes=2, heartbeat_timeout_s=WEEK)
    silent = Agent(await client.ws_connect(AGENT_PATH))
    await silent.send(join_msg("j", "quiet", spec=spec))
    await silent.expect("joined")
    live = Agent(await client.ws_connect(AGENT_PATH))
    await live.send(join_msg("j", "live", spec=spec))
    await live.expect("joined")
    frame = await _closed(silent)  # held for the 7-day heartbeat timeout before
    assert frame.type == WSMsgType.CLOSE and frame.data == WSCloseCode.POLICY_VIOLATION, frame
    assert frame.extra == "nothing received for 0.5s", frame
    for _ in range(10):  # an agent that heartbeats (every 2 s at most; here faster) stays
        await live.ws.send_str(HEARTBEAT_FRAME)
        await asyncio.sleep(0.1)
    assert not live.ws.closed
    await live.close()


async def test_a_heartbeat_flood_closes_the_connection(client, connect, monkeypatch):
    monkeypatch.setattr(agent_conn, "FRAME_BURST", 20)
    monkeypatch.setattr(agent_conn, "FRAME_RATE", 1.0)
    flood = await connect()
    await flood.send(join_msg("j", "n0", (2, 2)))
    await flood.expect("joined")
    for _ in range(100):
        if flood.ws.closed:
            break
        await flood.ws.send_str(HEARTBEAT_FRAME)
    frame = await _closed(flood)  # served for ever before
    assert frame.type in (WSMsgType.CLOSE, WSMsgType.CLOSED), frame
    if frame.type == WSMsgType.CLOSE:
        assert frame.data == WSCloseCode.POLICY_VIOLATION and "frames" in frame.extra, frame
    calm = await connect()  # within the bucket: served
    await calm.send(join_msg("k", "n0", (2, 2)))
    await calm.expect("joined")
    for _ in range(5):
        await calm.ws.send_str(HEARTBEAT_FRAME)
    assert (await client.get("/healthz")).status == 200
    assert not calm.ws.closed


async def _raw(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(4096), timeout)
    finally:
        writer.close()


async def test_a_trickled_body_gets_408_at_the_body_deadline(make_client):
    client = await make_client(Settings(body_timeout_s=0.5))
    head = (
        b"POST /v1/hosts/h1/cordon HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n{"
    )
    answer = await _raw(client.port, head)  # held until the client gave up before (the read times out here)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"did not arrive within 0.5s" in answer
    assert (await client.get("/v1/hosts/h1")).status == 404  # nothing changed


@contextlib.asynccontextmanager
async def listening(settings: Settings | None = None, **kw) -> AsyncIterator[int]:
    """The app behind the server's own Listener (as rdzv-server serves it); yields its port."""
    runner = web.AppRunner(create_app(settings or Settings()), access_log=None)
    await runner.setup()
    try:
        site = Listener(runner, "127.0.0.1", 0, **kw)
        await site.start()
        yield site.sockets[0].getsockname()[1]
    finally:
        await runner.cleanup()


async def test_bodies_announced_and_never_sent_are_a_few_lines_not_a_traceback_each(caplog):
    caplog.set_level(logging.INFO)
    head = b"POST /v1/hosts/h1/cordon HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{"
    async with listening() as port:
        writers = []
        for _ in range(30):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head)
            await writer.drain()
            writers.append(writer)
        await asyncio.sleep(0.3)  # the server reads the bodies (a shorter wait only tests less)
        for writer in writers:
            writer.close()
        await asyncio.sleep(0.3)  # let it see the connections go
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/healthz") as resp:
            assert resp.status == 200
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]  # 30 "Error handling request" tracebacks before
    ended = [r for r in caplog.records if "ended before its body" in r.getMessage()]
    assert 1 <= len(ended) <= 10, [r.getMessage() for r in ended]


async def test_one_address_cannot_take_every_connection_slot():
    """The real Listener with --max-connections 10: 127.0.0.1 holds at most half; an agent
    from 127.0.0.2 still joins (refused once one address held all 10 before)."""
    async with listening(max_connections=10) as port:
        await _slots(f"http://127.0.0.1:{port}{AGENT_PATH}")


async def _slots(url: str) -> None:
    hog = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, local_addr=("127.0.0.1", 0)))
    other = aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=("127.0.0.2", 0)))
    held = []
    try:
        refused = 0
        for _ in range(10):
            try:
                ws = await asyncio.wait_for(hog.ws_connect(url), 5)
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError):
                refused += 1
                continue
            held.append(ws)
        assert len(held) == 5 and refused == 5, (len(held), refused)
        agent = Agent(await asyncio.wait_for(other.ws_connect(url), 5))
        await agent.send(join_msg("team", "n0", (1, 1)))
        await agent.expect("joined")
        await agent.close()
        for ws in held:  # closed ones free their address's slots
            await ws.close()
        held.clear()
        await asyncio.sleep(0.2)
        ws = await asyncio.wait_for(hog.ws_connect(url), 5)
        held.append(ws)
    finally:
        for ws in held:
            await ws.close()
        await hog.close()
        await other.close()
