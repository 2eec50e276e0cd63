"""rdzv_server.ws_channel.WsChannel over a real aiohttp WebSocket: a message for an
idle connection is written to the transport at once (framed here, not through
aiohttp's send); a real aiohttp client reads every message, in order, whichever
path it took; a compressed connection and a peer that does not read take the
queued path, and one that never reads is still disconnected with its queue bounded."""

from __future__ import annotations

import asyncio
import json

from aiohttp import WSMsgType, web
from aiohttp.test_utils import TestClient, TestServer

from rdzv_server.ws_channel import DIRECT_MAX_BUFFERED, MAX_QUEUED_BYTES, WsChannel, text_frame

TIMEOUT = 5.0


async def _serve() -> tuple[TestClient, asyncio.Queue[WsChannel]]:
    """An app whose one WebSocket route hands each connection's channel to the test."""
    channels: asyncio.Queue[WsChannel] = asyncio.Queue()

    async def handler(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        chan = WsChannel(ws, request.transport, "test")
        await channels.put(chan)
        async for _ in ws:  # until the client closes
            pass
        chan.drop()
        await chan.closed(TIMEOUT)
        return ws

    app = web.Application()
    app.router.add_get("/ws", handler)
    client = TestClient(TestServer(app))
    await client.start_server()
    return client, channels


async def _read(ws, n: int) -> list[str]:
    out = []
    for _ in range(n):
        frame = await asyncio.wait_for(ws.receive(), TIMEOUT)
        assert frame.type == WSMsgType.TEXT, frame
        out.append(frame.data)
    return out


def _messages() -> list[str]:
    broadcast = json.dumps({"op": "restart", "round": 3, "reason": "node n7 lost"})
    return [
        broadcast,
        broadcast,  # the same text object again: its frame is built once
        json.dumps({"op": "assigned", "text": "caf\u00e9 \u2603 \U0001f600"}),
        "x" * 126,
        "y" * 70_000,  # a 64-bit length
        broadcast,
        "",
    ]


async def test_messages_to_an_idle_connection_go_out_at_once_and_arrive_in_order() -> None:
    client, channels = await _serve()
    try:
        ws = await client.ws_connect("/ws")
        chan = await asyncio.wait_for(channels.get(), TIMEOUT)
        assert chan.direct
        msgs = _messages()
        for text in msgs:
            chan.deliver(text)
        # nothing waits for a writer task: the idle connection took them at once, and none was made
        assert chan.queued() == 0 and chan.queued_bytes == 0 and chan.writer is None
        assert await _read(ws, len(msgs)) == msgs
        # a queued message keeps its place: what comes after it queues behind it
        chan._enqueue("first")  # as deliver queues one (the writer has not run yet)
        chan.queued_bytes += len("first")
        chan.deliver("second")
        assert chan.queued() == 2 and chan.writer is not None
        assert await _read(ws, 2) == ["first", "second"]
        assert chan.queued_bytes == 0
        chan.deliver("third")
        assert await _read(ws, 1) == ["third"]
        await ws.close()
    finally:
        await client.close()


async def test_a_compressed_connection_takes_aiohttps_path() -> None:
    client, channels = await _serve()
    try:
        ws = await client.ws_connect("/ws", compress=15)
        chan = await asyncio.wait_for(channels.get(), TIMEOUT)
        assert not chan.direct  # our frames are uncompressed: not the bytes this connection expects
        msgs = _messages()
        for text in msgs:
            chan.deliver(text)
        assert await _read(ws, len(msgs)) == msgs
        await ws.close()
    finally:
        await client.close()


async def test_a_peer_that_never_reads_is_disconnected_and_the_transport_stays_bounded() -> None:
    client, channels = await _serve()
    try:
        ws = await client.ws_connect("/ws", max_msg_size=0)
        chan = await asyncio.wait_for(channels.get(), TIMEOUT)
        assert chan.transport is not None
        text = "z" * 4000
        frame = len(text_frame(text))
        peak, sent = 0, 0
        while not chan.killed and sent < 200_000_000:  # far more than any buffer between us holds
            for _ in range(64):
                chan.deliver(text)
                sent += len(text)
                peak = max(peak, chan.transport.get_write_buffer_size())
            await asyncio.sleep(0)
        assert chan.killed, f"{sent} bytes delivered to a peer that reads nothing, and it is still connected"
        # written straight to the transport only below the bound: beyond, the queue took them
        assert peak < DIRECT_MAX_BUFFERED + frame + MAX_QUEUED_BYTES, peak
        assert chan.queued() == 0 and chan.queued_bytes == 0  # what was queued is dropped
        ws._response.connection.transport.abort()  # type: ignore[union-attr]
    finally:
        await client.close()


async def test_pings_and_the_close_written_by_aiohttp_keep_their_place_among_direct_frames() -> None:
    """The suspicion probe's ping (ws.ping) and the close are aiohttp's frames,
    written whole to the same transport (no await inside a frame): a peer
    reads each frame intact, in the order they were written, and nothing
    delivered after the close is written after it."""
    client, channels = await _serve()
    try:
        ws = await client.ws_connect("/ws", autoping=False)
        chan = await asyncio.wait_for(channels.get(), TIMEOUT)
        big = "b" * 70_000  # aiohttp writes a frame this big as two writes, header then payload
        chan.deliver("a")
        await chan.ws.ping(b"1")
        chan.deliver(big)
        await chan.ws.ping(b"2")
        chan.deliver("c")
        chan.drop()
        chan.deliver("after the close")
        got = []
        for _ in range(6):
            frame = await asyncio.wait_for(ws.receive(), TIMEOUT)
            got.append((frame.type, frame.data if frame.type != WSMsgType.CLOSE else None))
        assert got == [
            (WSMsgType.TEXT, "a"),
            (WSMsgType.PING, b"1"),
            (WSMsgType.TEXT, big),
            (WSMsgType.PING, b"2"),
            (WSMsgType.TEXT, "c"),
            (WSMsgType.CLOSE, None),
        ]
        await ws.close()
    finally:
        await client.close()
