"""rdzv_server.ws_channel.text_frame: the bytes aiohttp's own writer sends for a text message.

aiohttp's real WebSocketWriter writes into a transport that records the bytes
(a server's writer: no mask, no compression); the frame built once for every
channel must be the same bytes, at each length encoding (7-bit, 16-bit, 64-bit)
and for text that is not ASCII."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp._websocket.writer import WebSocketWriter

from rdzv_server.ws_channel import text_frame


class _Recorder(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.data = bytearray()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.data += bytes(data)

    def is_closing(self) -> bool:
        return False


class _Protocol:
    _paused = False


def _aiohttp_bytes(text: str) -> bytes:
    async def go() -> bytes:
        t = _Recorder()
        writer = WebSocketWriter(_Protocol(), t, use_mask=False, compress=0)  # type: ignore[arg-type]
        await writer.send_frame(text.encode("utf-8"), 0x1)
        return bytes(t.data)

    return asyncio.run(go())


@pytest.mark.parametrize(
    "text",
    [
        "",
        '{"op":"restart","round":1,"reason":"node n9 lost"}',
        "x" * 125,
        "x" * 126,
        "y" * 65535,
        "z" * 65536,
        "w" * 200_000,
        '{"reason":"caf\u00e9 \u2603 \U0001f600"}' * 10,
    ],
    ids=lambda t: f"{len(t)}chars",
)
def test_text_frame_is_the_bytes_aiohttp_sends(text: str) -> None:
    assert text_frame(text) == _aiohttp_bytes(text)
