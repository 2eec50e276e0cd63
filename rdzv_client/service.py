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

import time
from collections.abc import Callable
from typing import Any

from rdzv_server.errors import ErrorCode

from .session import Meaning, classify

# --server-timeout (rdzv-agent) and --rdzv-conf server_timeout (the torchrun plugin): the default
DEFAULT_SERVER_TIMEOUT_S = 300.0
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
    """How the agent names what it waits for: a server it cannot reach, or one
    that does not serve this node (closes, is silent, refuses, evicts)."""
    if last_error is None or last_error.startswith(("cannot reach", "handshake refused")):
        return "unreachable"
    return "not serving this node"
