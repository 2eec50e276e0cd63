"""One agent's WebSocket, incoming side: heartbeats and pings taken where
they are parsed.

16,384 nodes send ~8,000 heartbeats and ~3,300 pings a second. Through
aiohttp's ``receive()`` each one cost a queue hand-off, a future, a task
switch into the handler and back: about half the server's CPU at that size
went to frames that change nothing but a timestamp. :class:`AgentSocket` is
aiohttp's ``WebSocketResponse`` whose parsed frames are first offered to
:attr:`AgentSocket.inline` (the handler's, synchronous, called from the
protocol's ``data_received``): a frame it takes (a joined node's plain
heartbeat, its join again after ``restart`` or any other valid message, a
ping answered straight on the transport, a new connection's join) never
reaches the queue. Anything
else, and any frame it declines (a flooding peer, a closing connection, a
replica no longer serving), takes aiohttp's path to the
handler's ``receive()`` loop as before, which keeps every rule. A frame is
taken only while nothing waits in the queue, so frames keep their order.

It reaches into aiohttp's reader (the queue and parser ``_post_start``
makes); where that is not as expected (another aiohttp, bytes the client sent
before the upgrade completed), the socket stays plain aiohttp and logs once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

log = logging.getLogger("rdzv_server.handlers")

__all__ = ["CHUNK", "AgentSocket", "Inline", "InlineQueue", "WebSocketReader"]  # (rdzv_server.own_socket reads them)

try:  # aiohttp's reader, as WebSocketResponse._post_start builds it (3.14)
    from aiohttp._websocket.reader import WebSocketDataQueue, WebSocketReader
    from aiohttp.helpers import DEFAULT_CHUNK_SIZE as CHUNK
except ImportError:  # pragma: no cover: another aiohttp; the plain path
    WebSocketDataQueue = WebSocketReader = None  # type: ignore[assignment]
    CHUNK = 0

Inline = Callable[[Any], bool]  # a parsed WSMessage -> taken


class InlineQueue(WebSocketDataQueue):
    """aiohttp's message queue, which first offers each message to ``take``
    (its socket's ``inline``; the queue holds no reference to the socket: a
    cycle would leave each closed connection to the garbage collector, ~45
    objects a connection, which rdzv_server.gc_policy may have frozen)."""

    def __init__(self, take: Inline | None, protocol: Any, limit: int, *, loop: Any) -> None:
        super().__init__(protocol, limit, loop=loop)
        self.take = take

    def feed_data(self, data: Any, size: int) -> None:
        take = self.take
        if take is not None and not self._buffer:
            try:
                if take(data):
                    return
            except Exception:  # a bug here must not cut the connection: the message is dropped, said once
                log.exception("an incoming frame failed")
                self.take = None
                return
        super().feed_data(data, size)


class AgentSocket(web.WebSocketResponse):
    """A ``WebSocketResponse`` whose parsed frames ``inline`` may take first
    (set it once the handler can judge frames; None: every frame is queued)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._inline: Inline | None = None
        self._inline_queue: InlineQueue | None = None
        self.inlined = False  # whether frames pass inline on this connection (the reader was swapped)

    @property
    def inline(self) -> Inline | None:
        return self._inline if self._inline_queue is None else self._inline_queue.take

    @inline.setter
    def inline(self, take: Inline | None) -> None:
        self._inline = take
        if self._inline_queue is not None:
            self._inline_queue.take = take

    def _post_start(self, request: web.BaseRequest, protocol: str | None, writer: Any) -> None:
        proto = request.protocol
        clean = not getattr(proto, "_message_tail", b"")  # nothing came before the upgrade completed
        super()._post_start(request, protocol, writer)
        if not clean or WebSocketDataQueue is None:
            return
        try:
            old = self._reader
            if proto._payload_parser is not self._parser or old is None or old._buffer:
                return
            queue = InlineQueue(self._inline, request._protocol, CHUNK, loop=self._loop)
            parser = WebSocketReader(
                queue, self._max_msg_size, compress=bool(self._compress), decode_text=self._decode_text
            )
            cb = proto._data_received_cb
            proto._payload_parser = None
            self._reader, self._parser, self._inline_queue = queue, parser, queue
            proto.set_parser(parser, data_received_cb=cb)
            self.inlined = True
        except (AttributeError, TypeError) as e:  # pragma: no cover: another aiohttp's internals
            _warn_once(e)


_warned = False


def _warn_once(e: Exception) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning("agent frames take aiohttp's queued path (its reader is not as expected: %s)", e)
