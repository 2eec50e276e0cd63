"""The agent's WebSocket upgrade, taken by the server itself where every check
of aiohttp's path passes; anything else goes to aiohttp, as before.

A reconnect storm (a failover, a server restart) is one upgrade per node at
once: at 16,384 nodes, through aiohttp (its request, the middlewares, the
router, ``WebSocketResponse.prepare``, a task per connection from the moment
it opened) each one cost the server ~150-190 us of CPU, against ~30 us for a
bare handshake (``python -m bench.upgrade_floor``), seconds of a leader kill.
:class:`Upgrader` answers a connection's first read itself
(:class:`listener.TakingProtocol`: aiohttp's side of a connection starts only for
the reads it does not take) when the read is exactly one agent upgrade
(:func:`request_head`):

* ``GET /v1/agent HTTP/1.1``, the whole head in the read (what follows it is
  the WebSocket's), at most :data:`MAX_HEAD` bytes of printable ASCII, no
  header repeated, and only the headers an agent sends (:data:`AGENT_HEADERS`:
  no ``Origin``, no cookie, no extension or subprotocol offered, no body);
* the handshake aiohttp would accept (``Upgrade: websocket``, ``Connection:
  upgrade``, version 13, a key of 16 bytes);
* every check of rdzv_server/auth.py that applies: the Host check against DNS
  rebinding where the server has no token and listens on loopback, and the
  bearer token (either role) where it has one;
* the replica serves (a replica that does not is rdzv_server.early's).

Then the answer is the 101 with the accept key, the connection is an
:class:`~.own_socket.OwnSocket`, and its loop is the agent channel's
(rdzv_server.agent_conn), in a task of its own. Whatever fails a check (a
wrong token, a foreign Origin, a browser's cookie, a split head) is left to
aiohttp, whose answers (401 and the throttle, 403, 400) and audit lines stay
the only ones: this path refuses nothing."""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import re
from typing import Any

from aiohttp import web

from rdzv_common.errors import SUCCESSOR_HEADER
from rdzv_common.protocol import AGENT_PATH, MAX_BODY_BYTES, printable
from rdzv_common.wire import accept_key

from .agent_conn import AgentConn
from .auth import Auth, bearer, loopback_host_header
from .keys import AUTH, STORE
from .own_socket import OwnSocket, available
from .ws_channel import bug_log

_FIRST = f"GET {AGENT_PATH} HTTP/1.1\r\n".encode()
_END = b"\r\n\r\n"
MAX_HEAD = 4096  # bytes of an agent's upgrade request (the agent's is ~200, its token included)
# The headers an agent's upgrade has (rdzv_client.wsclient, bench/rawws.py); any other: aiohttp's path.
AGENT_HEADERS = frozenset(
    {"host", "upgrade", "connection", "sec-websocket-key", "sec-websocket-version", "authorization"}
)
_NAME = re.compile(r"[A-Za-z0-9-]+")  # a header name as agents write them (RFC 9110's tokens, less what none uses)
SHUTDOWN_S = 2.0  # what the server's stop gives the connections' loops to end (as aiohttp's shutdown timeout)


def request_head(data: bytes) -> tuple[dict[str, str], bytes] | None:
    """An agent's upgrade request in ``data``: its headers (names in lower case) and the
    bytes after the head; None when ``data`` is not exactly that (aiohttp's path)."""
    if not data.startswith(_FIRST):
        return None
    end = data.find(_END)
    if end < 0 or end + 4 > MAX_HEAD:
        return None
    try:
        text = data[len(_FIRST) : end].decode("ascii")
    except UnicodeDecodeError:
        return None
    headers: dict[str, str] = {}
    for line in text.split("\r\n"):
        name, sep, value = line.partition(":")
        key = name.lower()
        if not sep or key not in AGENT_HEADERS or key in headers or not _NAME.fullmatch(name):
            return None
        value = value.strip(" \t")
        if not value.isprintable():  # (in ASCII: no control character, CR and LF included)
            return None
        headers[key] = value
    return headers, data[end + 4 :]


def handshake_key(headers: dict[str, str], auth: Auth) -> str | None:
    """The ``Sec-WebSocket-Key`` of an upgrade that passes every check aiohttp's path would
    make of it (module docstring), or None."""
    if headers.get("upgrade", "").lower() != "websocket" or headers.get("sec-websocket-version") != "13":
        return None
    if "upgrade" not in (t.strip().lower() for t in headers.get("connection", "").split(",")):
        return None
    key = headers.get("sec-websocket-key", "")
    try:
        if len(base64.b64decode(key, validate=True)) != 16:
            return None
    except (binascii.Error, ValueError):
        return None
    host = headers.get("host")
    if host is None or (auth.check_host and not loopback_host_header(host)):
        return None
    if auth.token:
        given = bearer(headers.get("authorization", ""))
        if given is None or auth.role_of(given) is None:
            return None
    return key


def switching(key: str, successor: str | None = None) -> bytes:
    """The 101 answer to an upgrade with ``key``; ``successor`` (a header-safe URL,
    rdzv_server.ha_peers): the replica this leader's agents go to first when it goes."""
    more = f"{SUCCESSOR_HEADER}: {successor}\r\n" if successor else ""
    return (
        "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: upgrade\r\n"
        f"Sec-WebSocket-Accept: {accept_key(key)}\r\n{more}\r\n"
    ).encode("ascii")


class Upgrader:
    """For listener.Listener (a ``listener.Taker``): ``app``'s agent upgrades taken on a
    connection's first read, while its replica serves and the server is not stopping."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.store = app[STORE]
        self.auth: Auth = app[AUTH]
        self.open: set[OwnSocket] = set()  # the connections it took, until their loops end
        self.usable = available()
        self.stopping = False  # the server stops: a first read is neither taken nor aiohttp's
        app.on_shutdown.append(self.shutdown)

    def active(self) -> bool:
        return self.usable and self.store.serving

    def __call__(self, protocol: Any, data: bytes) -> OwnSocket | None:
        """Take the connection of ``protocol`` (its first read: ``data``), or None."""
        if not self.store.serving:
            return None
        got = request_head(data)
        if got is None:
            return None
        headers, rest = got
        key = handshake_key(headers, self.auth)
        transport = protocol.transport
        if key is None or transport is None or transport.is_closing():
            return None
        answer = switching(key, self.store.successor_url)
        sock = OwnSocket(protocol, transport, MAX_BODY_BYTES)
        task = asyncio.get_running_loop().create_task(AgentConn.serve(self.app, sock, transport, protocol.address))
        sock.task = task
        self.open.add(sock)
        task.add_done_callback(functools.partial(self._ended, sock))
        transport.write(answer)  # (nothing above wrote: had it raised, aiohttp would answer the request)
        if rest:  # frames sent before the 101 arrived: the WebSocket's
            sock.feed(rest)
        return sock

    def _ended(self, sock: OwnSocket, task: asyncio.Task[None]) -> None:
        """A connection's loop ended (or was cancelled before it began: its connection is cut)."""
        self.open.discard(sock)
        sock.task = None
        if not task.cancelled() and (e := task.exception()) is not None:
            bug_log("an agent connection from %s failed", printable(sock.protocol.address, 64), exc_info=e)
        if not sock.closed:
            sock.transport.abort()

    async def shutdown(self, app: web.Application) -> None:
        """The server stops: each connection's loop ends (its agent told, the connection closed)."""
        self.stopping = True
        tasks = [sock.task for sock in self.open if sock.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=SHUTDOWN_S)
