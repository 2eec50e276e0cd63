"""rdzv_server.ws_channel.text_frame: the bytes aiohttp's own writer sends for a text message.

aiohttp's real WebSocketWriter writes into a transport that records the bytes
(a server's writer: no mask, no compression); the frame built once for every
channel must be the same bytes, at each length encoding (7-bit, 16-bit, 64-bit)
and for text that is not ASCII."""

from __future__ import annotations

import pytest

from rdzv_server.ws_channel import text_frame
from tests.helpers.ws_bytes import aiohttp_frame


def _aiohttp_bytes(text: str) -> bytes:
    return aiohttp_frame(text.encode("utf-8"), 0x1)


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
