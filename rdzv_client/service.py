"""The ``--server-timeout`` clock (agent and plugin): time without a served
join, whatever the failure.

A join is *served* when the server answers it with anything but a refusal (an
error, an eviction) and keeps the connection. Unserved: not connected, a
server that accepts then closes, one that never answers the join, one that
refuses each join (``unavailable``, ``rate_limited``, any code), one that
evicts at each join. A service shorter than ``stable_s`` does not count: a
server that answers, then drops us at each join, runs the clock on from
where it was. Pure bookkeeping on a monotonic clock: the link calls it."""

from __future__ import annotations

import errno
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from rdzv_common.errors import ErrorCode
from rdzv_common.wire import printable

from .session import Meaning, classify

# --server-timeout (rdzv-agent) and --rdzv-conf server_timeout (the torchrun plugin): the default
DEFAULT_SERVER_TIMEOUT_S = 300.0
# An endpoint list none of whose endpoints was ever reached, each try refused
# (nothing listens there) or naming an unknown host: a wrong endpoint, given up
# on after this long (or --server-timeout if shorter), not after --server-timeout.
# A server that starts after its agents (pods started together) may need longer:
# $RDZV_NEVER_REACHED_TIMEOUT (seconds) says how long.
NEVER_REACHED_S = 10.0
NEVER_REACHED_ENV = "RDZV_NEVER_REACHED_TIMEOUT"
# refusals that say "not now": the link backs off and joins again, the clock runs
# (the torchrun plugin waits on them; any other refusal ends its rendezvous)
RETRY_LATER_CODES = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.RATE_LIMITED, ErrorCode.NOT_LEADER})
# the link's last_error while a connection is up and the join not answered yet
NO_ANSWER = "connected, but no answer to the join"


class ServiceClock:
    def __init__(self, stable_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.stable_s = stable_s
        self._clock = clock
        self.unserved_since: float | None = clock()  # None while served
        self._served_at: float | None = None  # when the service of this connection began
        self._before: float | None = None  # the clock's start before that service

    @property
    def serving(self) -> bool:
        return self.unserved_since is None

    def unserved_for(self) -> float:
        since = self.unserved_since
        return 0.0 if since is None else self._clock() - since

    def connected(self) -> None:
        """A new connection: nothing of it was served yet."""
        self._served_at = None

    def served(self) -> None:
        """The server answered our join (or there is nothing to ask): the clock stops."""
        if self.unserved_since is not None:
            self._before, self._served_at = self.unserved_since, self._clock()
            self.unserved_since = None

    def unserved(self) -> None:
        """Service ended: a drop, a refusal, an eviction, a new join not answered yet."""
        if self.unserved_since is not None:
            return
        now = self._clock()
        short = self._served_at is not None and now - self._served_at < self.stable_s
        self.unserved_since = self._before if short and self._before is not None else now

    def stable(self) -> bool:
        """This connection's service lasted ``stable_s``: a drop now is news (the backoff starts over)."""
        return self._served_at is not None and self._clock() - self._served_at >= self.stable_s


def never_reached_s() -> float:
    """How long a never-reached endpoint list is tried (NEVER_REACHED_S, or the environment's)."""
    text = os.environ.get(NEVER_REACHED_ENV, "")
    try:
        value = float(text) if text else NEVER_REACHED_S
    except ValueError:
        raise ValueError(f"{NEVER_REACHED_ENV}={printable(text, 50)!r}: must be a number of seconds") from None
    if not value > 0:
        raise ValueError(f"{NEVER_REACHED_ENV}={value:g}: must be a positive number of seconds")
    return value


def nothing_listens(e: BaseException) -> bool:
    """A connect that found nothing at the endpoint: refused (every address a
    name resolves to, asyncio joins them in one OSError), or an unknown host."""
    if isinstance(e, (ConnectionRefusedError, socket.gaierror)):
        return True
    text = str(e)
    tries = text.count("Connect call failed")
    refused = text.count(f"[Errno {errno.ECONNREFUSED}]")
    return text.startswith("Multiple exceptions:") and tries > 0 and refused == tries


class FirstContact:
    """Whether any endpoint of the list was ever reached: until one is, each
    failed connect says what it found (bounded: one entry per endpoint)."""

    def __init__(self) -> None:
        self.tried: dict[str, str] = {}  # endpoint -> what its last connect found
        self.reached = False  # an endpoint answered at least once (or failed otherwise: maybe there)

    def failed(self, base: str, e: BaseException) -> None:
        if not nothing_listens(e):
            self.reached = True  # a timeout, a TLS error...: something may be there
        elif not self.reached:
            self.tried[base] = printable(str(e) or type(e).__name__, 200)

    def seen(self) -> None:
        self.reached = True
        self.tried.clear()

    def never_reached(self) -> str | None:
        """What was tried ("URL: error; ..."), while no endpoint was ever reached; else None."""
        if self.reached or not self.tried:
            return None
        return "; ".join(f"{url}: {why}" for url, why in self.tried.items())


def never_reached_text(down: float, tried: str | None, plugin: bool = False) -> str:
    """The give-up line for an endpoint list never reached: what was tried, what to check."""
    flag = "--rdzv-endpoint (or --rdzv-conf server=)" if plugin else "--endpoint"
    return (
        f"no rdzv server ever answered in {down:.0f}s (tried {tried}): nothing listens there; check the host and "
        f"port of {flag}, and that rdzv-server runs. A server that starts after its nodes: set "
        f"{NEVER_REACHED_ENV}=SECONDS to wait longer"
    )


def refusal(msg: Any, serving: bool) -> str | None:
    """What an ``error`` or ``evicted`` message means for the link: a refusal of
    our join (any code, while the join is unanswered) or a new node needed (an
    eviction, at any time: session.classify) -> the reason to show, and the link
    drops the connection and backs off before it joins again, so a server that
    refuses or evicts at each join is not asked in a tight loop; None: an error
    that refuses a report of a served node, only passed on."""
    heard = classify(msg)
    if serving and heard.meaning is not Meaning.NEW_NODE:
        return None
    return heard.refusal()


def outage_word(last_error: str | None) -> str:
    """How the agent names what it waits for: a server it cannot reach (no
    connection, or one the network lost: a reset, no route, no pong), or one
    that does not serve this node (closes, is silent, refuses, evicts)."""
    if last_error is None or last_error.startswith(("cannot reach", "handshake refused", "connection lost")):
        return "unreachable"
    return "not serving this node"
