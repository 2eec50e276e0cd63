"""Rate-limited log lines: what a server or a local process can make an
agent say in a loop (a refusal at each join, a forged datagram) is said once,
then at most once every ``every_s`` per kind, with a count of what was held back.
Bounded: at most ``max_keys`` kinds are remembered."""

from __future__ import annotations

import collections
import time

DEFAULT_EVERY_S = 30.0
MAX_KEYS = 64


class Quiet:
    def __init__(self, every_s: float = DEFAULT_EVERY_S, max_keys: int = MAX_KEYS) -> None:
        self.every_s = every_s
        self.max_keys = max_keys
        # kind -> (when last said, how many held back since)
        self._said: collections.OrderedDict[str, tuple[float, int]] = collections.OrderedDict()

    def allow(self, key: str, now: float | None = None) -> str | None:
        """None: hold this line back; else a suffix for it ("" or the count held back)."""
        now = time.monotonic() if now is None else now
        last = self._said.get(key)
        if last is not None and now - last[0] < self.every_s:
            self._said[key] = (last[0], last[1] + 1)
            return None
        held = last[1] if last is not None else 0
        self._said[key] = (now, 0)
        self._said.move_to_end(key)
        while len(self._said) > self.max_keys:
            self._said.popitem(last=False)
        return f" ({held} more like it in the last {now - last[0]:.0f}s)" if last is not None and held else ""
