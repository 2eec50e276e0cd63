"""Audit lines: who was refused or closed a job, from which address, and why.

Each event is one log line (its text escaped with :func:`protocol.printable`),
but a flood of one kind (a client retrying a wrong token in a loop) must not
flood the log: each kind logs at most ``per_window`` lines per ``window_s``
seconds, and one ``suppressed K similar ...`` line once that window is over
(said by :meth:`Audit.flush`, which the app calls every second, or by the next
event of that kind).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from rdzv_common.logs import extra
from rdzv_common.protocol import printable

PER_WINDOW = 10
WINDOW_S = 10.0
MAX_KINDS = 64
MAX_LINE = 2000

log = logging.getLogger(__name__)


class _Window:
    __slots__ = ("logged", "start", "suppressed")

    def __init__(self, start: float) -> None:
        self.start = start
        self.logged = 0
        self.suppressed = 0


class Audit:
    """A per-kind rate limit in front of one logger."""

    def __init__(
        self,
        logger: logging.Logger = log,
        per_window: int = PER_WINDOW,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
        max_kinds: int = MAX_KINDS,
        level: int = logging.WARNING,
    ) -> None:
        self.logger = logger
        self.per_window = per_window
        self.window_s = window_s
        self.clock = clock
        self.max_kinds = max_kinds
        self.level = level
        self._kinds: dict[str, _Window] = {}

    def event(self, kind: str, text: str) -> None:
        """Log ``text`` (escaped, one line) unless ``kind`` used up its window.
        A :class:`~rdzv_common.logs.Line` keeps its fields in the json format."""
        now = self.clock()
        w = self._kinds.get(kind)
        if w is not None and now - w.start >= self.window_s:
            self._close(kind, w)
            w = None
        if w is None:
            if len(self._kinds) >= self.max_kinds:
                self.flush()
                while len(self._kinds) >= self.max_kinds:  # still full: the oldest window goes first
                    oldest = min(self._kinds, key=lambda k: self._kinds[k].start)
                    self._close(oldest, self._kinds[oldest])
            w = self._kinds[kind] = _Window(now)
        if w.logged < self.per_window:
            w.logged += 1
            self.logger.log(self.level, "%s", printable(text, MAX_LINE), extra=extra(text))
        else:
            w.suppressed += 1

    def flush(self) -> None:
        """Say what windows that are over suppressed, and forget them."""
        now = self.clock()
        for kind, w in list(self._kinds.items()):
            if now - w.start >= self.window_s:
                self._close(kind, w)

    def _close(self, kind: str, w: _Window) -> None:
        del self._kinds[kind]
        if w.suppressed:
            self.logger.log(
                self.level,
                "suppressed %d similar %s line(s) in the last %g s",
                w.suppressed,
                printable(repr(kind)),
                self.window_s,
            )
