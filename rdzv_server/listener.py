"""Where the server listens: :class:`Listener`, a TCP site like aiohttp's
``TCPSite`` whose connections are :class:`conns.Protocol` (the limits, the
keep-alive), and the two protocols that may answer a connection's first read
before aiohttp parses it: :class:`TakingProtocol` (the agent's upgrade answered
by the server itself, rdzv_server.upgrade; on an HA replica that did not serve
when it accepted the connection, first the early refusal of rdzv_server.early)
and :class:`EarlyProtocol` (that refusal alone, on a site without a taker).
Which one a connection gets is decided as it is accepted; a plain
:class:`conns.Protocol` pays no extra call per read."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import sys
import typing
from typing import Any, cast

from aiohttp import web
from aiohttp.base_protocol import BaseProtocol

from rdzv_common.liveness import keep_alive
from rdzv_common.protocol import printable

from .conns import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    LISTEN_BACKLOG,
    InheritedKeepAlive,
    LogLimiter,
    OpenCount,
    Protocol,
    per_address_limit,
)

log = logging.getLogger("rdzv_server")
_early_log = LogLimiter(log, logging.ERROR, burst=1, rate=0.01)


class EarlyProtocol(Protocol):
    """A :class:`Protocol` whose connection's first bytes ``refuse`` may answer itself, before
    aiohttp parses them (rdzv_server.early). Made only for a connection accepted while its
    site's refuser is active and it has no taker (else :class:`TakingProtocol` refuses too):
    the extra call on every read costs a serving replica nothing (uvloop binds
    ``data_received`` once, when the connection opens)."""

    def __init__(self, manager: web.Server, *, refuse: Refuser, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.refuse: Refuser | None = refuse

    def data_received(self, data: bytes) -> None:
        refuse, self.refuse = self.refuse, None  # a connection's first bytes only
        if refuse is not None and answered_early(self, refuse, data):
            return
        super().data_received(data)


def answered_early(protocol: Protocol, refuse: Refuser, data: bytes) -> bool:
    """Whether ``refuse`` answered the connection's first bytes ``data`` (the answer
    written, the connection closing). No: aiohttp's path answers them, a bug there
    too (as before the early answer)."""
    try:
        answer = refuse(data)
    except Exception as e:
        _early_log("the early answer to a request failed (%s); aiohttp answers it", printable(repr(e), 300))
        return False
    if answer is None:
        return False
    transport = protocol.transport
    if transport is not None:
        transport.write(answer)
        transport.close()  # after the answer is written
    return True


class TakingProtocol(Protocol):
    """A :class:`Protocol` whose connection's first read ``take`` may take whole
    (rdzv_server.upgrade: the agent's upgrade, answered by the server itself): then
    every later read goes to what took it (an :class:`Owner`). aiohttp's side of the
    connection (its task, its timers) starts only when the first read is not taken,
    within the same header timeout from the accept. Accepted while the replica did not
    serve, it has ``refuse`` too, asked first: a failover's new leader starts serving
    while thousands of connections accepted before wait for their first read, and those
    are taken, not left to aiohttp's path (~150 us of CPU an upgrade, against ~95)."""

    def __init__(self, manager: web.Server, *, take: Taker, refuse: Refuser | None = None, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.take: Taker | None = take
        # accepted while the replica did not serve: refused early if it still does not at the first
        # read, else taken (an election ends between accept and read for thousands in a failover)
        self.refuse: Refuser | None = refuse
        self.owner: Owner | None = None
        self._deadline = 0.0
        self._silent: asyncio.TimerHandle | None = None

    def _start(self, transport: asyncio.BaseTransport) -> None:
        BaseProtocol.connection_made(self, transport)  # (the transport, TCP_NODELAY), as aiohttp's first step
        loop = self._loop
        self._deadline = loop.time() + self._keepalive_timeout
        if self._keepalive_timeout > 0:  # (0: none, as aiohttp's)
            self._silent = loop.call_at(self._deadline, self._nothing_sent)

    def _nothing_sent(self) -> None:
        """Nothing arrived within the header timeout: closed, as aiohttp's header timer closes it."""
        self._silent = None
        if self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        owner = self.owner
        if owner is not None:
            owner.feed(data)
            return
        take, self.take = self.take, None
        if take is not None:  # the first read
            if self._silent is not None:
                self._silent.cancel()
                self._silent = None
            if take.stopping:  # the server stops: nothing starts on this connection
                if self.transport is not None:
                    self.transport.close()
                return
            refuse, self.refuse = self.refuse, None
            if refuse is not None and answered_early(self, refuse, data):
                return
            try:
                owner = take(self, data)
            except Exception as e:  # a bug there: aiohttp's path answers, as before this one
                _early_log("taking a connection failed (%s); aiohttp answers it", printable(repr(e), 300))
                owner = None
            if owner is not None:
                self.owner = owner
                self._upgraded = True  # (flow control: no HTTP parser to pause or resume)
                return
            transport = self.transport
            if transport is None:
                return
            super()._start(transport)
            if self._keepalive_handle is not None:  # its header timer counts from the accept, as ours did
                self._keepalive_handle.cancel()
                self._next_keepalive_close_time = self._deadline
                self._keepalive_handle = self._loop.call_at(self._deadline, self._process_keepalive)
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._silent is not None:
            self._silent.cancel()
            self._silent = None
        owner, self.owner = self.owner, None  # (no cycle left through it: freed by reference counting)
        if owner is not None:
            owner.lost()
        super().connection_lost(exc)


class Owner(typing.Protocol):
    """What took a connection (rdzv_server.own_socket.OwnSocket is one): its reads, its loss."""

    def feed(self, data: bytes) -> None: ...

    def lost(self) -> None: ...


class Taker(typing.Protocol):
    """What a site may take before aiohttp (rdzv_server.upgrade.Upgrader is one)."""

    stopping: bool  # the server stops: a connection's first read is neither taken nor aiohttp's
    usable: bool  # it can take connections here at all (when its replica serves)

    def active(self) -> bool:
        """Whether a connection accepted now may be taken (asked again on its first read)."""
        ...

    def __call__(self, protocol: Any, data: bytes) -> Owner | None:
        """A connection's first read -> what took it (it answered), or None: aiohttp's path."""
        ...


class Refuser(typing.Protocol):
    """What a site may answer before aiohttp (rdzv_server.early.Refuser is one)."""

    def active(self) -> bool:
        """Whether a connection accepted now may be answered early (checked again on its bytes)."""
        ...

    def __call__(self, data: bytes) -> bytes | None:
        """A connection's first bytes -> the whole answer, or None: aiohttp's path."""
        ...


class Listener(web.BaseSite):
    """A TCP site like aiohttp's TCPSite, whose connections are :class:`Protocol`."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        ssl_context: ssl.SSLContext | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
        per_address: int | None = None,
        backlog: int = LISTEN_BACKLOG,
        refuse: Refuser | None = None,
        take: Taker | None = None,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context, backlog=backlog)
        self._host, self._port = host, port
        self._handler_kwargs: dict[str, Any] = {
            "keepalive_timeout": header_timeout_s,
            "tcp_keepalive": False,  # Protocol.connection_made sets it with the rest (liveness.keep_alive)
            "access_log": None,
            "max_connections": max_connections,
            "per_address": per_address_limit(per_address, max_connections),
            "by_address": {},  # open connections per client address, shared by this site's connections
            "open_count": OpenCount(),  # and in all
            "inherited": InheritedKeepAlive(),
        }
        self._refuse = refuse  # rdzv_server.early: what a replica that does not serve answers before aiohttp
        self._take = take  # rdzv_server.upgrade: the agent upgrades the server answers itself

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl_context else "http"
        return f"{scheme}://{self._host}:{self._port}"

    @property
    def sockets(self) -> list[socket.socket]:
        # start() made it with loop.create_server: an asyncio.Server
        return list(cast(asyncio.Server, self._server).sockets) if self._server is not None else []

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            self._protocol,
            self._host,
            self._port,
            ssl=self._ssl_context,
            backlog=self._backlog,
            reuse_address=True,
            start_serving=False,  # (a connection made before the options below would have none)
        )
        self._server = server
        # Linux copies a listening socket's keep-alive and user timeout to every socket it
        # accepts: set once here, they cost an accepted connection nothing (set on each, ~4
        # system calls and a socket object: ~3% of an upgrade's CPU at 16,384 nodes)
        sockets = self.sockets
        if sys.platform == "linux" and sockets and all(keep_alive(s) for s in sockets):
            self._handler_kwargs["inherited"].on = True
        await server.start_serving()

    def _protocol(self) -> Protocol:
        manager = self._runner.server
        assert manager is not None
        loop = asyncio.get_running_loop()
        refuse = self._refuse if self._refuse is not None and self._refuse.active() else None
        take = self._take
        if take is not None and take.usable and (refuse is not None or take.active()):
            # (not serving: refused at the first read if it still does not, else taken)
            return TakingProtocol(manager, take=take, refuse=refuse, loop=loop, **self._handler_kwargs)
        if refuse is not None:
            return EarlyProtocol(manager, refuse=refuse, loop=loop, **self._handler_kwargs)
        return Protocol(manager, loop=loop, **self._handler_kwargs)
