"""The store's clock work, driven with a fake clock and no server: stalls of
the loop and what the tick visits. (Channels are recorders: this is a unit.)"""

from __future__ import annotations

import asyncio
import json
import time

from rdzv_common.protocol import SERVER_MESSAGE, JobSpec, JobState, JoinMsg
from rdzv_server import rounds, store_ticks
from rdzv_server import store as store_mod
from rdzv_server.store import STALL_S, Store, StoreSettings


class Recorder:
    """A channel that keeps what it was sent."""

    def __init__(self) -> None:
        self.ops: list[str] = []
        self.dropped = False

    def deliver(self, text: str) -> None:
        self.ops.append(SERVER_MESSAGE.validate_json(text).op)

    def drop(self) -> None:
        self.dropped = True


def join(job_id: str, node_id: str, spec: JobSpec) -> JoinMsg:
    return JoinMsg(
        job_id=job_id, node_id=node_id, host=node_id, addr="10.0.0.1", local_world_size=1, master_port=29500, spec=spec
    )


def make_store(clock: list[float]) -> Store:
    return Store(StoreSettings(), clock=lambda: clock[0])


def two_node_job(heartbeat_timeout_s: float, a: str = "a", b: str = "b"):
    """A store on a fake clock with job ``j`` (2:2) formed by nodes ``a`` and
    ``b``: (clock, store, spec, a's channel, b's channel)."""
    clock = [1000.0]
    store = make_store(clock)
    spec = JobSpec(min_nodes=2, max_nodes=2, heartbeat_timeout_s=heartbeat_timeout_s)
    chan_a, chan_b = Recorder(), Recorder()
    store.join(join("j", a, spec), chan_a)
    store.join(join("j", b, spec), chan_b)
    return clock, store, spec, chan_a, chan_b


def stalled_tick(store: Store) -> None:
    """A tick that comes after the loop did not run for longer than STALL_S."""
    store.ticks.last = time.monotonic() - 2 * STALL_S
    store.tick()


def plain_tick(store: Store) -> None:
    store.ticks.last = time.monotonic()
    store.tick()


def test_repeated_stalls_still_evict_a_silent_node():
    """Every tick comes after a stall (a client looping on a slow endpoint): the
    node that heartbeats stays, the silent one is still evicted within two
    heartbeat timeouts instead of being given a fresh timeout at every stall."""
    clock, store, spec, live, silent = two_node_job(3.0, "live", "silent")
    job = store.jobs["j"]
    assert job.state == JobState.RUNNING
    start = clock[0]
    for _ in range(60):  # 30 s of fake time, a stall every 0.5 s
        clock[0] += 0.5
        store.heartbeat("j", "live")
        stalled_tick(store)
        if "silent" not in job.nodes:
            break
    assert "silent" not in job.nodes, "a node silent for 30 s was never evicted: every stall renewed its timeout"
    assert clock[0] - start <= 2 * spec.heartbeat_timeout_s + 0.5
    assert silent.ops[-1] == "evicted" and silent.dropped
    assert "evicted" not in live.ops and "live" in job.nodes


def test_one_stall_still_gives_every_node_a_full_timeout():
    """A single long stall (SIGSTOP) is not the nodes' fault: nobody is evicted
    by the tick that follows it, even a node last heard of long ago."""
    clock, store, spec, a, b = two_node_job(3.0)
    clock[0] += 20.0
    stalled_tick(store)
    assert set(store.jobs["j"].nodes) == {"a", "b"}
    clock[0] += 2.0
    store.heartbeat("j", "a")
    store.heartbeat("j", "b")
    plain_tick(store)
    assert set(store.jobs["j"].nodes) == {"a", "b"} and "evicted" not in a.ops + b.ops


def test_tick_does_not_visit_idle_jobs(monkeypatch):
    """With many running jobs whose nodes are fine, a tick looks at none of
    them; once their heartbeat deadlines pass, each is visited (and its silent
    node evicted)."""
    clock = [1000.0]
    store = make_store(clock)
    spec = JobSpec(min_nodes=1, max_nodes=1, heartbeat_timeout_s=6.0)
    chans = []
    for i in range(300):
        chans.append(Recorder())
        store.join(join(f"j{i}", "n", spec), chans[-1])
    assert all(j.state == JobState.RUNNING for j in store.jobs.values())
    visited: list[str] = []
    real_tick = store_mod.rounds.tick

    def counting_tick(job, now):
        visited.append(job.job_id)
        return real_tick(job, now)

    monkeypatch.setattr(store_mod.rounds, "tick", counting_tick)
    for _ in range(20):  # 2 s of ticks, every node heard from
        clock[0] += 0.1
        for i in range(300):
            store.heartbeat(f"j{i}", "n")
        plain_tick(store)
    assert visited == [], f"{len(visited)} visits of idle jobs in 20 ticks"
    clock[0] += 6.5  # nobody heard from for longer than the timeout
    plain_tick(store)
    assert len(set(visited)) == 300
    assert all(c.ops[-1] == "evicted" for c in chans)
    assert all(j.state == JobState.WAITING and not j.nodes for j in store.jobs.values())


def test_a_dropped_connection_is_lost_after_the_disconnect_grace_not_the_heartbeat_timeout():
    """The tick queue learns of the earlier deadline a dropped connection sets."""
    clock, store, spec, a, b = two_node_job(6.0)
    plain_tick(store)
    store.disconnected("j", "b", b)
    clock[0] += 0.3
    plain_tick(store)
    assert "b" in store.jobs["j"].nodes
    clock[0] += 0.3  # past the 0.5 s disconnect grace, far from the 6 s heartbeat timeout
    plain_tick(store)
    assert "b" not in store.jobs["j"].nodes and a.ops[-1] == "restart"


def test_refused_new_jobs_are_logged_once_per_interval(caplog):
    """Agents of a refused job retry: the server logs one line per interval, not one per retry,
    and the refused joins create nothing."""
    import logging

    import pytest

    from rdzv_common.protocol import UnavailableError

    clock = [1000.0]
    store = Store(StoreSettings(max_waiting_jobs=1), clock=lambda: clock[0])
    store.join(join("first", "a", JobSpec(min_nodes=2, max_nodes=2)), Recorder())
    caplog.set_level(logging.WARNING, logger="rdzv_server.store")
    for i in range(50):
        chan = Recorder()
        with pytest.raises(UnavailableError):
            store.join(join(f"new{i}", "a", JobSpec(min_nodes=1, max_nodes=1)), chan)
        assert chan.ops == ["error"] and chan.dropped
    assert set(store.jobs) == {"first"}
    lines = [r.getMessage() for r in caplog.records if "refused a new job" in r.getMessage()]
    assert len(lines) == 1 and "--max-waiting-jobs 1" in lines[0], lines


def test_a_cordon_ttl_that_runs_out_admits_the_held_node_on_the_next_tick():
    """Host blocks end by time too: the tick notices a cordon's ttl (or a
    cool-down) ending and admits the spare it held (a forming round here)."""
    clock = [1000.0]
    store = make_store(clock)
    spec = JobSpec(min_nodes=2, max_nodes=2, heartbeat_timeout_s=60.0)
    store.host_side.cordon("b", "reboot", 30.0, False)
    a, b = Recorder(), Recorder()
    store.join(join("j", "a", spec), a)
    store.join(join("j", "b", spec), b)
    assert b.ops == ["joined", "spare"] and store.jobs["j"].forming
    clock[0] += 29.0
    plain_tick(store)
    assert store.jobs["j"].forming
    clock[0] += 1.5
    plain_tick(store)
    job = store.jobs["j"]
    assert job.state == JobState.RUNNING and sorted(job.order) == ["a", "b"]
    assert "assigned" in a.ops and "assigned" in b.ops


class Keeper(Recorder):
    """A recorder that also keeps the node secret its ``joined`` issued."""

    secret: str | None = None

    def deliver(self, text: str) -> None:
        msg = SERVER_MESSAGE.validate_json(text)
        self.ops.append(msg.op)
        if msg.op == "joined" and getattr(msg, "node_secret", None):
            self.secret = msg.node_secret


def test_after_a_failover_grace_a_node_back_and_silent_is_judged_by_its_heartbeat():
    """A new HA leader loads the job with a longer grace (heartbeat timeout 6 s
    + 5 s, to 1011). Node a is back at 1001 and then silent: it is lost at 1007,
    a heartbeat timeout after its rejoin; the tick queued at the grace's end
    (1011) must not be the first to look at it."""
    clock = [1000.0]
    first = make_store(clock)
    spec = JobSpec(min_nodes=2, max_nodes=2, heartbeat_timeout_s=6.0)
    chan_a, chan_b = Keeper(), Keeper()
    first.join(join("j", "a", spec), chan_a)
    first.join(join("j", "b", spec), chan_b)
    record = rounds.to_record(first.jobs["j"])

    store = make_store(clock)  # the new leader
    store._loaded({"j": rounds.from_record(record)}, [], "etcd (test)", extra_s=5.0)
    clock[0] = 1001.0
    back = join("j", "a", spec).model_copy(update={"resume_round": 0, "node_secret": chan_a.secret})
    store.join(back, Keeper())
    job = store.jobs["j"]
    assert job.nodes["a"].connected
    clock[0] = 1007.5
    plain_tick(store)
    assert "a" not in job.nodes, "a node silent for 6.5 s after its rejoin was kept until the failover grace's end"


def test_a_member_back_after_restart_is_told_no_joined_but_a_pace_when_its_interval_moved():
    """A previous member's rejoin after `restart` that names the run gets no `joined`
    (the round's `assigned` is what it hears next); if the interval it was told is
    over REPACE_GROWTH away from the one a join is told now, it gets a `pace` with it."""
    from rdzv_server.pacing import REPACE_GROWTH

    clock = [1000.0]
    store = make_store(clock)
    spec = JobSpec(min_nodes=2, max_nodes=3, heartbeat_timeout_s=30.0)
    chans = {n: Recorder() for n in "abc"}
    secrets: dict[str, str] = {}
    for n in "abc":
        chans[n].deliver = lambda text, r=chans[n], n=n: (  # type: ignore[method-assign]
            r.ops.append(op := SERVER_MESSAGE.validate_json(text).op),
            op == "joined" and secrets.setdefault(n, json.loads(text)["node_secret"]),
        )
        store.join(join("j", n, spec), chans[n])
    job = store.jobs["j"]
    assert not job.forming and all(c.ops == ["joined", "assigned"] for c in chans.values())
    store.pacing.arrivals[("j", "b")].tell(job.heartbeat_s * REPACE_GROWTH * 2)  # b was told a slower one
    store.leave("j", "c", "sigterm", chans["c"])
    assert chans["a"].ops[-1] == chans["b"].ops[-1] == "restart" and job.forming
    for n in "ab":
        store.join(join("j", n, spec).model_copy(update={"run": job.run, "node_secret": secrets[n]}), chans[n])
    assert chans["a"].ops[2:] == ["restart", "assigned"]  # no joined
    assert chans["b"].ops[2:] == ["restart", "pace", "assigned"]
    assert store.pacing.arrivals[("j", "b")].next == job.heartbeat_s
    # a server that never told them (restarted, or leading since a failover): the next round
    # change's rejoin is paced and tracked, as a joined did
    store.pacing.arrivals.clear()
    store.leave("j", "b", "sigterm", chans["b"])
    store.join(join("j", "a", spec).model_copy(update={"run": job.run, "node_secret": secrets["a"]}), chans["a"])
    assert chans["a"].ops[4:] == ["restart", "pace"] and ("j", "a") in store.pacing.arrivals


def test_the_next_tick_comes_at_a_deadline_that_is_due_before_it():
    """Due.wait_s: the full tick's wait, or a queued deadline's when it comes first (a bit past
    it, never under DUE_MIN_S); a deadline later than the full tick changes nothing, and one
    already past is the full tick's (a job whose deadline stays past never makes ticks faster)."""
    from rdzv_server.due import DUE_MIN_S, DUE_SLACK_S, Due

    clock, store, spec, a, b = two_node_job(6.0)
    due: Due = store.due
    plain_tick(store)  # (what the joins queued: the job's next deadline is its heartbeat timeout)
    assert due.wait_s(0.1, clock[0]) == 0.1
    store.disconnected("j", "b", b)  # its grace ends 0.5 s from now
    assert due.wait_s(1.0, clock[0]) == 0.5 + DUE_SLACK_S
    assert due.wait_s(0.1, clock[0]) == 0.1
    assert due.wait_s(1.0, clock[0] + 0.4995) == DUE_MIN_S  # due in 0.5 ms: not under DUE_MIN_S
    assert due.wait_s(1.0, clock[0] + 0.6) == 1.0  # past: the full tick's
    assert due.wait_s(-0.2, clock[0]) == 0.0  # a full tick already late


async def test_a_lost_nodes_grace_ends_with_a_tick_of_its_own(monkeypatch):
    """The store's tick loop, real time: with full ticks 60 s apart, the lost node's 0.3 s
    grace, queued while the loop sleeps, still ends within seconds (the sleep is cut short, a
    tick for its deadline), and those ticks are not full ones (hosts, silences and retention
    keep their own pace)."""
    monkeypatch.setattr(store_ticks, "TICK_S", 60.0)
    store = Store(StoreSettings(disconnect_grace_s=0.3))
    spec = JobSpec(min_nodes=2, max_nodes=2, heartbeat_timeout_s=60.0)
    a, b = Recorder(), Recorder()
    store.join(join("j", "a", spec), a)
    store.join(join("j", "b", spec), b)
    store.tick()  # (what the joins queued: the job's next deadline is its heartbeat timeout)
    ticks: list[bool] = []
    plain = store.ticks.tick
    monkeypatch.setattr(store.ticks, "tick", lambda full=True: (ticks.append(full), plain(full)))
    await store.start()
    try:
        await asyncio.sleep(0.05)  # the tick loop asleep for its next full tick, 60 s away
        store.disconnected("j", "b", b)  # a deadline queued meanwhile wakes it
        for _ in range(100):
            if "b" not in store.jobs["j"].nodes:
                break
            await asyncio.sleep(0.05)
        assert "b" not in store.jobs["j"].nodes and a.ops[-1] == "restart", a.ops
        assert ticks and not any(ticks), ticks
    finally:
        await store.stop()
