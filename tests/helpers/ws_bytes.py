"""The bytes aiohttp's own WebSocket writer sends: its real WebSocketWriter
writing into a transport that records them (tests/unit/test_ws_frames.py for the
server's frames, tests/bench/test_bench_rawws.py for a client's masked ones)."""

from __future__ import annotations

import asyncio

from aiohttp._websocket.writer import WebSocketWriter


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


class _FixedBits:
    """A ``random`` whose every draw is ``bits``: the client's mask, chosen by the test."""

    def __init__(self, bits: int) -> None:
        self.bits = bits

    def getrandbits(self, k: int) -> int:
        return self.bits


def aiohttp_frame(payload: bytes, opcode: int, mask_bits: int | None = None) -> bytes:
    """One frame as aiohttp writes it: a server's (no mask) or, with ``mask_bits``, a
    client's masked with those 32 bits. No compression."""

    async def go() -> bytes:
        t = _Recorder()
        if mask_bits is None:
            writer = WebSocketWriter(_Protocol(), t, use_mask=False, compress=0)  # type: ignore[arg-type]
        else:
            writer = WebSocketWriter(
                _Protocol(),  # type: ignore[arg-type]
                t,
                use_mask=True,
                random=_FixedBits(mask_bits),  # type: ignore[arg-type]
                compress=0,
            )
        await writer.send_frame(payload, opcode)
        return bytes(t.data)

    return asyncio.run(go())
