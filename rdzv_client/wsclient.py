"""A small RFC 6455 WebSocket client on asyncio streams: the agent's channel.

Standard library only, so that an agent starts and sends its join in a
fraction of the time ``import aiohttp`` takes (start-up is part of recovery).
What the agent needs and nothing more:

* the HTTP/1.1 upgrade, with the ``Sec-WebSocket-Accept`` check, extra
  headers (the bearer token), TLS through :mod:`ssl` (the caller's context),
  and one deadline for TCP, TLS and the handshake;
* masked client frames; text, ping, pong and close; fragmented messages;
  a bound on a message's size (a bigger one closes with 1009);
* a client-side ping: after ``ping_s`` seconds without a frame from the
  server it pings, and closes the connection when nothing arrives in the next
  ``ping_s / 2`` seconds (a frozen or cut-off server, as aiohttp's
  ``heartbeat``). Frames are read by :meth:`WebSocket.recv`: the owner keeps
  one reader waiting (as the agent's link does), or pongs go unnoticed.

Binary messages are read and dropped (the agent channel is JSON text).
A refused handshake raises :class:`HandshakeError` with the HTTP status, the
response's headers and its small body (an HA replica's ``not_leader`` names
the leader in a header); a
broken connection or protocol ends :meth:`WebSocket.recv` with ``None``
and leaves the reason in :attr:`WebSocket.close_reason`.
"""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import ssl as ssl_mod
import struct
import time

from rdzv_common.wire import accept_key, printable

MAX_HEADER_BYTES = 16 * 1024
MAX_REFUSAL_BODY_BYTES = 4096

OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA


class WSError(Exception):
    """The connection could not be made or broke (not a refusal)."""


class HandshakeError(WSError):
    """The server answered the upgrade with something other than 101 (or a bad accept).
    ``headers``: the response's headers (names in lower case; bounded by
    MAX_HEADER_BYTES); ``body``: its body when it said a Content-Length of
    at most MAX_REFUSAL_BODY_BYTES (a refusal's JSON ``{"code","message"}``), else empty."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None, body: bytes = b"") -> None:
        super().__init__(f"{status} {message}")
        self.status = status
        self.message = message
        self.headers = headers or {}
        self.body = body


def mask(data: bytes, key: bytes) -> bytes:
    """XOR ``data`` with the 4-byte ``key`` repeated (RFC 6455 5.3)."""
    n = len(data)
    if not n:
        return data
    k = (key * (n // 4 + 1))[:n]
    return (int.from_bytes(data, "little") ^ int.from_bytes(k, "little")).to_bytes(n, "little")


def encode_frame(opcode: int, payload: bytes, fin: bool = True) -> bytes:
    """One masked client frame."""
    n = len(payload)
    head = bytes([(0x80 if fin else 0) | opcode])
    if n < 126:
        head += bytes([0x80 | n])
    elif n < 1 << 16:
        head += bytes([0x80 | 126]) + struct.pack("!H", n)
    else:
        head += bytes([0x80 | 127]) + struct.pack("!Q", n)
    key = os.urandom(4)
    return head + key + mask(payload, key)


class WebSocket:
    """One client connection. Use :func:`connect`."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        max_msg_size: int,
        ping_s: float | None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self.headers = headers or {}  # the upgrade response's (names in lower case; bounded by MAX_HEADER_BYTES)
        self.max_msg_size = max_msg_size
        self.ping_s = ping_s
        self.closed = False
        self.close_code: int | None = None
        self.close_reason: str | None = None
        self.server_reason: str | None = None  # the text of the server's close frame, if it gave one
        self._close_sent = False
        self._last_rx = time.monotonic()
        self._reading = False
        self._closing = False
        self._done = asyncio.Event()
        self._pinger = asyncio.ensure_future(self._ping_loop()) if ping_s else None

    # -- sending

    async def send_str(self, text: str) -> None:
        await self._send(OP_TEXT, text.encode())

    async def _send(self, opcode: int, payload: bytes) -> None:
        if self.closed or (self._close_sent and opcode != OP_CLOSE):
            raise ConnectionError("websocket is closed")
        self._writer.write(encode_frame(opcode, payload))
        await self._writer.drain()

    async def _send_close(self, code: int, reason: str = "") -> None:
        if self._close_sent or self.closed:
            return
        self._close_sent = True
        try:
            await self._send(OP_CLOSE, struct.pack("!H", code) + reason.encode()[:120])
        except (ConnectionError, OSError):
            pass

    # -- receiving

    async def recv(self) -> str | None:
        """The next text message, or None once the connection is over.
        One reader at a time."""
        if self._reading:
            raise RuntimeError("recv() while another recv() waits")
        self._reading = True
        try:
            return await self._recv()
        finally:
            self._reading = False

    async def _recv(self) -> str | None:
        parts: list[bytes] = []
        size = 0
        msg_op: int | None = None
        while not self.closed:
            try:
                fin, opcode, payload = await self._read_frame()
            except (asyncio.IncompleteReadError, ConnectionError, OSError, ssl_mod.SSLError) as e:
                self._abort(f"connection lost: {e or type(e).__name__}")
                return None
            except _TooBig as e:
                await self._fail(1009, str(e))
                return None
            except WSError as e:
                await self._fail(1002, str(e))
                return None
            self._last_rx = time.monotonic()
            if opcode >= 0x8:  # control frames (may come between fragments)
                if opcode == OP_PING:
                    try:
                        await self._send(OP_PONG, payload)
                    except (ConnectionError, OSError):
                        pass
                elif opcode == OP_CLOSE:
                    code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else 1005
                    await self._send_close(code if code not in (1005, 1006) else 1000)
                    self.close_code = code
                    # why, in its words (at most 123 bytes: a control frame's): the agent says it
                    self.server_reason = printable(payload[2:].decode("utf-8", "replace"), limit=200) or None
                    self._abort(
                        f"closed by the server ({code}" + (f": {self.server_reason})" if self.server_reason else ")")
                    )
                    return None
                elif opcode != OP_PONG:
                    await self._fail(1002, f"unknown control opcode {opcode}")
                    return None
                continue
            if opcode == OP_CONT:
                if msg_op is None:
                    await self._fail(1002, "continuation frame without a message")
                    return None
            elif msg_op is not None:
                await self._fail(1002, "new message inside a fragmented one")
                return None
            elif opcode in (OP_TEXT, OP_BINARY):
                msg_op = opcode
            else:
                await self._fail(1002, f"unknown opcode {opcode}")
                return None
            size += len(payload)
            if size > self.max_msg_size:
                await self._fail(1009, f"message over {self.max_msg_size} bytes")
                return None
            parts.append(payload)
            if fin:
                data, op = b"".join(parts), msg_op
                parts, size, msg_op = [], 0, None
                if op == OP_TEXT:
                    try:
                        return data.decode("utf-8")
                    except UnicodeDecodeError:
                        await self._fail(1007, "text message is not UTF-8")
                        return None
                # binary: not part of this protocol; dropped
        return None

    async def _read_frame(self) -> tuple[bool, int, bytes]:
        b0, b1 = await self._reader.readexactly(2)
        if b0 & 0x70:
            raise WSError("reserved bits set (no extension was negotiated)")
        if b1 & 0x80:
            raise WSError("the server masked a frame")
        fin, opcode, n = bool(b0 & 0x80), b0 & 0x0F, b1 & 0x7F
        if opcode >= 0x8 and (n > 125 or not fin):
            raise WSError("bad control frame")
        if n == 126:
            n = struct.unpack("!H", await self._reader.readexactly(2))[0]
        elif n == 127:
            n = struct.unpack("!Q", await self._reader.readexactly(8))[0]
        if n > self.max_msg_size:
            raise _TooBig(f"frame of {n} bytes, over {self.max_msg_size}")
        return fin, opcode, await self._reader.readexactly(n)

    # -- ending

    async def _fail(self, code: int, why: str) -> None:
        await self._send_close(code, why)
        self._abort(f"protocol error: {why}")

    def _abort(self, why: str) -> None:
        if self.close_reason is None:
            self.close_reason = why
        self.closed = True
        self._done.set()
        if self._pinger is not None and self._pinger is not asyncio.current_task():
            self._pinger.cancel()
        self._writer.close()

    async def close(self, code: int = 1000, timeout: float = 1.0) -> None:
        """Say goodbye (a close frame), wait up to ``timeout`` for the server's, hang up."""
        if self.closed:
            return
        if self._closing:  # another close() is at it: wait for its end
            try:
                await asyncio.wait_for(self._done.wait(), timeout)
            except asyncio.TimeoutError:
                pass
            return
        self._closing = True
        await self._send_close(code)
        try:
            # the reader (ours, or the one waiting in recv()) sees the server's close
            await asyncio.wait_for(self._done.wait() if self._reading else self._drain_until_closed(), timeout)
        except (asyncio.TimeoutError, ConnectionError, OSError):
            pass
        self._abort("closed by this side")

    async def _drain_until_closed(self) -> None:
        while not self.closed and await self.recv() is not None:
            pass

    async def _ping_loop(self) -> None:
        assert self.ping_s
        try:
            while not self.closed:
                quiet = time.monotonic() - self._last_rx
                if quiet < self.ping_s:
                    await asyncio.sleep(self.ping_s - quiet)
                    continue
                sent_at = time.monotonic()
                try:
                    await self._send(OP_PING, b"")
                except (ConnectionError, OSError):
                    return
                await asyncio.sleep(self.ping_s / 2)
                if self._last_rx < sent_at and not self.closed:
                    self.close_code = 1006
                    self._abort(f"no pong from the server in {self.ping_s / 2:g}s")
                    return
        except asyncio.CancelledError:
            pass

    def __aiter__(self) -> WebSocket:
        return self

    async def __anext__(self) -> str:
        text = await self.recv()
        if text is None:
            raise StopAsyncIteration
        return text


class _TooBig(WSError):
    pass


async def _refusal_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    """A refused upgrade's body, when it is small and says its length (else b"")."""
    length = headers.get("content-length", "")
    if not length.isdigit() or int(length) > MAX_REFUSAL_BODY_BYTES:
        return b""
    try:
        return await reader.readexactly(int(length))
    except (asyncio.IncompleteReadError, ConnectionError, OSError, ssl_mod.SSLError):
        return b""


async def connect(
    host: str,
    port: int,
    path: str,
    *,
    headers: dict[str, str] | None = None,
    ssl: ssl_mod.SSLContext | None = None,
    timeout: float = 5.0,
    max_msg_size: int = 4 * 1024 * 1024,
    ping_s: float | None = None,
    user_timeout_s: float | None = None,
) -> WebSocket:
    """Open a WebSocket to ``host:port`` at ``path`` (TLS when ``ssl`` is a
    context). ``timeout`` bounds TCP, TLS and the upgrade together.
    ``user_timeout_s``: the connection fails once data sent stays unacknowledged
    this long (TCP_USER_TIMEOUT, Linux): a peer *host* that died or was cut off
    is noticed at the next send, not at the next ping's timeout."""
    return await asyncio.wait_for(
        _connect(host, port, path, headers or {}, ssl, max_msg_size, ping_s, user_timeout_s), timeout
    )


def _set_user_timeout(writer: asyncio.StreamWriter, seconds: float | None) -> None:
    option = getattr(socket, "TCP_USER_TIMEOUT", None)  # Linux only
    sock = writer.get_extra_info("socket")
    if seconds is None or option is None or sock is None:
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, option, int(seconds * 1000))
    except OSError:  # not a TCP socket (a test's pipe), or refused: the ping still detects a dead peer
        pass


async def _connect(
    host: str,
    port: int,
    path: str,
    headers: dict[str, str],
    ssl: ssl_mod.SSLContext | None,
    max_msg_size: int,
    ping_s: float | None,
    user_timeout_s: float | None = None,
) -> WebSocket:
    reader, writer = await asyncio.open_connection(
        host, port, ssl=ssl, server_hostname=host if ssl else None, limit=MAX_HEADER_BYTES
    )
    try:
        _set_user_timeout(writer, user_timeout_s)
        key = base64.b64encode(os.urandom(16)).decode()
        host_header = f"[{host}]" if ":" in host else host
        lines = [
            f"GET {path} HTTP/1.1",
            f"Host: {host_header}:{port}",
            "Upgrade: websocket",
            "Connection: Upgrade",
            f"Sec-WebSocket-Key: {key}",
            "Sec-WebSocket-Version: 13",
        ]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        await writer.drain()
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            raise WSError("the server's upgrade response headers are too long") from None
        except asyncio.IncompleteReadError:
            raise WSError("the server closed the connection during the upgrade") from None
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
            raise WSError(f"not an HTTP response: {status_line[:100]!r}")
        status, reason = int(parts[1]), (parts[2] if len(parts) > 2 else "")
        got: dict[str, str] = {}
        for line in header_lines:
            name, sep, value = line.partition(":")
            if sep:
                got[name.strip().lower()] = value.strip()
        if status != 101:
            raise HandshakeError(status, reason, got, await _refusal_body(reader, got))
        if got.get("upgrade", "").lower() != "websocket" or "upgrade" not in got.get("connection", "").lower():
            raise HandshakeError(status, "Invalid upgrade header")
        if got.get("sec-websocket-accept") != accept_key(key):
            raise HandshakeError(status, "Invalid challenge response")
        if got.get("sec-websocket-extensions"):
            raise HandshakeError(status, "Unexpected extension")
    except BaseException:
        writer.close()
        raise
    return WebSocket(reader, writer, max_msg_size, ping_s, got)
