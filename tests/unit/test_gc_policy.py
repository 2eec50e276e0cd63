"""The server's garbage collector (rdzv_server.gc_policy): its thresholds, and
young collections held off while a round change runs. Every test puts the
process's collector back as it found it."""

from __future__ import annotations

import gc
import sys
import weakref
from collections.abc import Iterator

import pytest

from rdzv_common.protocol import JobSpec, StatusMsg, WaitingInfo
from rdzv_server.gc_policy import (
    FREEZE_AT,
    GC_THRESHOLD,
    HOLD_THRESHOLD0,
    MAX_HOLD_S,
    QUIET_S,
    GcHold,
    tune_gc,
)
from rdzv_server.rounds import Effects
from tests.unit.test_store_ticks import Recorder, join, make_store, plain_tick


@pytest.fixture(autouse=True)
def collector_restored() -> Iterator[None]:
    was, frozen = gc.get_threshold(), gc.get_freeze_count()
    try:
        yield
    finally:
        gc.set_threshold(*was)
        if gc.get_freeze_count() > frozen:  # what a test's hold froze (this process is pytest's)
            gc.unfreeze()


def test_tune_gc_freezes_startup_and_collects_old_generations_rarely() -> None:
    try:
        tune_gc()
        assert gc.get_threshold() == GC_THRESHOLD == (200_000, 5, 100)
        assert gc.get_freeze_count() > 0  # what startup made is out of every collection
    finally:
        gc.unfreeze()


def test_a_hold_is_off_until_turned_on() -> None:
    gc.set_threshold(*GC_THRESHOLD)
    hold = GcHold(clock=lambda: 5.0)
    hold.busy()
    assert not hold.held and hold.holds == 0
    assert gc.get_threshold() == GC_THRESHOLD


def test_a_hold_ends_once_quiet() -> None:
    gc.set_threshold(*GC_THRESHOLD)
    now = [100.0]
    hold = GcHold(on=True, clock=lambda: now[0])
    hold.busy()
    assert hold.held and gc.get_threshold() == (HOLD_THRESHOLD0, *GC_THRESHOLD[1:])
    now[0] += QUIET_S / 2
    hold.busy()  # still busy: the quiet counts from the last one
    now[0] += QUIET_S * 0.9
    hold.tick()
    assert hold.held and gc.get_threshold()[0] == HOLD_THRESHOLD0
    now[0] += QUIET_S * 0.2
    hold.tick()
    assert not hold.held and gc.get_threshold() == GC_THRESHOLD
    hold.busy()  # the next round change holds again
    assert hold.held and hold.holds == 2


def test_a_hold_ends_after_max_hold_however_busy() -> None:
    """A client that keeps joining cannot keep the collector off: the hold ends
    MAX_HOLD_S after it began, and the next one begins only at the next busy()."""
    gc.set_threshold(*GC_THRESHOLD)
    now = [0.0]
    hold = GcHold(on=True, clock=lambda: now[0])
    released_at = None
    while now[0] < 2 * MAX_HOLD_S and released_at is None:
        hold.busy()
        now[0] += QUIET_S / 4
        hold.tick()
        if not hold.held:
            released_at = now[0]
    assert released_at is not None and MAX_HOLD_S <= released_at < MAX_HOLD_S + QUIET_S
    assert gc.get_threshold() == GC_THRESHOLD
    hold.busy()
    assert hold.held and hold.since == now[0]


def test_release_when_turned_off() -> None:
    gc.set_threshold(*GC_THRESHOLD)
    hold = GcHold(on=True, clock=lambda: 1.0)
    hold.busy()
    hold.on = False
    hold.release()
    assert not hold.held and gc.get_threshold() == GC_THRESHOLD
    hold.busy()
    assert not hold.held


def test_the_store_holds_while_joins_arrive_and_its_tick_releases() -> None:
    """The store's side: a join holds (it is what a join storm, a round change's
    rejoins and a failover's resumes are made of), so does a fan-out (a message
    to more than one node), and the tick releases once quiet. Off (a store
    embedded in another program): nothing is touched."""
    gc.set_threshold(*GC_THRESHOLD)
    store = make_store([1000.0])
    spec = JobSpec(min_nodes=3, max_nodes=3)
    store.join(join("j", "a", spec), Recorder())
    assert not store.gc_hold.held and gc.get_threshold() == GC_THRESHOLD
    mono = [50.0]
    store.gc_hold = GcHold(on=True, clock=lambda: mono[0])
    store.join(join("j", "b", spec), Recorder())  # told `joined`, nobody else anything
    assert store.gc_hold.held and gc.get_threshold()[0] == HOLD_THRESHOLD0
    mono[0] += QUIET_S / 2
    plain_tick(store)
    assert store.gc_hold.held
    mono[0] += QUIET_S
    plain_tick(store)
    assert not store.gc_hold.held and gc.get_threshold() == GC_THRESHOLD
    fx = Effects()
    for node_id in ("a", "b"):
        fx.send(node_id, StatusMsg(round=0, waiting_for=WaitingInfo(text="2 of 3", joined=2, min_nodes=3, max_nodes=3)))
    store._apply(store.jobs["j"], fx, 1000.0)
    assert store.gc_hold.held and store.gc_hold.holds == 2


def test_a_replica_that_steps_down_puts_the_collector_back() -> None:
    """A follower does not tick: stepping down (and stopping) ends a hold at once."""
    gc.set_threshold(*GC_THRESHOLD)
    store = make_store([1000.0])
    store.gc_hold = GcHold(on=True, clock=lambda: 1.0)
    store.join(join("j", "a", JobSpec(min_nodes=2, max_nodes=2)), Recorder())
    assert store.gc_hold.held
    store.step_down("lost the lease", quiet=True)
    assert not store.gc_hold.held and gc.get_threshold() == GC_THRESHOLD


class _Cycle:
    """Garbage only the collector frees (it refers to itself)."""

    def __init__(self) -> None:
        self.me = self


def test_what_a_hold_made_is_frozen_when_it_ends_not_scanned() -> None:
    gc.set_threshold(*GC_THRESHOLD)
    now = [10.0]
    hold = GcHold(on=True, clock=lambda: now[0])
    hold.busy()
    made = [[i] for i in range(1000)]  # what a round change keeps: its nodes' assignments
    frozen = gc.get_freeze_count()
    now[0] += QUIET_S
    hold.tick()
    assert not hold.held and hold.freezes == 1
    assert gc.get_freeze_count() >= frozen + len(made)  # out of every later collection
    assert gc.get_count()[0] < 100  # the young generation is left (nearly) empty: nothing to scan
    assert gc.get_threshold() == GC_THRESHOLD


def test_a_long_hold_freezes_what_waits_past_freeze_at_before_cpython_scans_it() -> None:
    gc.set_threshold(*GC_THRESHOLD)
    now = [10.0]
    hold = GcHold(on=True, clock=lambda: now[0])
    hold.busy()
    made = [[i] for i in range(FREEZE_AT + 10_000)]  # a reconnect storm's connections, so far
    assert gc.get_count()[0] >= FREEZE_AT
    now[0] += QUIET_S / 4
    hold.busy()
    hold.tick()
    assert hold.held and hold.freezes == 1  # still holding, what it made so far frozen
    assert gc.get_count()[0] < FREEZE_AT
    del made


def test_the_valve_collects_frozen_garbage_once_the_heap_grew_and_not_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # this test's heap is pytest's, not a server's: a floor of nothing, a growth of 1.5
    monkeypatch.setattr("rdzv_server.gc_policy.VALVE_FLOOR", 1)
    monkeypatch.setattr("rdzv_server.gc_policy.VALVE_GROWTH", 1.5)
    gc.set_threshold(*GC_THRESHOLD)
    gc.freeze()  # as tune_gc at startup: the heap so far
    now = [1000.0]
    hold = GcHold(on=True, clock=lambda: now[0])
    hold.busy()  # the first hold: the valve counts from the heap now
    base = hold.valve_base
    assert abs(base - sys.getallocatedblocks()) < base // 100
    garbage = _Cycle()
    probe = weakref.ref(garbage)
    del garbage  # a cycle: only a collection frees it, and the hold's freeze puts it out of reach
    some = [[i + 1000] for i in range(base // 16)]  # ~2 blocks each: grown, not yet 1.5-fold
    now[0] += QUIET_S
    hold.tick()
    assert hold.valves == 0 and probe() is not None  # frozen with the rest
    hold.busy()
    grown = [[i + 1000] for i in range(base // 4)]  # now it is
    now[0] += QUIET_S
    hold.tick()
    assert hold.valves == 1 and probe() is None  # unfrozen, collected, the living frozen again
    assert gc.get_freeze_count() >= len(grown) + len(some)
    assert hold.valve_base >= base + 2 * (len(grown) + len(some)) * 9 // 10  # counts from the heap after it
    hold.busy()  # nothing grew since: no second valve, however often holds end
    now[0] += QUIET_S
    hold.tick()
    assert hold.valves == 1


def test_the_valve_waits_while_its_pause_may_not_be_taken_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An HA leader's lease must outlive the valve's pause (its keep-alive thread
    cannot run meanwhile): put off, said once, and run at a later hold's end."""
    monkeypatch.setattr("rdzv_server.gc_policy.VALVE_FLOOR", 1)
    monkeypatch.setattr("rdzv_server.gc_policy.VALVE_GROWTH", 1.5)
    gc.set_threshold(*GC_THRESHOLD)
    gc.freeze()
    now = [1000.0]
    asked: list[float] = []
    allow = [False]

    def may_pause(seconds: float) -> bool:
        asked.append(seconds)
        return allow[0]

    hold = GcHold(on=True, clock=lambda: now[0])
    hold.may_pause = may_pause
    hold.busy()
    garbage = _Cycle()
    probe = weakref.ref(garbage)
    del garbage
    grown = [[i + 1000] for i in range(hold.valve_base // 3)]  # the heap grew past 1.5-fold
    for _ in range(3):
        now[0] += QUIET_S
        with caplog.at_level("WARNING", logger="rdzv_server"):
            hold.tick()
        hold.busy()
    assert hold.valves == 0 and hold.deferred == 3 and probe() is not None
    said = [r for r in caplog.records if "put off" in r.getMessage()]
    assert len(said) == 1 and "--etcd-lease-ttl" in said[0].getMessage()
    blocks = sys.getallocatedblocks()
    assert 0.3e-6 * blocks < asked[-1] < 1.2e-6 * blocks  # the pause, estimated from the heap
    allow[0] = True
    now[0] += QUIET_S
    hold.tick()
    assert hold.valves == 1 and probe() is None
    del grown
