"""An agent's WebSocket after the server's own upgrade (rdzv_server.upgrade):
as much of aiohttp's ``WebSocketResponse`` as the agent channel uses, over the
connection's protocol and transport, with aiohttp's own frame reader.

Incoming: each read goes to aiohttp's ``WebSocketReader`` (its C parser: the
RFC 6455 rules, the message size limit, fragments, control frames), whose
messages are first offered to :attr:`OwnSocket.inline`, as on aiohttp's path
(rdzv_server.ws_inline); the rest wait for :meth:`OwnSocket.receive`, which
answers a ping and a close as aiohttp's does (``autoping``, ``autoclose``).
Outgoing: ``send_str`` frames as rdzv_server.ws_channel does, waiting while
the transport holds more than its high-water mark; ``close`` sends the close
frame and closes the transport once what was written is out (it does not wait
for the agent's answer: the agent reconnects either way)."""

from __future__ import annotations

import asyncio
import struct
from typing import Any, cast

from aiohttp import WSCloseCode, WSMessage, WSMsgType
from aiohttp.http_websocket import WS_CLOSED_MESSAGE, WebSocketError
from aiohttp.streams import EofStream

from .ws_channel import DIRECT_MAX_BUFFERED, MAX_CONTROL_PAYLOAD, text_frame
from .ws_inline import CHUNK, Inline, InlineQueue, WebSocketReader

_FIN_CLOSE = 0x88  # FIN, opcode 8 (close), unmasked
_FIN_PONG = 0x8A  # FIN, opcode 10 (pong)
_CLOSE_HEAD = struct.Struct("!BBH").pack


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
        self._queue = InlineQueue(None, protocol, CHUNK, loop=asyncio.get_running_loop())
        # held here: a reader stalled on a full queue is parked there by a weak reference only
        self._parser = WebSocketReader(self._queue, max_msg_size, compress=False, decode_text=True)
        self.closed = False  # a close frame went out, or the connection is gone
        self.task: asyncio.Task[None] | None = None  # the connection's loop (rdzv_server.upgrade)

    @property
    def inline(self) -> Inline | None:
        return self._queue.take

    @inline.setter
    def inline(self, take: Inline | None) -> None:
        self._queue.take = take

    # ------------------------------------------------------------ from the protocol

    def feed(self, data: bytes) -> None:
        """A read: parsed now, its messages offered to ``inline`` or queued."""
        self._parser.feed_data(data)  # (a frame against the rules: the queue raises it to receive())

    def lost(self) -> None:
        """The connection is gone: a waiting :meth:`receive` returns CLOSED."""
        self.closed = True
        self._parser.feed_eof()

    # ------------------------------------------------------------ for the agent channel

    async def receive(self) -> WSMessage:
        """The next message ``inline`` did not take: a ping is answered and never
        returned, a close answered with the same code; CLOSED once closed."""
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
                self._control(_FIN_PONG, msg.data)
                continue
            if kind is WSMsgType.PONG:
                continue
            if kind is WSMsgType.CLOSE:
                code = msg.data if isinstance(msg.data, int) and 1000 <= msg.data < 5000 else WSCloseCode.OK
                await self.close(code=code)
            return cast(WSMessage, msg)

    async def send_str(self, text: str) -> None:
        t = self.transport
        if self.closed or t.is_closing():
            raise ConnectionResetError("the agent's connection is closed")
        t.write(text_frame(text))
        if t.get_write_buffer_size() > DIRECT_MAX_BUFFERED:
            await self.protocol._drain_helper()

    async def close(self, *, code: int = WSCloseCode.OK, message: bytes = b"") -> bool:
        """Send the close frame (``code``, ``message`` cut to fit) and close the transport; False:
        closed already."""
        if self.closed:
            return False
        self.closed = True
        self._parser.feed_eof()  # (a receive() waiting returns CLOSED)
        t = self.transport
        if not t.is_closing():
            reason = message[: MAX_CONTROL_PAYLOAD - 2]
            t.write(_CLOSE_HEAD(_FIN_CLOSE, 2 + len(reason), code) + reason)
            if t.get_write_buffer_size() > DIRECT_MAX_BUFFERED:
                await self.protocol._drain_helper()
            t.close()
        return True

    def _control(self, head: int, payload: bytes) -> None:
        t = self.transport
        if not self.closed and not t.is_closing() and len(payload) <= MAX_CONTROL_PAYLOAD:
            t.write(bytes((head, len(payload))) + payload)
