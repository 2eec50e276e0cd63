"""A WebSocket client for simulated nodes: RFC 6455's client side on an
asyncio Protocol, for bench/bigagents.py.

A big job's simulated nodes share the machine's cores with the server they
measure, so what each of their frames costs them is taken from the server.
Through aiohttp's client every frame in was a queue hand-off, a future and a
task switch into a reader task per node, every frame out an awaited send:
at 16,384 nodes the two client processes used 1.5-2x the server's CPU in a
round change. Here a connection is a Protocol: the upgrade is written and its
answer parsed in ``data_received``, each text message is handed to the
caller's ``on_text`` there, synchronously, and a send is one masked frame
written to the transport. What goes on the wire is what any client sends
(the same upgrade request, frames masked with a fresh random key each).

Text messages only, as the agent channel speaks; pings are answered, a close
is answered and closes; no extensions (none are asked for).
"""

from __future__ import annotations

import asyncio
import base64
import os
import struct
from collections.abc import Callable
from typing import Any, cast
from urllib.parse import urlsplit

from rdzv_common.wire import accept_key as wire_accept_key

MAX_HEAD_BYTES = 65536  # the upgrade's answer, headers and all
MAX_MESSAGE_BYTES = 4 * 2**20  # what one message may grow to (the server's are far smaller)
TEXT, CLOSE, PING, PONG = 0x1, 0x8, 0x9, 0xA


class Refused(Exception):
    """The server answered the upgrade with another status than 101."""

    def __init__(self, status: int, headers: dict[str, str]) -> None:
        super().__init__(f"upgrade refused: HTTP {status}")
        self.status = status
        self.headers = headers  # lower-case names


def accept_key(key: bytes) -> bytes:
    """The Sec-WebSocket-Accept a server answers ``key`` with (rdzv_common.wire.accept_key, as bytes)."""
    return wire_accept_key(key.decode("ascii")).encode("ascii")


def client_frame(opcode: int, payload: bytes, mask: bytes | None = None) -> bytes:
    """One final frame as a client sends it: masked (RFC 6455 5.3: a fresh random key unless
    ``mask`` is given, for tests)."""
    key = os.urandom(4) if mask is None else mask
    n = len(payload)
    if n < 126:
        head = struct.pack("!BB", 0x80 | opcode, 0x80 | n)
    elif n < 65536:
        head = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, n)
    else:
        head = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, n)
    if not n:
        return head + key
    masked = int.from_bytes(payload, "big") ^ int.from_bytes((key * (n // 4 + 1))[:n], "big")
    return head + key + masked.to_bytes(n, "big")


class WsConn(asyncio.Protocol):
    """One connection. ``on_text(conn, text)`` is called for each text message, in
    ``data_received``; ``on_closed(conn)`` once, when the connection is gone. ``tag``
    is the caller's (its node). ``opened`` resolves once the upgrade is answered;
    ``done`` when the connection is gone."""

    def __init__(
        self,
        request: bytes,
        accept: str,
        on_text: Callable[[WsConn, str], None],
        on_closed: Callable[[WsConn], None],
        tag: Any = None,
    ) -> None:
        loop = asyncio.get_running_loop()
        self._request, self._accept = request, accept
        self.on_text, self.on_closed, self.tag = on_text, on_closed, tag
        self.transport: asyncio.Transport | None = None
        self.opened: asyncio.Future[WsConn] = loop.create_future()
        self.opened.add_done_callback(_retrieved)  # a failure nobody waits for any more is not "never retrieved"
        self.done: asyncio.Future[None] = loop.create_future()
        self.closed = False
        self._upgraded = False
        self.headers: dict[str, str] = {}  # the upgrade's answer's (lower-case names)
        self._buf = bytearray()
        self._parts: list[bytes] = []  # a fragmented message so far

    # -- the caller's side

    def send_text(self, text: str) -> bool:
        """Write ``text`` as one message; False if the connection is gone."""
        if self.closed or self.transport is None:
            return False
        self.transport.write(client_frame(TEXT, text.encode()))
        return True

    def ping(self) -> bool:
        if self.closed or self.transport is None:
            return False
        self.transport.write(client_frame(PING, b""))
        return True

    def close(self) -> None:
        """A close frame (1000), then the connection closed from here."""
        if not self.closed and self.transport is not None:
            self.transport.write(client_frame(CLOSE, struct.pack("!H", 1000)))
            self.transport.close()

    def abort(self) -> None:
        """Cut the connection: no close frame (the server sees it lost)."""
        if self.transport is not None:
            self.transport.abort()

    # -- asyncio's side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's is not asyncio's class)
        transport.write(self._request)

    def data_received(self, data: bytes) -> None:
        self._buf += data
        if not self._upgraded and not self._answer():
            return
        self._frames()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.opened.done():
            self.opened.set_exception(exc or ConnectionError("closed before the upgrade was answered"))
        if not self.done.done():
            self.done.set_result(None)
        if self._upgraded:
            self.on_closed(self)

    def _answer(self) -> bool:
        """The upgrade's answer, once whole; True when upgraded."""
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buf) > MAX_HEAD_BYTES:
                self._fail(ConnectionError("the upgrade's answer is too long"))
            return False
        lines = bytes(self._buf[:end]).decode("latin-1").split("\r\n")
        del self._buf[: end + 4]
        parts = lines[0].split(" ", 2)
        status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if status != 101:
            self._fail(Refused(status, headers))
            return False
        if headers.get("sec-websocket-accept") != self._accept:
            self._fail(ConnectionError("the upgrade's Sec-WebSocket-Accept is wrong"))
            return False
        self._upgraded, self.headers = True, headers
        self.opened.set_result(self)
        return True

    def _fail(self, exc: Exception) -> None:
        if not self.opened.done():
            self.opened.set_exception(exc)
        self.abort()

    def _frames(self) -> None:
        buf, pos = self._buf, 0
        while len(buf) - pos >= 2 and not self.closed:
            b0, b1 = buf[pos], buf[pos + 1]
            n, head = b1 & 0x7F, 2
            if n == 126:
                if len(buf) - pos < 4:
                    break
                n, head = struct.unpack_from("!H", buf, pos + 2)[0], 4
            elif n == 127:
                if len(buf) - pos < 10:
                    break
                n, head = struct.unpack_from("!Q", buf, pos + 2)[0], 10
            if b1 & 0x80 or n > MAX_MESSAGE_BYTES:  # a server never masks
                self.abort()
                return
            if len(buf) - pos < head + n:
                break
            payload = bytes(buf[pos + head : pos + head + n])
            pos += head + n
            self._frame(b0, payload)
        del buf[:pos]

    def _frame(self, b0: int, payload: bytes) -> None:
        op, fin = b0 & 0x0F, b0 & 0x80
        if op in (TEXT, 0x0):  # a message, or a part of one
            self._parts.append(payload)
            if sum(map(len, self._parts)) > MAX_MESSAGE_BYTES:
                self.abort()
            elif fin:
                text = b"".join(self._parts).decode()
                self._parts = []
                self.on_text(self, text)
        elif op == PING and self.transport is not None:
            self.transport.write(client_frame(PONG, payload))
        elif op == CLOSE:
            self.close()


def _retrieved(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


async def connect(
    url: str,
    on_text: Callable[[WsConn, str], None],
    on_closed: Callable[[WsConn], None],
    tag: Any = None,
    timeout: float = 30.0,
    source: str | None = None,
) -> WsConn:
    """A WebSocket to ``url`` (``http://host:port/path``), upgraded; raises Refused (another
    status), OSError or asyncio.TimeoutError. ``source``: the local address it comes from,
    else the kernel's choice.

    A simulated node comes from an address of its own in 127.0.0.0/8 (every address there
    is this machine's), as a real one from its host: 16,384 nodes from one address to one
    server are 16,384 of that address's ~28,000 ephemeral ports, and the kernel finds each
    new connection's port by walking the ones in use (``__inet_hash_connect``), which in a
    leader kill's reconnect storm was ~1.6 s of the clients' CPU, on the cores the server
    uses (perf, both client processes: 13.6% of the machine's samples)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    key = base64.b64encode(os.urandom(16)).decode()
    accept = accept_key(key.encode()).decode()
    request = (
        f"GET {parts.path or '/'} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
    ).encode()
    loop = asyncio.get_running_loop()
    transport, conn = await asyncio.wait_for(
        loop.create_connection(
            lambda: WsConn(request, accept, on_text, on_closed, tag),
            host,
            port,
            local_addr=None if source is None else (source, 0),
        ),
        timeout,
    )
    try:
        return await asyncio.wait_for(asyncio.shield(conn.opened), timeout)
    except BaseException:
        transport.abort()
        raise
