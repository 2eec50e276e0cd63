"""rdzv_server.rounds.pace, pure: the heartbeat interval a join is told (the
job's size and the server's load), each node's arrivals and when its silence
is worth a probe; and the silence path through rounds.suspicion (same table,
its own reason)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rdzv_common.protocol import JobSpec, JoinedMsg, JoinMsg, heartbeat_interval
from rdzv_server import rounds
from rdzv_server.rounds import pace
from rdzv_server.rounds import suspicion as sus
from rdzv_server.rounds.pace import FAST_HEARTBEAT_S, HEARTBEAT_BUDGET, SILENCE_MIN_S, Arrivals
from rdzv_server.rounds.records import to_record
from tests.helpers.jobs import running_job

SPEC = JobSpec(min_nodes=1, max_nodes=1)  # the defaults: a 6 s heartbeat timeout, heartbeats every 2 s at most


def test_small_jobs_are_told_fast_and_the_total_rate_is_bounded() -> None:
    assert heartbeat_interval(SPEC) == 2.0
    assert pace.heartbeat_s(SPEC, 1) == FAST_HEARTBEAT_S
    assert pace.heartbeat_s(SPEC, int(HEARTBEAT_BUDGET * FAST_HEARTBEAT_S)) == FAST_HEARTBEAT_S
    for nodes in (2_000, 4_000, 8_000):  # the budget decides: nodes / interval == budget
        assert nodes / pace.heartbeat_s(SPEC, nodes) == pytest.approx(HEARTBEAT_BUDGET)
    # never slower than the spec's own interval: from 10,000 nodes, the 2 s it always was
    assert pace.heartbeat_s(SPEC, 10_000) == pace.heartbeat_s(SPEC, 100_000) == 2.0
    # a short heartbeat timeout keeps its faster interval
    short = JobSpec(min_nodes=1, max_nodes=1, heartbeat_timeout_s=0.6)
    assert pace.heartbeat_s(short, 1) == heartbeat_interval(short) == pytest.approx(0.2)


def _beat(arr: Arrivals, start: float, every: float, n: int) -> float:
    t = start
    for _ in range(n):
        t += every
        arr.heard(t)
    return t


def test_a_steady_node_is_judged_silent_after_about_a_second() -> None:
    arr = Arrivals(0.25)
    assert arr.silent(100.0, 0.0, 6.0) is None  # never heard since told: not judged
    t = _beat(arr, 0.0, 0.25, 40)
    assert arr.limit() == pytest.approx(SILENCE_MIN_S)
    assert arr.silent(t + 0.9, 0.0, 6.0) is None
    assert arr.silent(t + 1.0, 0.0, 6.0) == pytest.approx(1.0)


def test_the_limit_follows_the_arrivals_seen() -> None:
    slow = Arrivals(0.25)  # told 0.25 s, but heartbeats every 1 s (an older agent, a slow link)
    t = _beat(slow, 0.0, 1.0, 40)
    assert slow.limit() == pytest.approx(3.0, abs=0.01)
    assert slow.silent(t + 2.0, 0.0, 6.0) is None
    jittery = Arrivals(0.25)
    t = 0.0
    for i in range(60):
        t += 0.25 if i % 2 else 0.6
        jittery.heard(t)
    assert jittery.limit() > 3 * jittery.mean  # type: ignore[operator]


def test_a_faster_interval_counts_from_the_next_heartbeat() -> None:
    arr = Arrivals(2.0)
    t = _beat(arr, 0.0, 2.0, 5)
    arr.tell(0.25)  # the agent's sleep in progress is still the 2 s one
    assert arr.silent(t + 1.5, 0.0, 30.0) is None
    t = _beat(arr, t, 2.0, 1)
    t = _beat(arr, t, 0.25, 60)  # the mean follows
    assert arr.limit() == pytest.approx(SILENCE_MIN_S)
    arr.tell(2.0)  # a slower one counts at once (the server grew meanwhile)
    assert arr.limit() >= 6.0
    assert arr.silent(t + 1.5, 0.0, 30.0) is None


def test_no_judgment_past_the_timeout_or_across_the_servers_own_lateness() -> None:
    arr = Arrivals(2.0)
    t = _beat(arr, 0.0, 2.0, 10)
    assert arr.silent(t + 5.9, 0.0, 6.0) is None  # its limit (6 s) is the timeout's: the timeout judges
    fast = Arrivals(0.25)
    t = _beat(fast, 0.0, 0.25, 10)
    # the server's loop was late at t + 0.8: silence before that is not the node's
    assert fast.silent(t + 1.5, t + 0.8, 6.0) is None
    assert fast.silent(t + 1.8, t + 0.8, 6.0) == pytest.approx(1.8)
    # and a gap that spans it is not learned from
    fast.heard(t + 3.0, learn=False)
    assert fast.limit() == pytest.approx(SILENCE_MIN_S)


def _running(n: int, heartbeat_s: float | None = None):
    job, effects = running_job(n, heartbeat_s=heartbeat_s)
    return job, [m.heartbeat_s for fx in effects for to, m in fx.messages() if isinstance(m, JoinedMsg)]


def test_joined_tells_the_interval_the_store_chose() -> None:
    assert _running(2)[1] == [heartbeat_interval(SPEC)] * 2  # none chosen: the spec's
    job, told = _running(2, 0.25)
    assert told == [0.25, 0.25]
    assert to_record(job).get("heartbeat_s") is None  # not saved


def test_a_silent_suspect_goes_through_the_same_table_and_is_evicted_with_its_own_reason() -> None:
    t = sus.Suspicions()
    assert t.open("j", "n1", None, 0, 10.0, silent_s=1.0)  # the server's own judgment
    assert not t.open("j", "n1", "n0", 0, 10.1)  # a peer's report joins it
    probe = t.close("j", "n1", answered=True, now=10.3)
    assert probe is not None and probe.reporters == {"n0"} and probe.silent_s == 1.0
    assert not t.open("j", "n1", None, 0, 10.5, silent_s=1.5)  # answered lately: held off, as for peers
    assert t.open("j", "n1", None, 0, 10.3 + sus.CLEARED_FOR_S, silent_s=3.0)
    job, _ = _running(3)
    fx = sus.confirmed(job, "n1", 0, 0, 0.3, 5.0, silent_s=1.0)
    assert fx.evicted == ["n1"] and fx.host_failures and fx.host_failures[0][0] == "h1"
    assert "silent for 1300 ms, no answer to probe in 300 ms" in job.history[-1].reason
    assert "suspected" not in job.history[-1].reason
    job, _ = _running(3)
    sus.confirmed(job, "n2", 0, 2, 0.3, 5.0, silent_s=1.0)
    assert "suspected by 2 peer(s), silent for 1300 ms, no answer to probe in 300 ms" in job.history[-1].reason


def test_an_unanswered_silence_is_a_lost_connection_with_its_own_reason() -> None:
    """No peer reported it: the disconnect grace still applies (the caller cuts
    the connection); the node is lost when it ends, saying why; a node back
    in time is kept and forgets it."""
    job, _ = _running(3)
    assert pace.unanswered(job, "n1", 7, 1.3, 0.3) is None  # a later round's verdict: nothing
    why = pace.unanswered(job, "n1", 0, 1.3, 0.3)
    assert why == "silent for 1300 ms, no answer to probe in 300 ms"
    rounds.disconnect(job, "n1", 1.0, 0.5)
    assert rounds.tick(job, 1.4).events == []  # within the grace
    fx = rounds.tick(job, 1.5)
    assert fx.evicted == ["n1"] and job.round == 1
    assert "node n1 (h1) silent for 1300 ms, no answer to probe in 300 ms" in job.history[-1].reason
    kept, _ = _running(3)
    pace.unanswered(kept, "n2", 0, 1.3, 0.3)
    rounds.disconnect(kept, "n2", 1.0, 0.5)
    back = JoinMsg(
        job_id="j", node_id="n2", host="h2", addr="10.0.0.3", local_world_size=1, master_port=29500,
        spec=kept.spec, resume_round=0,
    )  # fmt: skip
    rounds.join(kept, back, 1.2)
    assert kept.nodes["n2"].lost_why is None and rounds.tick(kept, 2.0).events == [] and kept.round == 0


@given(
    told=st.sampled_from([0.25, 0.5, 1.0, 2.0, 3.3]),
    steps=st.lists(
        st.one_of(st.floats(min_value=0.01, max_value=20.0), st.sampled_from(["tell 0.5", "tell 4.0", "rejoined"])),
        max_size=30,
    ),
    quiet=st.floats(min_value=0.0, max_value=60.0),
)
@settings(max_examples=300, deadline=None)
def test_a_node_heard_within_its_floor_is_never_judged_silent(told, steps, quiet) -> None:
    """The sweep skips a node before its ``quiet_at`` (its last heartbeat plus ``floor()``,
    kept as it is heard, told and rejoins) without working out its limit
    (rdzv_server.pacing): that must never skip one ``silent`` would judge."""
    arr = Arrivals(told)
    t = 100.0
    arr.heard(t)
    for step in steps:
        if step == "rejoined":
            arr.rejoined()
        elif isinstance(step, str):
            arr.tell(float(step.split()[1]))
        else:
            t += step
            arr.heard(t)
        assert arr.quiet_at == (math.inf if arr.last is None else arr.last + arr.floor())
    assert arr.floor() <= arr.limit()
    if t + quiet < arr.quiet_at:
        assert arr.silent(t + quiet, 0.0, timeout=3600.0) is None
