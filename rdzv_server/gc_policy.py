"""The standalone server's garbage collector: its thresholds, and young
collections held off while a round change runs (issue 24).

Thousands of held connections are ~100 tracked objects each, and a round
change of a big job makes hundreds of thousands more that live as long as the
round (its nodes' assignments, frames in flight). CPython collects the young
generation every ``threshold0`` net new container objects: at 16,384 nodes,
timed with ``gc.callbacks`` (``bench.big_job``), a formation ran 3 young
collections (265 ms), a scale-up a middle one (496 ms), and every one of them
freed nothing: reference counting frees what a round change drops. So:

- :func:`tune_gc` (at startup): freeze what startup made, and collect the old
  generations far less often (``GC_THRESHOLD``).
- :class:`GcHold`: while joins arrive or a round is fanned out (:meth:`busy`),
  the young threshold is ``HOLD_THRESHOLD0`` instead; ``QUIET_S`` after the
  last of them, or ``MAX_HOLD_S`` after the hold began however busy it stays
  (a client that keeps joining cannot keep the collector off), the tick puts
  it back, and the first allocation after that pays what was held. The hold
  bounds itself in objects too: past ``HOLD_THRESHOLD0`` CPython collects as
  it always does. Only the standalone server holds (``rdzv-server``: it owns
  its process); a server embedded in another program leaves its collector
  alone.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

# A young collection once 200,000 more tracked objects live than at the last one: a steady
# server (heartbeats) then runs none at all, as what it allocates dies by reference counting
# first; at 50,000 it ran one every ~0.3 s at 16,384 nodes, each scanning whatever was in
# flight. Garbage cycles wait for up to that many objects (~30 MB; HOLD_THRESHOLD0 while
# held, for at most MAX_HOLD_S); the middle generation is scanned every 5 young collections,
# so it holds no more than at (50,000, 20): 1,000,000 objects.
GC_THRESHOLD = (200_000, 5, 100)  # young, middle, old (CPython's: 700 / 10 / 10)
HOLD_THRESHOLD0 = 1_000_000  # the young threshold while held: a 16,384-node formation makes ~600,000
QUIET_S = 0.5  # no join or fan-out for this long: the round change is over
MAX_HOLD_S = 5.0  # a hold ends this long after it began, however busy the server stays


def tune_gc() -> None:
    """The garbage collector as the server runs it, once startup is done
    (bench/join_cost.py measures under it too). CPython's full collections
    stop the loop for a second or more at 10,000 held connections and free
    nothing: freeze what startup made and collect the old generations far
    less often; reference counting frees almost everything."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)


class GcHold:
    """Young collections held off while a round change runs (the module's doc)."""

    __slots__ = ("on", "held", "since", "last", "holds", "_clock")

    def __init__(self, on: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        """``on``: hold at all (the store's is off until rdzv-server turns it on)."""
        self._clock = clock
        self.on = on
        self.held = False
        self.since = 0.0  # when the hold in force began
        self.last = 0.0  # the last busy()
        self.holds = 0  # holds begun (tests, and what a reader of a profile may ask)

    def busy(self) -> None:
        """A join arrived, or a round's messages went out: hold (or keep holding)."""
        if not self.on:
            return
        now = self.last = self._clock()
        if not self.held:
            self.held, self.since = True, now
            self.holds += 1
            gc.set_threshold(HOLD_THRESHOLD0, *GC_THRESHOLD[1:])

    def tick(self) -> None:
        """From the store's tick: end the hold once quiet, or once held long enough."""
        if self.held:
            now = self._clock()
            if now - self.last >= QUIET_S or now - self.since >= MAX_HOLD_S:
                self.release()

    def release(self) -> None:
        """Collect as usual again (the next allocation pays what was held): from
        :meth:`tick`, and at once when the store stops ticking (a replica stepping
        down, a store stopping)."""
        if self.held:
            self.held = False
            gc.set_threshold(*GC_THRESHOLD)
