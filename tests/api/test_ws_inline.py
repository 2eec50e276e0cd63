"""rdzv_server.ws_inline.AgentSocket over a real aiohttp server and client:
frames its ``inline`` takes never reach ``receive()``, frames it declines do,
in order; a frame behind a queued one is not taken ahead of it; bytes sent
before the upgrade completed leave the socket plain; a failing ``inline`` costs
one frame, not the connection. And the agent channel's use of it: a new
connection's join, a joined node's heartbeat (it counts) and ping (answered)
take no turn through the handler's loop; so do its join again and a progress
heartbeat; any other frame before the join takes the loop, as ever; and what a
joined node sends wrong gets the same answers as through the loop, closing the
connection after too many."""

from __future__ import annotations

import asyncio
import base64
import gc
import json
import os
import struct
import weakref

from aiohttp import WSMsgType, web
from aiohttp.test_utils import TestClient, TestServer

from rdzv_common.protocol import HEARTBEAT_FRAME
from rdzv_server.handlers import MAX_ERRORS
from rdzv_server.keys import STORE
from rdzv_server.ws_channel import bug_log
from rdzv_server.ws_inline import AgentSocket

from .conftest import join_msg

TIMEOUT = 5.0


async def _serve(inline, hold: asyncio.Event | None = None):
    """An app whose one WebSocket route is an AgentSocket with ``inline``; what its
    ``receive()`` got, and the sockets, go to the test. ``hold``: receive only once set."""
    got: asyncio.Queue = asyncio.Queue()
    sockets: list[AgentSocket] = []

    async def handler(request: web.Request) -> web.WebSocketResponse:
        ws = AgentSocket()
        await ws.prepare(request)
        ws.inline = inline
        sockets.append(ws)
        if hold is not None:
            await hold.wait()
        async for msg in ws:
            await got.put(msg.data)
        return ws

    app = web.Application()
    app.router.add_get("/ws", handler)
    client = TestClient(TestServer(app))
    await client.start_server()
    return client, got, sockets


def _taking_hb(taken: list[str]):
    """An inline that takes the text frames starting "hb" (into ``taken``), declines the rest."""

    def inline(msg) -> bool:
        if msg.type is WSMsgType.TEXT and msg.data.startswith("hb"):
            taken.append(msg.data)
            return True
        return False

    return inline


async def _next(q: asyncio.Queue):
    return await asyncio.wait_for(q.get(), TIMEOUT)


async def test_taken_frames_skip_the_queue_and_declined_ones_arrive_in_order() -> None:
    taken: list[str] = []

    client, got, sockets = await _serve(_taking_hb(taken))
    try:
        ws = await client.ws_connect("/ws")
        for text in ["a", "hb1", "b", "hb2", "c"]:
            await ws.send_str(text)
            if not text.startswith("hb"):  # each read before the next is sent: the queue is empty
                assert await _next(got) == text
        assert taken == ["hb1", "hb2"] and sockets[0].inlined
        assert got.empty()
        await ws.close()
    finally:
        await client.close()


async def test_a_closed_connections_socket_is_freed_by_reference_counting_alone() -> None:
    """No cycle through the swapped reader: rdzv_server.gc_policy freezes what a reconnect
    storm made, and a cycle frozen with it would wait for the valve (~45 objects a connection)."""
    client, _, sockets = await _serve(_taking_hb([]))
    gc.disable()
    try:
        ws = await client.ws_connect("/ws")
        await ws.send_str("hb1")
        await ws.close()
        for _ in range(200):
            if sockets and sockets[0].closed:
                break
            await asyncio.sleep(0.01)
        assert sockets[0].inlined
        probe = weakref.ref(sockets.pop())
        for _ in range(200):  # the handler returns and aiohttp lets go of the request
            if probe() is None:
                break
            await asyncio.sleep(0.01)
        assert probe() is None, gc.get_referrers(probe())
    finally:
        gc.enable()
        await client.close()


async def test_a_frame_behind_a_queued_one_is_not_taken_ahead_of_it() -> None:
    hold = asyncio.Event()
    taken: list[str] = []

    client, got, _ = await _serve(_taking_hb(taken), hold)
    try:
        ws = await client.ws_connect("/ws")
        await ws.send_str("report")  # declined: queued, and the handler does not read yet
        await ws.send_str("hb1")  # would be taken, but "report" waits before it
        await asyncio.sleep(0.2)
        hold.set()
        assert [await _next(got) for _ in range(2)] == ["report", "hb1"]
        assert taken == []
        await ws.send_str("hb2")  # the queue is empty again: taken
        await ws.send_str("after")
        assert await _next(got) == "after" and taken == ["hb2"]
        await ws.close()
    finally:
        await client.close()


async def test_a_failing_inline_costs_one_frame_not_the_connection() -> None:
    def inline(msg) -> bool:
        raise RuntimeError("a bug")

    client, got, sockets = await _serve(inline)
    try:
        ws = await client.ws_connect("/ws")
        await ws.send_str("lost")
        await ws.send_str("kept")  # inline is off after the failure: the queued path
        assert await _next(got) == "kept"
        assert sockets[0].inline is None and not ws.closed
        await ws.close()
    finally:
        await client.close()


def _masked_text(text: str) -> bytes:
    data, mask = text.encode(), os.urandom(4)
    return struct.pack("!BB", 0x81, 0x80 | len(data)) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data))


async def test_frames_sent_with_the_upgrade_request_leave_the_socket_plain() -> None:
    taken: list[str] = []
    client, got, sockets = await _serve(lambda msg: bool(taken.append(msg.data)) or True)
    try:
        key = base64.b64encode(os.urandom(16)).decode()
        reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
        request = (
            f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{client.port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
        writer.write(request + _masked_text("early"))  # one write: the frame is the request's tail
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), TIMEOUT)
        assert head.startswith(b"HTTP/1.1 101"), head
        assert await _next(got) == "early"  # served, through aiohttp's queue
        assert not sockets[0].inlined and taken == []
        writer.write(_masked_text("later"))
        await writer.drain()
        assert await _next(got) == "later" and taken == []
        writer.close()
    finally:
        await client.close()


def _record_receive(monkeypatch) -> list:
    """Every frame the agent channel's loop gets from ``receive()`` (not taken inline)."""
    received: list = []
    plain = AgentSocket.receive

    async def receive(self, timeout=None):
        msg = await plain(self, timeout)
        received.append((msg.type, msg.data))
        return msg

    monkeypatch.setattr(AgentSocket, "receive", receive)
    return received


async def test_an_agents_heartbeats_and_pings_are_taken_inline(client, connect, monkeypatch) -> None:
    received = _record_receive(monkeypatch)
    agent = await connect(autoping=False)
    await agent.send(join_msg("j", "n0", (1, 1)))
    await agent.expect("joined")
    await agent.expect("assigned")
    arrivals = client.server.app[STORE].pacing.arrivals[("j", "n0")]
    assert arrivals.last is None
    await agent.ws.send_str(HEARTBEAT_FRAME)
    await agent.ws.ping(b"are you there")
    pong = await agent.ws.receive(TIMEOUT)
    assert pong.type is WSMsgType.PONG and pong.data == b"are you there", pong
    for _ in range(50):
        if arrivals.last is not None:
            break
        await asyncio.sleep(0.02)
    assert arrivals.last is not None  # the heartbeat counted
    assert received == []  # its join too: nothing took the loop


async def test_a_joined_nodes_join_again_and_progress_are_taken_inline(client, connect, monkeypatch) -> None:
    received = _record_receive(monkeypatch)
    agent = await connect()
    await agent.send(join_msg("j", "n0", (1, 1)))
    await agent.expect("joined")
    first = await agent.expect("assigned")
    await agent.send({"op": "hb", "step": 7, "rate": 2.5})  # a heartbeat with progress: parsed
    await agent.send(join_msg("j", "n0", (1, 1)))  # its join again (as after a restart), its secret added
    again = await agent.expect("assigned")  # a running member back: its assignment again
    assert again.assignment.round == first.assignment.round
    node = client.server.app[STORE].jobs["j"].nodes["n0"]
    assert node.step == 7  # the progress counted
    assert received == []  # the first join too


async def test_before_its_join_a_connections_other_frames_take_the_loop(client, connect, monkeypatch) -> None:
    """A valid message that is not a join, a heartbeat, a ping: refused or answered as ever,
    by the loop (where a frame before the join never moves the join deadline)."""
    received = _record_receive(monkeypatch)
    agent = await connect(autoping=False)
    await agent.ws.send_str(HEARTBEAT_FRAME)
    assert (await agent.expect("error")).code == "not_joined"
    await agent.send({"op": "hb", "step": 3})
    assert (await agent.expect("error")).code == "not_joined"
    await agent.ws.ping(b"early")
    pong = await agent.ws.receive(TIMEOUT)
    assert pong.type is WSMsgType.PONG and pong.data == b"early", pong
    # (aiohttp's receive() answers a ping itself and returns the next frame: none recorded)
    assert [(t, json.loads(d)) for t, d in received] == [
        (WSMsgType.TEXT, {"op": "hb"}),
        (WSMsgType.TEXT, {"op": "hb", "step": 3}),
    ]
    await agent.send(join_msg("j", "n0", (1, 1)))  # the join: taken inline
    await agent.expect("joined")
    assert len(received) == 2


async def test_a_joined_nodes_wrong_messages_are_refused_as_by_the_loop(client, connect, monkeypatch) -> None:
    received = _record_receive(monkeypatch)
    agent = await connect()
    await agent.send(join_msg("j", "n0", (2, 2)))
    await agent.expect("joined")
    await agent.send(join_msg("j", "n1", (2, 2)))  # valid, refused by the store: answered inline
    refused = await agent.expect("error")
    assert refused.code == "already_joined", refused
    await agent.send('{"op":"hb","step":"many"}')  # does not parse: the loop says why
    invalid = await agent.expect("error")
    assert invalid.code == "validation_error" and "step" in invalid.message, invalid
    assert [d for _, d in received] == ['{"op":"hb","step":"many"}']
    for _ in range(MAX_ERRORS):  # too many refusals: closed, through the loop, saying why
        await agent.send(join_msg("j", "n1", (2, 2)))
    for _ in range(MAX_ERRORS - 2):
        assert (await agent.expect("error")).code == "already_joined"
    last = await agent.expect("error")
    assert "too many invalid messages" in last.message, last
    await agent.wait_closed()


async def test_an_agents_connection_holds_young_collections_and_makes_no_writer_task(client, connect) -> None:
    """A reconnect storm (a failover, a server restart) is 16,384 upgrades: each one holds the
    young collections as a join does (rdzv_server.gc_policy), and an idle channel has no
    queue or writer task of its own until a message must wait."""
    import gc

    store = client.server.app[STORE]
    was = gc.get_threshold()
    store.gc_hold.on = True
    try:
        tasks_before = len(asyncio.all_tasks())
        agent = await connect()
        await asyncio.sleep(0.05)  # the handler runs up to its first receive()
        assert store.gc_hold.held and store.gc_hold.holds == 1  # held from the upgrade, before any join
        # the test's own and the connection's handler task: no writer task for an idle channel
        assert len(asyncio.all_tasks()) - tasks_before <= 2, asyncio.all_tasks()
        await agent.send(join_msg("j", "n0", (1, 1)))
        await agent.expect("joined")
        await agent.expect("assigned")  # written straight to the transport: still no writer task
        assert len(asyncio.all_tasks()) - tasks_before <= 2, asyncio.all_tasks()
    finally:
        store.gc_hold.release()
        store.gc_hold.on = False
        gc.set_threshold(*was)
        gc.unfreeze()  # what the hold froze (this process is pytest's)


async def test_a_message_that_fails_with_a_bug_closes_the_connection(client, connect, monkeypatch, caplog) -> None:
    """A join taken inline that raises something other than an RdzvError (a bug) closes the
    connection at once, as a message through the loop does (before, the frame was dropped and
    the connection waited out its join deadline, 10 s); the line says so, with the traceback, and
    the close frame says why. (The loop's path goes through the same ``handled``.)"""
    monkeypatch.setattr(bug_log, "tokens", float(bug_log.burst))  # (the limit is the process's)
    store = client.server.app[STORE]
    plain = store.join
    calls = []

    def failing_join(msg, chan):
        calls.append(msg.node_id)
        if len(calls) == 1:
            raise RuntimeError("a bug in the join")
        return plain(msg, chan)

    monkeypatch.setattr(store, "join", failing_join)
    agent = await connect()
    await agent.send(join_msg("j", "n0", (1, 1)))
    closing = await asyncio.wait_for(agent.ws.receive(), TIMEOUT)  # well within the join deadline
    assert closing.type is WSMsgType.CLOSE and closing.data == 1011, closing  # (internal error)
    assert "the server failed on 'join'" in closing.extra, closing
    assert "a bug in the join" in caplog.text and "closing its connection" in caplog.text
    again = await connect()  # the agent reconnects: its join goes through
    await again.send(join_msg("j", "n0", (1, 1)))
    await again.expect("joined")
    await again.expect("assigned")
    # a joined node's message that fails (a report: store.fail) closes it too
    monkeypatch.setattr(store, "fail", lambda *a, **kw: 1 / 0)
    failure = {"local_rank": 0, "rank": 0, "pid": 1, "exit_code": 1}
    await again.send({"op": "failed", "round": 0, "failures": [failure]})
    await again.wait_closed(TIMEOUT)
    assert "ZeroDivisionError" in caplog.text
