"""Per-client quotas (rdzv_server.quotas, issue 19): the waiting-jobs cap is no
lever for one client, host records keep room for an operator's cordon, token
buckets, and the per-address connection limit's arithmetic. A real Store with
a fake clock; channels are recorders that carry a client address."""

from __future__ import annotations

from typing import Any

import pytest

from rdzv_common.protocol import SERVER_MESSAGE, JobSpec, JobState, JoinMsg, UnavailableError
from rdzv_server import rounds
from rdzv_server.conns import DEFAULT_MAX_CONNECTIONS_PER_ADDRESS, per_address_limit
from rdzv_server.hosts import HostRules, Hosts
from rdzv_server.quotas import AddressBuckets, TokenBucket
from rdzv_server.store import Store, StoreSettings

WEEK = 7 * 24 * 3600.0


class Chan:
    """A connection from ``peer``: records what it is sent."""

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.msgs: list[Any] = []
        self.dropped = False

    def deliver(self, text: str) -> None:
        self.msgs.append(SERVER_MESSAGE.validate_json(text))

    def drop(self) -> None:
        self.dropped = True


def join(job_id: str, node_id: str, nnodes: int = 1) -> JoinMsg:
    spec = JobSpec(min_nodes=nnodes, max_nodes=nnodes, join_timeout_s=WEEK, heartbeat_timeout_s=WEEK)
    return JoinMsg(
        job_id=job_id,
        node_id=node_id,
        host=node_id,
        addr="10.0.0.1",
        local_world_size=1,
        master_port=29500,
        spec=spec,
    )


def make_store(**kw: Any) -> tuple[list[float], Store]:
    clock = [1000.0]
    return clock, Store(StoreSettings(**kw), clock=lambda: clock[0])


def test_jobs_every_node_left_do_not_keep_a_new_job_out():
    """The issue's probe: join 1:1 with a 7-day join timeout, leave, repeat until the cap
    is full. A new job from anyone is then created: the newest unheld job is closed for it."""
    _, store = make_store(max_waiting_jobs=5)
    for i in range(5):
        chan = Chan("10.66.66.66")
        store.join(join(f"junk{i}", "x"), chan)
        store.leave(f"junk{i}", "x", "bye", chan)
        assert store.jobs[f"junk{i}"].forming and not store.jobs[f"junk{i}"].nodes
    assert len(store.waiting) == 5

    team = Chan("10.0.0.7")
    store.join(join("team", "n0", nnodes=2), team)  # refused (unavailable) before the fix
    assert "team" in store.jobs and store.jobs["team"].forming
    closed = [j for j in store.jobs if store.jobs[j].state == JobState.CLOSED]
    assert closed == ["junk4"], closed  # the newest unheld one
    assert "make room" in (store.jobs["junk4"].end_reason or "")
    assert len(store.waiting) == 5


def test_jobs_whose_nodes_only_dropped_are_reclaimed_too():
    _, store = make_store(max_waiting_jobs=2)
    for i in range(2):
        chan = Chan("10.66.66.66")
        store.join(join(f"junk{i}", "x", nnodes=2), chan)
        store.disconnected(f"junk{i}", "x", chan)  # still a node of the job, not connected
    store.join(join("team", "n0", nnodes=2), Chan("10.0.0.7"))
    assert "team" in store.jobs


def test_a_job_whose_connection_blinked_is_reclaimed_after_the_jobs_nobody_is_in():
    """The cap is full of jobs every node left; a team's job is created (one of them closed), its
    node's connection drops (within the disconnect grace): the next new job takes an empty one."""
    clock, store = make_store(max_waiting_jobs=3)
    for i in range(3):
        chan = Chan("10.66.66.66")
        store.join(join(f"junk{i}", "x"), chan)
        store.leave(f"junk{i}", "x", "bye", chan)
    clock[0] += 1
    team = Chan("10.0.0.7")
    store.join(join("team", "n0", nnodes=2), team)
    store.disconnected("team", "n0", team)  # newest and unheld, but its node may come back
    clock[0] += 0.1
    store.join(join("junk9", "x", nnodes=2), Chan("10.66.66.66"))
    assert not store.jobs["team"].finished
    assert sorted(j for j, job in store.jobs.items() if job.finished) == ["junk1", "junk2"]


def test_one_address_holds_at_most_its_quota_of_waiting_jobs_and_others_still_get_in():
    _, store = make_store(max_waiting_jobs=10, waiting_jobs_per_address=3)
    for i in range(3):
        store.join(join(f"mine{i}", "x", nnodes=2), Chan("10.66.66.66"))  # held: its node stays connected
    refused = Chan("10.66.66.66")
    with pytest.raises(UnavailableError, match="max-waiting-jobs-per-address 3"):
        store.join(join("mine3", "x", nnodes=2), refused)
    assert "mine3" not in store.jobs and refused.dropped
    assert refused.msgs[-1].code.value == "unavailable"
    store.join(join("team", "n0", nnodes=2), Chan("10.0.0.7"))  # another address: room
    assert "team" in store.jobs


def test_a_cap_full_of_held_jobs_still_refuses():
    """Connected nodes of many addresses hold every slot: a new job waits (as before)."""
    _, store = make_store(max_waiting_jobs=3, waiting_jobs_per_address=1)
    for i in range(3):
        store.join(join(f"j{i}", "x", nnodes=2), Chan(f"10.0.0.{i}"))
    with pytest.raises(UnavailableError, match="held by a connected node"):
        store.join(join("late", "x", nnodes=2), Chan("10.0.0.99"))
    assert all(not store.jobs[f"j{i}"].finished for i in range(3))


def test_reclaim_is_pure_and_spares_held_and_running_jobs():
    running = rounds.new_job("r", join("r", "a").spec, 0.0)
    rounds.join(running, join("r", "a"), 0.0, node_secret="s")  # 1:1: the round completes
    rounds.disconnect(running, "a", 0.5, 0.5)
    assert not running.forming and not rounds.held(running)
    assert not rounds.reclaim(running, 1.0, "room").persist and not running.finished
    held = rounds.new_job("h", join("h", "a", nnodes=2).spec, 0.0)
    rounds.join(held, join("h", "a", nnodes=2), 0.0, node_secret="s")
    assert held.forming and rounds.held(held)
    assert not rounds.reclaim(held, 1.0, "room").persist and not held.finished
    empty = rounds.new_job("e", join("e", "a", nnodes=2).spec, 0.0)
    fx = rounds.reclaim(empty, 1.0, "room")
    assert empty.state == JobState.CLOSED and fx.persist and empty.end_reason == "room"


def test_a_cordon_finds_room_in_a_table_full_of_cool_downs():
    hosts = Hosts(HostRules(max_hosts=3, failures=1))
    for i in range(3):
        rec, cooled, _ = hosts.record_failure(f"fake{i}", "-", "health check failed", 0.0)
        assert rec is not None and cooled
    assert hosts.record_failure("fake9", "-", "x", 1.0)[0] is None  # a report still finds no room
    rec, evicted = hosts.cordon("real", "bad GPU", None, False, 1.0)  # refused (None) before the fix
    assert rec is not None and rec.cordon_active(1.0) and evicted == ["fake0"]
    for i in range(2):
        assert hosts.cordon(f"real{i}", "r", None, False, 1.0)[0] is not None
    assert hosts.cordon("one-too-many", "r", None, False, 1.0)[0] is None  # every record a cordon: refused


def test_token_buckets():
    b = TokenBucket(3, 1.0, now=0.0)
    assert [b.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert b.take(1.0) and not b.take(1.0)
    assert b.wait_s() == pytest.approx(1.0)
    t = AddressBuckets(2, 0.5, max_addrs=2)
    assert t.take("a", 0.0) and t.take("a", 0.0) and not t.take("a", 0.0)
    assert t.retry_after("a") == "2"
    assert t.take("b", 0.0) and t.take("c", 0.0)  # "a" is forgotten: the table stays at 2 addresses
    assert len(t.buckets) == 2 and "a" not in t.buckets


def test_per_address_connection_limit():
    assert per_address_limit(None, 32768) == DEFAULT_MAX_CONNECTIONS_PER_ADDRESS
    assert per_address_limit(None, 300) == 150  # half stays for the others
    assert per_address_limit(5000, 300) == 150
    assert per_address_limit(0, 300) == 300  # 0: no limit of its own (the benchmarks)
    assert per_address_limit(10, 300) == 10
    assert per_address_limit(None, 1) == 1


def test_the_quota_flags_reach_the_settings():
    from rdzv_server.flags import build_parser, settings_from_args

    args = build_parser().parse_args(["--data-dir", "none"])
    s = settings_from_args(args)
    assert (s.waiting_jobs_per_address, s.idle_timeout_s, s.body_timeout_s) == (100, 60.0, 10.0)
    assert s.store_settings.waiting_jobs_per_address == 100
    assert args.max_connections_per_address == DEFAULT_MAX_CONNECTIONS_PER_ADDRESS
    flags = ["--max-waiting-jobs-per-address", "0", "--idle-timeout", "30", "--body-timeout", "2"]
    s = settings_from_args(build_parser().parse_args(["--data-dir", "none", *flags]))
    assert (s.store_settings.waiting_jobs_per_address, s.idle_timeout_s, s.body_timeout_s) == (0, 30.0, 2.0)
    for bad in (["--idle-timeout", "9"], ["--body-timeout", "-1"], ["--max-waiting-jobs-per-address", "-1"]):
        with pytest.raises(SystemExit):
            settings_from_args(build_parser().parse_args(["--data-dir", "none", *bad]))


def test_no_waiting_quota_of_its_own_with_zero():
    _, store = make_store(max_waiting_jobs=10, waiting_jobs_per_address=0)
    for i in range(5):
        store.join(join(f"j{i}", "x", nnodes=2), Chan("10.66.66.66"))
    assert len(store.waiting) == 5
