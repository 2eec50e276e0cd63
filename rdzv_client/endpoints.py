"""Endpoint lists: how ``h1:29400,h2:29400`` (the replicas of an HA server,
one of which leads) is read wherever a server endpoint is taken
(:func:`parse_endpoints`), and how a client goes through it: on to the next
endpoint when one fails, or at once to the leader a ``not_leader`` refusal
names if it is one of the list (:class:`EndpointTries`), backing off only after
every endpoint failed (:func:`backoff_delays`, :func:`election_wait`); the
agent looks the list up before it starts (:func:`resolve`).
Standard library only: the agent's link and the REST client both read it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import socket
import time
from collections.abc import Iterator

from rdzv_common.wire import printable

log = logging.getLogger(__name__)

BACKOFF_START_S = 0.05
BACKOFF_MAX_S = 3.0
# A replica answered not_leader: an HA election is on (the dead leader's key
# lives until its lease expires, 2 s by default), and a leader is due any
# moment. The link's waits between cycles of its list stay this short then,
# for the first NOT_LEADER_FAST_S of the outage; after that (etcd itself is
# down, say) it backs off as for any outage.
NOT_LEADER_BACKOFF_MAX_S = 0.5
NOT_LEADER_FAST_S = 15.0
# The most endpoints (HA replicas) one --endpoint list may name.
MAX_ENDPOINTS = 16
# After a drop, the successor the dropped leader named (X-Rdzv-Successor) is tried
# first, and while it answers not_leader (its election, then its load of the state:
# about a second) it is tried again after the short backoff, for this long, rather
# than the other replicas, which would only refuse too.
SUCCESSOR_WAIT_S = 3.0


def parse_endpoint(endpoint: str, default_port: int = 29400) -> tuple[str, str, int]:
    """``host:port``, ``http(s)://host:port`` or ``[v6]:port`` -> (scheme, host, port)."""
    scheme = "http"
    text = endpoint.strip()
    if "://" in text:
        scheme, _, text = text.partition("://")
        if scheme not in ("http", "https"):
            raise ValueError(f"endpoint {endpoint!r}: scheme must be http or https")
    text = text.rstrip("/")
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_s = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, _, port_s = text.partition(":")
    else:
        host, port_s = text, ""
    if not host:
        raise ValueError(f"endpoint {endpoint!r} has no host")
    try:
        port = int(port_s) if port_s else default_port
    except ValueError:
        raise ValueError(f"endpoint {endpoint!r}: port {port_s!r} is not a number") from None
    if not 0 < port < 65536:
        raise ValueError(f"endpoint {endpoint!r}: port {port} out of range")
    return scheme, host, port


def base_url(endpoint: str) -> str:
    scheme, host, port = parse_endpoint(endpoint)
    return f"{scheme}://{'[' + host + ']' if ':' in host else host}:{port}"


def parse_endpoints(text: str) -> list[str]:
    """A comma-separated list of endpoints (each what :func:`parse_endpoint`
    takes; whitespace around items ignored) -> their base URLs, in order,
    duplicates removed. An empty or bad item, or more than MAX_ENDPOINTS, is a
    ValueError of one line naming it. A single endpoint is a list of one."""
    items = text.split(",")
    if len(items) > MAX_ENDPOINTS:
        raise ValueError(f"endpoint list of {len(items)} items: at most {MAX_ENDPOINTS}")
    urls: list[str] = []
    for n, item in enumerate(items, 1):
        item = item.strip()
        if not item:
            raise ValueError(
                f"endpoint list: item {n} of {len(items)} is empty" if len(items) > 1 else "the endpoint is empty"
            )
        url = base_url(item)
        if url not in urls:
            urls.append(url)
    return urls


class Endpoints:
    """The servers of an endpoint list (HA replicas: one of them leads) and
    ``good``, the index of the last one that answered: where the next tries
    start. A hint of which one leads (``X-Rdzv-Leader``) is followed only to
    an endpoint of this list: a replica must not send a client, and its
    token, elsewhere (design.md "Endpoint lists and leader following")."""

    def __init__(self, endpoint: str) -> None:
        self.urls = parse_endpoints(endpoint)
        self.good = 0
        self.successor: int | None = None  # the endpoint the leader in use named to go to first when it goes
        self._said: collections.deque[str] = collections.deque(maxlen=8)  # ignored hints, said once

    def tries(self) -> EndpointTries:
        """A new sequence of tries (one per call or link), from the last good endpoint."""
        return EndpointTries(self)

    def connected(self, successor: str | None) -> None:
        """A connection's upgrade answer named ``successor`` (``X-Rdzv-Successor``:
        the replica that takes over when this leader goes), or nothing: where the
        tries start when that connection drops (only an endpoint of this list)."""
        self.successor = self.index_of(successor) if successor and len(self.urls) > 1 else None

    def index_of(self, leader: str) -> int | None:
        """The index of the endpoint ``leader`` (a hint) names, or None (said once)."""
        try:
            url = base_url(leader).lower()
        except ValueError:
            url = None
        for i, ours in enumerate(self.urls):
            if ours.lower() == url:
                return i
        text = printable(leader, limit=200)
        if text not in self._said:
            self._said.append(text)
            log.warning("ignoring the leader hint %r: not one of the endpoints given (%s)", text, ", ".join(self.urls))
        return None


class EndpointTries:
    """Which endpoint of a list to try now (:attr:`url`), and after a failure
    which next: the leader a refusal named if it is in the list and was not
    tried since the last full cycle, else the next untried one, at once; every
    endpoint failed: back off, then start over (the hint first). After a drop
    (:meth:`dropped`): the successor the dropped leader named, waited for while
    it says not_leader (SUCCESSOR_WAIT_S)."""

    def __init__(self, endpoints: Endpoints) -> None:
        self.endpoints = endpoints
        self.index = endpoints.good
        self._tried: set[int] = set()
        self._left: int | None = None  # the endpoint whose connection dropped
        self._wait_until = 0.0  # monotonic: until then a not_leader from the successor is waited out

    @property
    def url(self) -> str:
        return self.endpoints.urls[self.index]

    def ok(self) -> None:
        """The current endpoint answered: the next tries start here."""
        self.endpoints.good = self.index
        self._tried.clear()
        self._left, self._wait_until = None, 0.0

    def dropped(self) -> bool:
        """The connection in use dropped after a service that held (the caller's
        STABLE_S: a connection that drops at once is a failure, else a leader that
        accepts and drops would bounce agents between it and its successor without
        a backoff): on to the successor its leader named, at once, if it named one
        of the list; else as :meth:`failed`."""
        successor = self.endpoints.successor
        if successor is None or successor == self.index:
            return self.failed()
        self._left, self.index = self.index, successor
        self._wait_until = time.monotonic() + SUCCESSOR_WAIT_S
        return True

    def failed(self, leader: str | None = None, not_leader: bool = False) -> bool:
        """The current endpoint failed (``leader``: the hint its refusal
        carried; ``not_leader``: it answered not_leader). Moves to the endpoint
        to try next; True to try it at once, False to back off first: every
        endpoint failed since the last full cycle, or the successor says it does
        not lead yet (its election) and names no other leader."""
        self._tried.add(self.index)
        urls = self.endpoints.urls
        hint = self.endpoints.index_of(leader) if leader else None
        successor = self.endpoints.successor
        if successor is not None and time.monotonic() < self._wait_until:  # after a drop (dropped)
            if self.index == successor:
                if not not_leader:  # gone too (refused, unreachable): the rest of the list, as before
                    self._wait_until = 0.0
                    self._tried.add(self._left if self._left is not None else self.index)
                elif hint is None or hint == successor or (hint == self._left and hint in self._tried):
                    return False  # its election or its load: back off, then it again
                # it names a leader: followed below, the dropped one too, once (a blip: it still leads)
            elif self.index == self._left and not_leader:  # alive, not leading now (a reload): the list
                self._wait_until = 0.0
            elif self.index == self._left and hint in (None, successor, self._left):
                self.index = successor
                return False  # the dropped leader is gone (refused, unreachable): back off, then its successor
        if hint is not None and hint not in self._tried:
            self.index = hint
            return True
        for step in range(1, len(urls)):
            i = (self.index + step) % len(urls)
            if i not in self._tried:
                self.index = i
                return True
        self._tried.clear()
        self.index = hint if hint is not None else (self.index + 1) % len(urls)
        return False


def backoff_delays(start: float = BACKOFF_START_S, cap: float = BACKOFF_MAX_S) -> Iterator[float]:
    """Exponential backoff with full jitter: 0.05, 0.1, 0.2 ... capped."""
    delay = start
    while True:
        yield random.uniform(delay / 2, delay)
        delay = min(cap, delay * 2)


def election_wait(delay: float, not_leader: bool, down_s: float) -> float:
    """The wait after a failed cycle of the list: ``delay`` (the backoff's),
    or, when a replica of that cycle said not_leader and the server has been
    unreachable for less than NOT_LEADER_FAST_S, at most
    NOT_LEADER_BACKOFF_MAX_S (jittered over its upper half: agents that all
    lost the same leader do not retry in step)."""
    if not_leader and down_s < NOT_LEADER_FAST_S and delay > NOT_LEADER_BACKOFF_MAX_S:
        return random.uniform(NOT_LEADER_BACKOFF_MAX_S / 2, NOT_LEADER_BACKOFF_MAX_S)
    return delay


async def resolve(endpoint: str) -> tuple[tuple[str, int] | None, list[str]]:
    """Every server of the list (HA replicas) looked up: ``(host, port)`` of the
    first that resolves (the route to it is this node's address), or None, and
    a line for each one whose name does not exist (it will not start to; one of
    several may be a replica that is down). A resolver that fails for now
    (EAI_AGAIN) counts as resolving."""
    loop = asyncio.get_running_loop()
    unknown: list[str] = []
    reach: tuple[str, int] | None = None
    for url in parse_endpoints(endpoint):
        _, host, port = parse_endpoint(url)
        try:
            await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            if e.errno != socket.EAI_AGAIN:
                unknown.append(f"server host {printable(host)!r} does not resolve: {e.strerror}")
                continue
        reach = reach or (host, port)
    return reach, unknown
