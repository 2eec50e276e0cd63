"""An agent's WebSocket after the server's own upgrade (rdzv_server.upgrade):
as much of aiohttp's ``WebSocketResponse`` as the agent channel uses, over the
connection's protocol and transport, with aiohttp's own frame reader.

Incoming: each read goes to aiohttp's ``WebSocketReader`` (its C parser: the
RFC 6455 rules, the message size limit, fragments, control frames), whose
messages are first offered to :attr:`OwnSocket.inline`, as on aiohttp's path
(rdzv_server.ws_inline); the rest wait for :meth:`OwnSocket.receive`, which
answers a ping and a close as aiohttp's does (``autoping``, ``autoclose``).
Outgoing: ``send_str`` (and each pong) frames as rdzv_server.ws_channel does,
waiting while the transport holds more than aiohttp's write limit, so an agent
that never reads stops being read; ``close`` sends the close frame, then reads
on, dropping what comes, until the agent closes its end or
:data:`LINGER_S` passed (closing with unread bytes would reset the connection,
and the agent could lose what came before the close)."""

from __future__ import annotations

import asyncio
import struct
from typing import Any, cast

from aiohttp import WSCloseCode, WSMessage, WSMsgType
from aiohttp.http_websocket import WS_CLOSED_MESSAGE, WebSocketError
from aiohttp.streams import EofStream

from .ws_channel import (
    DIRECT_MAX_BUFFERED,
    FIN_CLOSE,
    FIN_PING,
    FIN_PONG,
    MAX_CONTROL_PAYLOAD,
    control_frame,
    text_frame,
)
from .ws_inline import CHUNK, Inline, InlineQueue, WebSocketReader

_CODE = struct.Struct("!H").pack  # a close frame's status code
LINGER_S = 2.0  # after the close frame, how long the agent's end of the connection is awaited


def available() -> bool:
    """Whether this aiohttp has the reader the socket is built on (else: aiohttp's path only)."""
    return WebSocketReader is not None


class OwnSocket:
    """One agent's WebSocket on ``protocol`` (an aiohttp ``BaseProtocol``: its flow
    control) and ``transport``; frames up to ``max_msg_size`` bytes."""

    compress = 0  # no extension is ever negotiated on this path

    def __init__(self, protocol: Any, transport: asyncio.Transport, max_msg_size: int) -> None:
        self.protocol = protocol
        self.transport = transport
        self._loop = asyncio.get_running_loop()
        self._queue = InlineQueue(None, protocol, CHUNK, loop=self._loop)
        # held here: a reader stalled on a full queue is parked there by a weak reference only
        self._parser = WebSocketReader(self._queue, max_msg_size, compress=False, decode_text=True)
        self.closed = False  # the close frame went out (or could not: the connection was gone)
        self._linger: asyncio.TimerHandle | None = None  # after it: the agent's own close awaited
        self.task: asyncio.Task[None] | None = None  # the connection's loop (rdzv_server.upgrade)

    @property
    def inline(self) -> Inline | None:
        return self._queue.take

    @inline.setter
    def inline(self, take: Inline | None) -> None:
        self._queue.take = take

    # ------------------------------------------------------------ from the protocol

    def feed(self, data: bytes) -> None:
        """A read: parsed now, its messages offered to ``inline`` or queued; once the close frame
        went out, dropped (the agent's close, then its end of the connection, are awaited)."""
        if not self.closed:
            self._parser.feed_data(data)  # (a frame against the rules: the queue raises it to receive())

    def lost(self) -> None:
        """The connection is gone: :meth:`receive` returns what was queued, then CLOSED."""
        self._parser.feed_eof()
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None

    # ------------------------------------------------------------ for the agent channel

    async def receive(self) -> WSMessage:
        """The next message ``inline`` did not take: a ping is answered (as the transport
        drains, as aiohttp's) and never returned; a close is answered; CLOSED once closed."""
        while True:
            if self.closed:
                return WS_CLOSED_MESSAGE
            try:
                msg = await self._queue.read()
            except EofStream:
                await self.close()
                return WS_CLOSED_MESSAGE
            except WebSocketError as e:  # a frame against RFC 6455 or over the size limit
                await self.close(code=e.code)
                return WSMessage(WSMsgType.ERROR, e, None)
            except Exception as e:
                await self.close(code=WSCloseCode.ABNORMAL_CLOSURE)
                return WSMessage(WSMsgType.ERROR, e, None)
            kind = msg.type
            if kind is WSMsgType.PING:
                if len(msg.data) <= MAX_CONTROL_PAYLOAD and not self.transport.is_closing():
                    self.transport.write(control_frame(FIN_PONG, msg.data))
                    if not await self._drained():
                        return WS_CLOSED_MESSAGE
                continue
            if kind is WSMsgType.PONG:
                continue
            if kind is WSMsgType.CLOSE:
                await self.close()  # (1000, as aiohttp answers any close)
            return cast(WSMessage, msg)

    async def send_str(self, data: str) -> None:
        t = self.transport
        if self.closed or t.is_closing():
            raise ConnectionResetError("the agent's connection is closed")
        t.write(text_frame(data))
        if not await self._drained():
            raise ConnectionResetError("the agent's connection is closed")

    async def ping(self, message: bytes = b"") -> None:
        """A ping (rdzv_server.suspicion's probe: the agent's kernel acknowledges it even when
        the process is frozen)."""
        t = self.transport
        if self.closed or t.is_closing() or len(message) > MAX_CONTROL_PAYLOAD:
            raise ConnectionResetError("the agent's connection is closed")
        t.write(control_frame(FIN_PING, message))

    async def close(self, *, code: int = WSCloseCode.OK, message: bytes = b"") -> bool:
        """Send the close frame (``code``, ``message`` cut to fit), then wait up to
        :data:`LINGER_S` for the agent to close its end, reading and dropping what it still
        sends (a socket closed with unread bytes would reset, and the agent could lose the
        last frames); False: closed already."""
        if self.closed:
            return False
        self.closed = True
        self._parser.feed_eof()  # (a receive() waiting returns CLOSED)
        t = self.transport
        if t.is_closing():
            return True
        t.write(control_frame(FIN_CLOSE, _CODE(code) + message[: MAX_CONTROL_PAYLOAD - 2]))
        if self.protocol._reading_paused:  # (its queue was full): read on, to the agent's end
            self.protocol.resume_reading()
        self._linger = self._loop.call_later(LINGER_S, self._give_up)
        await self._drained()
        return True

    def _give_up(self) -> None:
        self._linger = None
        self.transport.close()

    async def _drained(self) -> bool:
        """Wait while the transport holds more than aiohttp's write limit; False: the connection broke."""
        if self.transport.get_write_buffer_size() <= DIRECT_MAX_BUFFERED:
            return True
        try:
            await self.protocol._drain_helper()
        except ConnectionError:
            self.transport.abort()
            return False
        return True
