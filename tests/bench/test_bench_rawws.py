"""bench/rawws.py and bench/beats.py, the simulated nodes' connections and beats
(bench/bigagents.py): a client frame is the bytes aiohttp's client writer sends
with the same mask, at each length encoding; against a real aiohttp server a
connection upgrades, sends and receives text (one message in several frames
too), answers a ping, hears a close, and a refused upgrade says its status and
headers; the beats go to a node's current connection only, and stop."""

from __future__ import annotations

import asyncio
import struct
import threading

import pytest
from aiohttp import WSMsgType, web
from aiohttp.test_utils import TestServer

from bench import beats as beats_mod
from bench.beats import Beats
from bench.bigagents import source_addr
from bench.rawws import PING, TEXT, Refused, client_frame, connect
from rdzv_common.wire import HEARTBEAT_FRAME
from tests.helpers.ws_bytes import aiohttp_frame

TIMEOUT = 5.0


_PAYLOADS = [b"", HEARTBEAT_FRAME.encode(), b"x" * 125, b"x" * 126, b"y" * 65535, b"z" * 65536]
_PAYLOADS.append("caf\u00e9 \u2603".encode())


@pytest.mark.parametrize(
    ("opcode", "payload"),
    [(TEXT, p) for p in _PAYLOADS] + [(PING, p) for p in _PAYLOADS if len(p) <= 125],  # a control frame: <= 125
    ids=lambda v: f"{len(v)}bytes" if isinstance(v, bytes) else f"op{v}",
)
def test_a_client_frame_is_the_bytes_aiohttps_client_sends(opcode: int, payload: bytes) -> None:
    for bits in (0, 0xDEADBEEF, 0x01020304):
        assert client_frame(opcode, payload, struct.pack("!L", bits)) == aiohttp_frame(payload, opcode, bits)


def test_a_client_frame_has_a_fresh_mask_each_time() -> None:
    frames = {client_frame(TEXT, b"same") for _ in range(20)}
    assert len(frames) > 1


async def _server(handler) -> TestServer:
    app = web.Application()
    app.router.add_get("/ws", handler)
    server = TestServer(app)
    await server.start_server()
    return server


async def test_a_connection_sends_receives_answers_pings_and_hears_a_close() -> None:
    got: list[str] = []
    pong = asyncio.Event()

    async def handler(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(autoping=False)
        await ws.prepare(request)
        msg = await ws.receive()
        got.append(msg.data)
        await ws.send_str("back: " + msg.data)
        # one message in three frames: the client joins them
        ws._writer.transport.write(b"\x01\x03abc" + b"\x00\x03def" + b"\x80\x03ghi")  # type: ignore[union-attr]
        await ws.ping(b"hi")
        answer = await ws.receive()
        if answer.type is WSMsgType.PONG and answer.data == b"hi":
            pong.set()
        await ws.close()
        return ws

    server = await _server(handler)
    texts: list[str] = []
    closed = asyncio.Event()
    try:
        conn = await connect(
            f"http://127.0.0.1:{server.port}/ws", lambda c, t: texts.append(t), lambda c: closed.set(), tag="n0"
        )
        assert conn.tag == "n0" and conn.send_text('{"op":"join"}')
        await asyncio.wait_for(closed.wait(), TIMEOUT)
        assert got == ['{"op":"join"}'] and texts == ['back: {"op":"join"}', "abcdefghi"]
        assert pong.is_set() and conn.closed and conn.done.done()
        assert not conn.send_text("after")  # gone: nothing written
    finally:
        await server.close()


async def test_a_refused_upgrade_says_its_status_and_headers() -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(status=503, headers={"X-Rdzv-Leader": "127.0.0.1:9"}, text="not the leader")

    server = await _server(handler)
    try:
        with pytest.raises(Refused) as e:
            await connect(f"http://127.0.0.1:{server.port}/ws", lambda c, t: None, lambda c: None)
        assert e.value.status == 503 and e.value.headers["x-rdzv-leader"] == "127.0.0.1:9"
    finally:
        await server.close()


async def test_a_node_connects_from_its_own_loopback_address() -> None:
    seen: list[str] = []

    async def handler(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        seen.append(request.transport.get_extra_info("peername")[0])  # type: ignore[union-attr]
        await ws.send_str("hello")
        await ws.receive()
        return ws

    server = await _server(handler)
    texts: list[str] = []
    try:
        sources = [source_addr(i) for i in (0, 1, 253, 254, 16383, 65024)]
        assert len(set(sources)) == len(sources) and all(s.startswith("127.") for s in sources)
        conns = [
            await connect(f"http://127.0.0.1:{server.port}/ws", lambda c, t: texts.append(t), lambda c: None, source=s)
            for s in sources[:3]
        ]
        await _until(lambda: len(texts) == 3)
        assert seen == sources[:3]
        for conn in conns:
            conn.close()
    finally:
        await server.close()


class _Ws:
    def __init__(self) -> None:
        self.closed = False
        self.sent: list[str] = []

    def send_text(self, text: str) -> bool:
        self.sent.append(text)
        return True

    def ping(self) -> bool:
        self.sent.append("<ping>")
        return True


class _Node:
    def __init__(self, hb_s: float) -> None:
        self.ws: _Ws | None = _Ws()
        self.hb_s: float | None = hb_s
        self.beat_gen = 0


async def _until(cond, timeout: float = TIMEOUT) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_beats_go_to_the_current_connection_and_stop(monkeypatch) -> None:
    monkeypatch.setattr(beats_mod, "WS_PING_S", 0.05)
    b = Beats()
    node = _Node(hb_s=0.02)
    first = node.ws
    assert first is not None
    b.start(node)
    try:
        await _until(lambda: first.sent.count(HEARTBEAT_FRAME) >= 5 and "<ping>" in first.sent)
        second = node.ws = _Ws()  # a new connection: beats move to it
        b.start(node)
        before = len(first.sent)
        await _until(lambda: second.sent.count(HEARTBEAT_FRAME) >= 3)
        assert len(first.sent) == before
        b.stop(node)
        after = len(second.sent)
        await asyncio.sleep(0.15)
        assert len(second.sent) == after  # stopped
        assert b.sent[0] >= 8 and b.sent[1] >= 1
    finally:
        b.close()


def test_beats_never_keep_the_loop_from_other_work(monkeypatch) -> None:
    """Beats due closer together than a pass takes (1 ms here): each pass still yields, so the
    loop's other callbacks run (a pass that did not yield spun until the thread was stopped)."""
    monkeypatch.setattr(beats_mod, "WS_PING_S", 0.001)
    other_ran: list[int] = []

    async def go() -> None:
        b = Beats()
        node = _Node(hb_s=0.001)
        b.start(node)
        for _ in range(50):
            await asyncio.sleep(0)
            other_ran.append(1)
        b.close()

    t = threading.Thread(target=asyncio.run, args=(go(),), daemon=True)
    t.start()
    t.join(TIMEOUT)
    assert not t.is_alive() and len(other_ran) == 50


async def test_a_node_told_no_interval_yet_does_not_beat() -> None:
    b = Beats()
    node = _Node(hb_s=0.02)
    node.hb_s = None
    b.start(node)
    await asyncio.sleep(0.1)
    assert node.ws is not None and node.ws.sent == []
    b.close()


async def test_on_a_new_connection_the_first_beats_come_a_whole_interval_later_as_the_links(monkeypatch) -> None:
    """A node back after a drop beats as the agent's link does: its heartbeat task sleeps its
    interval first, and it pings after WS_PING_S without a frame (not at a random point of them)."""
    monkeypatch.setattr(beats_mod, "WS_PING_S", 0.3)
    b = Beats()
    node = _Node(hb_s=0.2)
    try:
        b.start(node, spread=False)
        await asyncio.sleep(0.15)
        assert node.ws is not None and node.ws.sent == []
        await _until(lambda: node.ws is not None and HEARTBEAT_FRAME in node.ws.sent)
        assert "<ping>" not in node.ws.sent
        await _until(lambda: node.ws is not None and "<ping>" in node.ws.sent)
    finally:
        b.close()
