"""Failed authentication, counted per client address (a bounded table).

A client that sends ``limit`` wrong tokens (bearer or /ui login) within
``window_s`` has its wrong ones answered 429 ``rate_limited`` for
``window_s`` (no more counting, no audit line each), while the right token
still passes (:mod:`rdzv_server.auth` checks it first): a guesser behind the
same NAT as real agents cannot lock them out. What makes guessing hopeless is
the token's strength (``auth.MIN_TOKEN_LEN``); this keeps a flood of guesses
cheap and tells a misconfigured client to back off. A client that
authenticates is never counted. The table holds at
most ``max_addrs`` addresses (the least recently failed go first), so a
flood from many addresses costs memory once, not for ever."""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable

DEFAULT_LIMIT = 20  # wrong tokens per window and address
DEFAULT_WINDOW_S = 60.0
DEFAULT_MAX_ADDRS = 10_000


class AuthThrottle:
    def __init__(
        self,
        limit: int = DEFAULT_LIMIT,
        window_s: float = DEFAULT_WINDOW_S,
        max_addrs: int = DEFAULT_MAX_ADDRS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self.window_s = window_s
        self.max_addrs = max_addrs
        self.clock = clock
        # address -> [start of its window, failures in it, blocked until (0: not blocked)]
        self._addrs: collections.OrderedDict[str, list[float]] = collections.OrderedDict()

    def blocked(self, addr: str) -> float:
        """Seconds ``addr`` is still refused (0: not refused)."""
        entry = self._addrs.get(addr)
        if entry is None or not entry[2]:
            return 0.0
        left = entry[2] - self.clock()
        if left <= 0:
            del self._addrs[addr]
            return 0.0
        return left

    def retry_after(self, addr: str) -> str:
        """The Retry-After header's value for a refused ``addr`` (whole seconds, at least 1)."""
        return str(max(1, math.ceil(self.blocked(addr))))

    def failed(self, addr: str) -> bool:
        """Count a wrong token from ``addr``; True when that blocks it."""
        now = self.clock()
        entry = self._addrs.get(addr)
        if entry is None or now - entry[0] >= self.window_s:
            entry = [now, 0.0, 0.0]
        entry[1] += 1
        if entry[1] >= self.limit:
            entry[2] = now + self.window_s
        self._addrs[addr] = entry
        self._addrs.move_to_end(addr)
        while len(self._addrs) > self.max_addrs:
            self._addrs.popitem(last=False)
        return bool(entry[2])

    def __len__(self) -> int:
        return len(self._addrs)
