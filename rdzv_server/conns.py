"""Connections: how many, for how long, and what is logged about them.

aiohttp's ``TCPSite`` hands every accepted socket to a plain
``RequestHandler``. The server listens through ``listener.Listener`` instead,
whose protocol factory

* builds :class:`Protocol`, a ``RequestHandler`` that closes a new
  connection at once when ``max_connections`` are open (the limit is kept
  below the process's file-descriptor limit, see :func:`raise_fd_limit` and
  :func:`connection_limit`), and whose ``keepalive_timeout``
  is the header-read timeout: aiohttp (3.14.5+) arms that timer when a
  connection opens and after every response, and closes the connection if no
  complete request line and headers arrived by then (a half-sent request, or
  a connection that sends nothing). WebSockets are not affected: the timer
  only closes a connection that waits for a request;
* refuses a new connection from an address that has ``per_address`` open
  already (so that one client cannot take every slot; the benchmarks, whose
  thousands of simulated agents share 127.0.0.1, lift it);
* answers a request that aiohttp's HTTP parser refuses (a 10 kB request line,
  too many headers, garbage bytes) with the server's JSON error body and one
  rate-limited log line (:meth:`Protocol.handle_error`), instead of a
  plain-text 400 and a traceback per request.

:class:`AcceptErrors` is the event loop's exception handler: asyncio reports
every failed ``accept()`` (EMFILE, "Too many open files") with a traceback;
it logs one line per interval with a count.

:func:`body_deadline` is a middleware: a request body must arrive whole
within the body timeout (the header timeout covers only what comes before
it), and one announced but never sent is one rate-limited line, not a
traceback per request.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import time
from http import HTTPStatus
from pathlib import Path
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from rdzv_common.liveness import has_keep_alive, keep_alive
from rdzv_common.protocol import MAX_BODY_BYTES, ErrorBody, ErrorCode, printable

log = logging.getLogger("rdzv_server")

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 10.0  # a request body must arrive whole within this (--body-timeout)
DEFAULT_MAX_CONNECTIONS = 32768
# Open connections one client address may hold (--max-connections-per-address; 0: no limit of
# its own). Never more than half of --max-connections: the rest stays for other clients.
DEFAULT_MAX_CONNECTIONS_PER_ADDRESS = 1024
# Connections the kernel may hold accepted before the server takes them: what the listening
# socket asks for; the kernel caps it at net.core.somaxconn (4096 on most Linux). A reconnect
# storm (a restart, a failover) of more nodes than that overflows the queue, and each connection
# turned away waits for its SYN's retry (1 s, then 3 s): raising somaxconn lets this count.
LISTEN_BACKLOG = 65535
FD_RESERVE = 64  # descriptors kept for the database, logs and the listening socket
_ACCEPT_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class LogLimiter:
    """At most ``burst`` lines, then one per ``1/rate`` seconds, for one kind of
    event; the next line that gets through says how many were left out."""

    def __init__(self, logger: logging.Logger, level: int, burst: int = 10, rate: float = 1.0) -> None:
        self.logger, self.level, self.burst, self.rate = logger, level, burst, rate
        self.tokens = float(burst)
        self.stamp = time.monotonic()
        self.dropped = 0

    def __call__(self, fmt: str, *args: object, exc_info: bool | BaseException = False) -> bool:
        """Log the line (``exc_info``: with the exception being handled, or that one) unless over the limit."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1:
            self.dropped += 1
            return False
        self.tokens -= 1
        if self.dropped:
            fmt, args = fmt + " (%d more like it not logged)", (*args, self.dropped)
            self.dropped = 0
        self.logger.log(self.level, fmt, *args, exc_info=exc_info)
        return True


_bad_http_log = LogLimiter(log, logging.WARNING, burst=10, rate=1.0)
_refused_log = LogLimiter(log, logging.WARNING, burst=1, rate=0.1)
_refused_addr_log = LogLimiter(log, logging.WARNING, burst=1, rate=0.1)
_body_log = LogLimiter(log, logging.WARNING, burst=5, rate=0.2)


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit; return (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            target = int(Path("/proc/sys/fs/nr_open").read_text())
        except (OSError, ValueError):
            target = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft, soft
        return soft, target
    return soft, soft


def connection_limit(requested: int, fd_limit: int) -> int:
    """``requested``, lowered to leave FD_RESERVE descriptors free under ``fd_limit``."""
    if fd_limit == resource.RLIM_INFINITY:
        return requested
    return max(1, min(requested, fd_limit - FD_RESERVE))


def per_address_limit(requested: int | None, max_connections: int) -> int:
    """Connections one address may hold: ``requested`` (None: the default; 0:
    no limit of its own), never more than half of ``max_connections`` unless
    0 was asked for explicitly."""
    if requested == 0:
        return max_connections
    if requested is None:
        requested = DEFAULT_MAX_CONNECTIONS_PER_ADDRESS
    return max(1, min(requested, max_connections // 2))


class OpenCount:
    """Connections a site holds open, counted as they open and close: aiohttp's
    ``Server.connections`` builds a list of every one on each read (O(open)
    per new connection, quadratic over a join storm)."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


class InheritedKeepAlive:
    """Whether a site's accepted sockets have keep-alive from its listening socket
    (``on``: set by :meth:`Listener.start` where the listening socket took them). The
    first socket accepted is checked: a kernel that does not copy them turns this off,
    and every socket gets them itself, as elsewhere."""

    __slots__ = ("on", "checked")

    def __init__(self) -> None:
        self.on = False
        self.checked = False

    def holds(self, sock: Any) -> bool:
        """Whether ``sock`` needs nothing more (the first one is looked at)."""
        if not self.on:
            return False
        if not self.checked:
            self.checked = True
            if not has_keep_alive(sock):
                self.on = False
                log.info("accepted sockets do not inherit keep-alive here; each one is set as it is accepted")
        return self.on


class Protocol(RequestHandler):
    """aiohttp's per-connection HTTP protocol: refuses a connection over the
    limits, and answers what its parser refuses in the server's own terms."""

    def __init__(
        self,
        manager: web.Server,
        *,
        max_connections: int,
        per_address: int,
        by_address: dict[str, int],
        open_count: OpenCount,
        inherited: InheritedKeepAlive | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(manager, **kwargs)
        self.max_connections, self.per_address, self.by_address = max_connections, per_address, by_address
        self.open_count = open_count
        self.inherited = inherited  # its site's: whether its socket has keep-alive from the listening one
        self.refused = False
        self.server = manager
        self.address: str | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Checked here, not in the protocol factory: asyncio accepts a burst of
        # sockets (calling the factory for each) before any connection_made runs.
        open_ = self.open_count.n
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else None
        held = self.by_address.get(address, 0) if address is not None else 0
        if open_ >= self.max_connections:
            self.refused = True
            _refused_log(
                "refusing new connections: %d open, the limit is %d (--max-connections, fd limit)",
                open_,
                self.max_connections,
            )
        elif held >= self.per_address:
            self.refused = True
            _refused_addr_log(
                "refusing new connections from %s: it holds %d, the limit per address is %d "
                "(--max-connections-per-address)",
                printable(address, limit=64),
                held,
                self.per_address,
            )
        if self.refused:
            cast(asyncio.Transport, transport).abort()  # a socket's transport
            return
        if address is not None:
            self.address = address
            self.by_address[address] = held + 1
        sock = transport.get_extra_info("socket")
        if self.inherited is None or not self.inherited.holds(sock):  # a vanished agent host fails the connection
            keep_alive(sock)
        self.open_count.n += 1
        self._start(transport)

    def _start(self, transport: asyncio.BaseTransport) -> None:
        """aiohttp's side of the connection: its task, its header timer."""
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.refused:
            return
        self.open_count.n -= 1
        if self.address is not None:
            left = self.by_address.get(self.address, 1) - 1
            if left > 0:
                self.by_address[self.address] = left
            else:
                self.by_address.pop(self.address, None)
            self.address = None
        super().connection_lost(exc)

    def handle_error(
        self, request: BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        if status >= 500:  # a bug in a handler: keep aiohttp's traceback in the log
            return super().handle_error(request, status, exc, message)
        if request.writer.output_size > 0:  # as aiohttp: a response already started
            raise ConnectionError("a response was sent already; cannot send the error")
        reason = message or (str(exc) if exc else "") or HTTPStatus(status).phrase
        # aiohttp's parser messages run over several lines (the bad bytes, a caret): keep the first
        text = printable(next((ln for ln in reason.splitlines() if ln.strip()), reason).strip(), limit=300)
        _bad_http_log("bad HTTP request from %s: %s (%d)", printable(request.remote, limit=64), text, status)
        code = ErrorCode.BODY_TOO_LARGE if status == 413 else ErrorCode.BAD_REQUEST
        resp = web.Response(
            status=status,
            content_type="application/json",
            text=ErrorBody(code=code, message=f"malformed HTTP request: {text}").model_dump_json(),
        )
        resp.force_close()
        return resp


class AcceptErrors:
    """Event loop exception handler: failed accepts (out of descriptors or
    memory) are logged once per ``interval`` with a count; anything else goes
    to asyncio's default handler."""

    def __init__(self, interval: float = 10.0) -> None:
        self.limit = LogLimiter(log, logging.ERROR, burst=1, rate=1.0 / interval)

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _ACCEPT_ERRNOS:
            self.limit("cannot accept connections: %s", exc.strerror or exc)
            return
        loop.default_exception_handler(context)


def body_deadline(timeout_s: float) -> Any:
    """A middleware: the request's body has arrived whole within ``timeout_s``
    (408, connection closed, otherwise) before the handler runs; the handler
    reads it from the buffer. A body announced and never sent (the client went
    away) is one rate-limited line, not a traceback."""

    @web.middleware
    async def read_body(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.can_read_body:
            size = request.content_length
            if size is not None and size > MAX_BODY_BYTES:  # refused before waiting for it
                raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY_BYTES, actual_size=size)
            try:
                if (exc := request.content.exception()) is not None:
                    raise exc
                # buffered, not consumed (flow control pauses a bigger one: it times out)
                await asyncio.wait_for(request.content.wait_eof(), timeout_s)
            except asyncio.TimeoutError:
                _body_log(
                    "closing a connection from %s: its request body did not arrive within %gs (--body-timeout)",
                    printable(request.remote, limit=64),
                    timeout_s,
                )
                return _closing(408, f"the request body did not arrive within {timeout_s:g}s")
            except (ConnectionError, HttpProcessingError) as e:
                _body_log(
                    "request from %s ended before its body: %s",
                    printable(request.remote, limit=64),
                    printable(str(e) or type(e).__name__, limit=200),
                )
                return _closing(400, "incomplete request body")
        return await handler(request)

    return read_body


def _closing(status: int, message: str) -> web.Response:
    body = ErrorBody(code=ErrorCode.BAD_REQUEST, message=message).model_dump_json()
    resp = web.json_response(text=body, status=status)
    resp.force_close()
    return resp
