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
- :class:`GcHold`: while joins arrive, a round is fanned out, or agents'
  connections open (:meth:`busy`: a failover's or a restart's reconnect storm
  makes ~100 objects per connection), the young threshold is
  ``HOLD_THRESHOLD0`` instead. What a hold made is then frozen
  (``gc.freeze``: out of every later collection, at no cost) rather than
  scanned: by the tick once ``FREEZE_AT`` young objects wait, and when the
  hold ends, ``QUIET_S`` after the last busy() or ``MAX_HOLD_S`` after it
  began however busy the server stays (a client that keeps joining cannot
  keep the collector off: after a hold, CPython collects as it always does
  until the next one). Scanned, those objects cost a young and a middle
  collection each (at 16,384 connections, 0.55-1.1 s of a new leader's CPU)
  and freed nothing: a full collection after a 4,096-node formation and a
  node loss of half of it freed 0 objects.
- The valve: garbage cycles frozen with them would never be freed, so at the
  end of a hold, once the interpreter's heap (``sys.getallocatedblocks``:
  every object and small allocation, read in ~0.5 ms; counting the frozen
  objects walks them all, ~100 ms at 16,384 nodes) is ``VALVE_GROWTH`` times
  what it was after the last valve (at least ``VALVE_FLOOR`` blocks),
  everything is unfrozen and collected once, and what lives is frozen again
  (a pause of ~1 us per tracked object with the GIL held, said in the log:
  ~2 s at 16,384 nodes). An HA leader takes that pause only while its lease
  surely outlives it (:attr:`GcHold.may_pause`, estimated from the heap): its
  keep-alive thread cannot renew the lease meanwhile; otherwise the valve is
  put off to a later hold's end, and said. Frozen garbage is so bounded by what the
  server holds, not by time: a client that connects and closes in a loop
  makes none (measured: 1,000 such connections, 0 objects freed by a full
  collection; before ws_inline's queue let go of its socket, ~45 each).

Only the standalone server holds (``rdzv-server``: it owns its process); a
server embedded in another program leaves its collector alone.
"""

from __future__ import annotations

import gc
import logging
import sys
import time
from collections.abc import Callable

log = logging.getLogger("rdzv_server")

# A young collection once 200,000 more tracked objects live than at the last one: a steady
# server (heartbeats) then runs none at all, as what it allocates dies by reference counting
# first; at 50,000 it ran one every ~0.3 s at 16,384 nodes, each scanning whatever was in
# flight. Garbage cycles wait for up to that many objects (~30 MB) between holds (what a hold
# made is frozen: its cycles wait for the valve, below); the middle generation is scanned
# every 5 young collections, so it holds no more than at (50,000, 20): 1,000,000 objects.
GC_THRESHOLD = (200_000, 5, 100)  # young, middle, old (CPython's: 700 / 10 / 10)
HOLD_THRESHOLD0 = 1_000_000  # the young threshold while held: a 16,384-node formation makes ~600,000
FREEZE_AT = HOLD_THRESHOLD0 // 2  # while held, the tick freezes what waits past this (before CPython scans it)
QUIET_S = 0.5  # no join or fan-out for this long: the round change is over
MAX_HOLD_S = 5.0  # a hold ends this long after it began, however busy the server stays
VALVE_GROWTH = 2  # the valve: a full collection once the heap is this many times ...
# ... what it was after the last one, or this many allocated blocks if more: one job of 16,384
# nodes takes ~3,600,000 (~1,950,000 tracked objects, measured after its formation and round
# changes), so it never pays the valve's pause (~1 us a tracked object, the GIL held: ~2 s at
# 16,384 nodes, long enough to starve an HA leader's lease thread)
VALVE_FLOOR = 4_000_000
# The valve's pause, estimated from the heap before it runs: ~1 us a tracked object, and ~0.54
# tracked objects an allocated block (16,384 nodes: 1,950,000 of 3,600,000, a 2.2 s pause in py-spy)
PAUSE_PER_BLOCK_S = 0.6e-6
DEFERRED_LOG_EVERY_S = 600.0  # a valve put off (may_pause) is said at most this often


def tune_gc() -> None:
    """The garbage collector as the server runs it, once startup is done
    (bench/join_cost.py measures under it too). CPython's full collections
    stop the loop for a second or more at 10,000 held connections and free
    nothing: freeze what startup made and collect the old generations far
    less often; reference counting frees almost everything."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)


class GcHold:
    """Young collections held off while a round change runs, and what it made
    frozen (the module's doc)."""

    __slots__ = (
        *("on", "held", "since", "last", "holds", "freezes", "valve_base", "valves", "_clock"),
        *("may_pause", "deferred", "_said_at"),
    )

    def __init__(self, on: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        """``on``: hold at all (the store's is off until rdzv-server turns it on)."""
        self._clock = clock
        self.on = on
        self.held = False
        self.since = 0.0  # when the hold in force began
        self.last = 0.0  # the last busy()
        self.holds = 0  # holds begun (tests, and what a reader of a profile may ask)
        self.freezes = 0  # gc.freeze() calls made
        self.valve_base = 0  # allocated blocks after the last valve (0: before the first hold)
        self.valves = 0
        # whether the process may stop this many seconds now (an HA leader: only while its lease
        # surely outlives the pause, ha.Replica.may_pause); None: always
        self.may_pause: Callable[[float], bool] | None = None
        self.deferred = 0  # valves put off because the pause may not be taken now
        self._said_at: float | None = None

    def busy(self) -> None:
        """A join arrived, an agent's connection opened, or a round's messages went out:
        hold (or keep holding)."""
        if not self.on:
            return
        now = self.last = self._clock()
        if not self.held:
            self.held, self.since = True, now
            self.holds += 1
            if not self.valve_base:  # the first hold: the valve counts from here
                self.valve_base = sys.getallocatedblocks()
            gc.set_threshold(HOLD_THRESHOLD0, *GC_THRESHOLD[1:])

    def tick(self) -> None:
        """From the store's tick: end the hold once quiet, or once held long enough;
        while it holds, freeze what waits past FREEZE_AT."""
        if self.held:
            now = self._clock()
            if now - self.last >= QUIET_S or now - self.since >= MAX_HOLD_S:
                self.release()
                self._valve()
            elif gc.get_count()[0] >= FREEZE_AT:
                self._freeze()

    def release(self) -> None:
        """End the hold: what it made is frozen, and collections are as usual
        again. From :meth:`tick`, and at once when the store stops ticking (a
        replica stepping down, a store stopping)."""
        if self.held:
            self.held = False
            self._freeze()
            gc.set_threshold(*GC_THRESHOLD)

    def _freeze(self) -> None:
        gc.freeze()
        self.freezes += 1

    def _valve(self) -> None:
        """At the end of a hold: the full collection the module's doc calls the valve, when due."""
        blocks = sys.getallocatedblocks()
        if blocks < VALVE_GROWTH * max(self.valve_base, VALVE_FLOOR):
            return
        pause = blocks * PAUSE_PER_BLOCK_S
        if self.may_pause is not None and not self.may_pause(pause):
            self._defer(pause, blocks)
            return
        frozen = gc.get_freeze_count()
        began = time.perf_counter()
        gc.unfreeze()
        freed = gc.collect()
        gc.freeze()
        self.valve_base = sys.getallocatedblocks()
        self.valves += 1
        log.info(
            "garbage collector: a full collection of %d objects took %.0f ms and freed %d (what round "
            "changes made is frozen out of collections; this runs once the heap grew %gx since the last)",
            frozen,
            (time.perf_counter() - began) * 1000,
            freed,
            VALVE_GROWTH,
        )

    def _defer(self, pause: float, blocks: int) -> None:
        """The valve is due but its pause may not be taken now: tried again at the end of the
        next hold (a leader's lease is renewed every TTL/4); said at most every DEFERRED_LOG_EVERY_S."""
        self.deferred += 1
        now = self._clock()
        if self._said_at is not None and now - self._said_at < DEFERRED_LOG_EVERY_S:
            return
        self._said_at = now
        log.warning(
            "garbage collector: the full collection due (the heap grew %gx, %d blocks) is put off: "
            "its pause, ~%.1f s with every thread stopped, would outlast this leader's lease; what "
            "round changes froze is not freed meanwhile (a longer --etcd-lease-ttl lets it run)",
            VALVE_GROWTH,
            blocks,
            pause,
        )
