"""One agent's WebSocket, outgoing side: bounded, and cheap per message.

A message for an idle connection is framed here and written to its transport
at once (:func:`text_frame`: an unmasked, uncompressed text frame, the bytes
aiohttp's writer would send). A round change of a 16,384-node job sends ~3
messages per node; through aiohttp's per-message send each one cost a queue
hand-off, a task switch, a send timer and aiohttp's framing. A broadcast
(``restart``) is framed once: the store hands every channel the same text
object, and the last frame built is kept for it.

The bounds are those of the queued path, which takes over whenever the direct
one may not: a message waits in the connection's queue while earlier ones
wait, while the transport holds :data:`DIRECT_MAX_BUFFERED` bytes the peer
has not taken, on a compressed connection, or once it closes. An agent that
does not read fills its transport, then its queue (``MAX_QUEUED_MESSAGES``,
``MAX_QUEUED_BYTES``), and is disconnected as before; one whose single queued
send does not complete within ``SEND_TIMEOUT_S`` likewise."""

from __future__ import annotations

import asyncio
import logging
import struct
import time
import typing

from aiohttp import WSCloseCode
from pydantic import BaseModel

from rdzv_common.protocol import ErrorCode, ErrorMsg

from .conns import LogLimiter

log = logging.getLogger("rdzv_server.handlers")

# What one connection may cost the server. Outgoing messages queue per
# connection; an agent that does not read its messages is disconnected when
# its queue holds this many (it reconnects like any agent), and so is one
# whose single send does not complete within SEND_TIMEOUT_S.
MAX_QUEUED_MESSAGES = 1000
MAX_QUEUED_BYTES = 1 << 20
SEND_TIMEOUT_S = 10.0
# A message goes straight to the transport only while it holds fewer unsent
# bytes than this (aiohttp's own write limit): beyond, the queue and its bounds.
DIRECT_MAX_BUFFERED = 1 << 16
# Error replies (invalid frames, refused requests): more than MAX_ERRORS
# within ERROR_WINDOW_S and the connection is closed.
MAX_ERRORS = 20
ERROR_WINDOW_S = 10.0

close_log = LogLimiter(log, logging.WARNING, burst=10, rate=1.0)
bug_log = LogLimiter(log, logging.ERROR, burst=3, rate=0.1)  # a message that failed (a bug), with its traceback

_LEN1, _LEN2, _LEN3 = struct.Struct("!BB").pack, struct.Struct("!BBH").pack, struct.Struct("!BBQ").pack
_FIN_TEXT = 0x81  # FIN, opcode 1 (text); a server's frames are never masked (RFC 6455 5.1)
FIN_CLOSE = 0x88  # FIN, opcode 8 (close)
FIN_PING = 0x89  # FIN, opcode 9 (ping)
FIN_PONG = 0x8A  # FIN, opcode 10 (pong)
MAX_CONTROL_PAYLOAD = 125  # a control frame's payload at most (RFC 6455 5.5): aiohttp's reader refuses more


def text_frame(text: str) -> bytes:
    """``text`` as one WebSocket text frame from a server: the bytes aiohttp's
    ``send_str`` writes on a connection without compression."""
    data = text.encode("utf-8")
    n = len(data)
    if n < 126:
        return _LEN1(_FIN_TEXT, n) + data
    if n < 65536:
        return _LEN2(_FIN_TEXT, 126, n) + data
    return _LEN3(_FIN_TEXT, 127, n) + data


def control_frame(head: int, payload: bytes) -> bytes:
    """A control frame from a server (``head``: FIN_CLOSE, FIN_PING or FIN_PONG); ``payload``
    at most MAX_CONTROL_PAYLOAD bytes, as the caller checked."""
    return _LEN1(head, len(payload)) + payload


class _LastFrame:
    """The frame of the last text framed: a broadcast's text is one object, framed once.
    One tuple, read and replaced whole (servers in two threads never mix a text and a frame)."""

    last: tuple[str | None, bytes] = (None, b"")

    @classmethod
    def of(cls, text: str) -> bytes:
        last = cls.last
        if last[0] is not text:
            last = cls.last = (text, text_frame(text))
        return last[1]


class Socket(typing.Protocol):
    """What the channel (and rdzv_server.suspicion's probe) needs of an agent's WebSocket:
    aiohttp's ``WebSocketResponse`` (rdzv_server.ws_inline) or the server's own
    (rdzv_server.own_socket)."""

    @property
    def closed(self) -> bool: ...

    @property
    def compress(self) -> int: ...

    async def send_str(self, data: str) -> None: ...

    async def close(self, *, code: int = ..., message: bytes = ...) -> bool: ...

    async def ping(self, message: bytes = ...) -> None: ...


class WsChannel:
    """One agent's connection: a message goes out at once when the connection
    is idle, else it queues and a writer task sends it, so one slow agent never
    holds up the others. The queue is bounded (see MAX_QUEUED_MESSAGES): an
    agent that falls behind is disconnected."""

    def __init__(self, ws: Socket, transport: asyncio.Transport | None = None, peer: str = "?") -> None:
        self.ws = ws
        self.transport = transport
        self.peer = peer
        # the queue and its writer task are made when a message first has to wait (most
        # connections never need them: at 16,384 nodes a task per connection was a tenth of
        # a reconnect storm's upgrade)
        self.queue: asyncio.Queue[str | None] | None = None
        self.writer: asyncio.Task[None] | None = None
        self.queued_bytes = 0
        self.killed = False
        self.closing = False  # drop() queued the close: nothing goes around it
        # framed here only where aiohttp would send the same bytes: no compression negotiated
        self.direct = transport is not None and not ws.compress
        self.errors = 0
        self.errors_since = time.monotonic()
        self.close_code = WSCloseCode.OK
        self.close_reason = ""

    def deliver(self, text: str) -> None:
        if self.killed:
            return
        if self._direct_now():
            self.transport.write(_LastFrame.of(text))  # type: ignore[union-attr]
            return
        if self.queued() >= MAX_QUEUED_MESSAGES or self.queued_bytes + len(text) > MAX_QUEUED_BYTES:
            self.kill(f"send queue full ({self.queued()} messages, {self.queued_bytes} bytes): the agent does not read")
            return
        self.queued_bytes += len(text)
        self._enqueue(text)

    def queued(self) -> int:
        """Messages waiting for the writer task."""
        return 0 if self.queue is None else self.queue.qsize()

    def _enqueue(self, item: str | None) -> None:
        if self.queue is None:
            self.queue = asyncio.Queue()
            self.writer = asyncio.create_task(self._write(self.queue))
        self.queue.put_nowait(item)

    def pong(self, payload: bytes) -> bool:
        """Answer a ping at once, as aiohttp's autoping would (ws_inline); False
        when it cannot go straight out now (the caller takes aiohttp's path)."""
        if len(payload) > MAX_CONTROL_PAYLOAD or not self._direct_now():
            return False
        self.transport.write(control_frame(FIN_PONG, payload))  # type: ignore[union-attr]
        return True

    def tell(self, msg: BaseModel) -> None:
        """Reply on this connection only (acks and errors)."""
        self.deliver(msg.model_dump_json())

    def _direct_now(self) -> bool:
        """Whether a frame may be written straight to the transport now."""
        t = self.transport
        return (
            self.direct
            and t is not None
            and not self.closing
            and not self.queued()  # nothing earlier waits (the writer takes one as it runs)
            and t.get_write_buffer_size() < DIRECT_MAX_BUFFERED
            and not t.is_closing()
            and not self.ws.closed
        )

    def refuse(self, msg: ErrorMsg) -> bool:
        """Reply with an error; False when this connection sent too many bad
        messages lately: it is told so and must be closed."""
        now = time.monotonic()
        if now - self.errors_since > ERROR_WINDOW_S:
            self.errors, self.errors_since = 0, now
        self.errors += 1
        if self.errors > MAX_ERRORS:
            why = f"too many invalid messages (more than {MAX_ERRORS} in {ERROR_WINDOW_S:g}s)"
            self.tell(ErrorMsg(code=ErrorCode.BAD_REQUEST, message=f"{why}: closing the connection"))
            close_log("closing agent connection from %s: %s", self.peer, why)
            return False
        self.tell(msg)
        return True

    def drop(self) -> None:
        """Close the connection after what is queued (the agent reconnects)."""
        if not self.killed:
            self.closing = True
            self._enqueue(None)

    def kill(self, why: str) -> None:
        """Disconnect at once, dropping what is queued."""
        if not self.killed:
            close_log("closing agent connection from %s: %s", self.peer, why)
            self.abort()

    def abort(self) -> None:
        self.killed = True
        while self.queue is not None and not self.queue.empty():
            self.queue.get_nowait()
        self.queued_bytes = 0
        if self.transport is not None:
            self.transport.abort()
        if self.writer is not None and self.writer is not asyncio.current_task():
            self.writer.cancel()

    async def closed(self, timeout: float) -> bool:
        """After :meth:`drop`: whether what was queued and the close went out within ``timeout``."""
        if self.writer is None:
            return True
        done, _ = await asyncio.wait([self.writer], timeout=timeout)
        return bool(done)

    async def _write(self, queue: asyncio.Queue[str | None]) -> None:
        # The send deadline is a timer, not asyncio.wait_for: on Python < 3.12
        # wait_for runs every send in a task of its own, which doubled the
        # time to tell 256 nodes their assignment.
        loop = asyncio.get_running_loop()
        try:
            while (text := await queue.get()) is not None:
                self.queued_bytes -= len(text)
                timer = loop.call_later(SEND_TIMEOUT_S, self._send_expired)
                try:
                    await self.ws.send_str(text)
                finally:
                    timer.cancel()
            timer = loop.call_later(SEND_TIMEOUT_S, self._send_expired)
            try:
                await self.ws.close(code=self.close_code, message=self.close_reason.encode())
            finally:
                timer.cancel()
        except (ConnectionError, RuntimeError, asyncio.CancelledError):
            pass

    def _send_expired(self) -> None:
        self.kill(f"a send did not complete in {SEND_TIMEOUT_S:g}s")
