"""Wrong job secrets, counted per job id and per client address (bounded tables).

A join that brings a wrong job secret is refused (``job_secret_mismatch``).
Left alone, a client guesses at line rate: 20 refusals, the connection is
closed, it reconnects (issue 19 measured ~9,000 guesses/s). So:

- Past ``limit`` wrong job secrets for one job id, or from one address,
  within ``window_s``, that job id (address) is *slowed*: every join to it
  (from it) that brings a job secret is held ``delay_s`` before the secret is
  checked, the right one as well as a wrong one, so that no answer (and no
  absence of one) comes sooner; a wrong one is then refused and its
  connection closed: one guess per connection and per ``delay_s``.
- The right secret is never locked out: it is always checked, and joins, at
  most ``delay_s`` late; it is never counted.
- Each table holds at most ``max_keys`` entries of a fixed size (the least
  recently failed go first), so many job ids or addresses cost memory once.

The agent channel (``agent_conn.AgentConn``) asks :meth:`GuessThrottle.hold`
before a join and reports :meth:`GuessThrottle.wrong` after a refusal."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

DEFAULT_LIMIT = 20  # wrong job secrets per window, per job id and per address
DEFAULT_WINDOW_S = 60.0
DEFAULT_DELAY_S = 1.0  # how long a join with a job secret to a slowed job id (from a slowed address) is held
DEFAULT_MAX_KEYS = 10_000  # entries per table (job ids; addresses)


class _Counts:
    """Failures per key in fixed windows, at most ``max_keys`` keys."""

    def __init__(self, limit: int, window_s: float, max_keys: int) -> None:
        self.limit, self.window_s, self.max_keys = limit, window_s, max_keys
        self._keys: collections.OrderedDict[str, tuple[float, int]] = collections.OrderedDict()

    def add(self, key: str, now: float) -> None:
        start, n = self._keys.get(key, (now, 0))
        if now - start >= self.window_s:
            start, n = now, 0
        self._keys[key] = (start, n + 1)
        self._keys.move_to_end(key)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)

    def over(self, key: str, now: float) -> bool:
        entry = self._keys.get(key)
        if entry is None:
            return False
        if now - entry[0] >= self.window_s:
            del self._keys[key]
            return False
        return entry[1] >= self.limit

    def __len__(self) -> int:
        return len(self._keys)


class GuessThrottle:
    def __init__(
        self,
        limit: int = DEFAULT_LIMIT,
        window_s: float = DEFAULT_WINDOW_S,
        delay_s: float = DEFAULT_DELAY_S,
        max_keys: int = DEFAULT_MAX_KEYS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.delay_s = delay_s
        self.clock = clock
        self.jobs = _Counts(limit, window_s, max_keys)
        self.addrs = _Counts(limit, window_s, max_keys)

    @property
    def why(self) -> str:
        """What a refusal while slowed adds to its message."""
        return (
            "too many wrong job secrets for this job id or from this address lately: "
            f"each join with a job secret waits {self.delay_s:g}s, one per connection"
        )

    def slowed(self, job_id: str, addr: str) -> bool:
        """Whether joins with a job secret to ``job_id`` from ``addr`` are held now."""
        now = self.clock()
        return self.jobs.over(job_id, now) or self.addrs.over(addr, now)

    def hold(self, job_id: str, addr: str) -> float:
        """Seconds to hold a join that brings a job secret before it is checked (0: none)."""
        return self.delay_s if self.slowed(job_id, addr) else 0.0

    def wrong(self, job_id: str, addr: str) -> None:
        """Count one wrong job secret for ``job_id`` from ``addr``."""
        now = self.clock()
        self.jobs.add(job_id, now)
        self.addrs.add(addr, now)
