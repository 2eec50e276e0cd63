"""Progress on heartbeats and the straggler flag (rounds, pure: explicit clock)."""

from __future__ import annotations

from test_rounds import form

from rdzv_server import rounds
from rdzv_server.rounds.progress import STRAGGLER_WINDOW_S
from rdzv_server.rounds.views import view


def _beat(job: rounds.Job, rates: dict[str, float], now: float) -> list[str]:
    lines: list[str] = []
    for nid, rate in rates.items():
        lines += rounds.heartbeat(job, nid, now, step=int(now * rate), rate=rate)
    return lines


def test_a_node_slow_for_the_window_is_flagged_then_unflagged() -> None:
    job = form(["a", "b", "c"])
    rates = {"a": 10.0, "b": 10.0, "c": 2.0}
    t, lines = 10.0, []
    while t < 10.0 + STRAGGLER_WINDOW_S - 1:
        lines += _beat(job, rates, t)
        t += 2.0
    assert lines == [] and not job.nodes["c"].straggler  # slow, but not for the whole window yet
    while t <= 10.0 + STRAGGLER_WINDOW_S + 4:
        lines += _beat(job, rates, t)
        t += 2.0
    assert job.nodes["c"].straggler and not job.nodes["a"].straggler
    assert len(lines) == 1 and "node c (c) is a straggler: 2 steps/s" in lines[0] and "median 10" in lines[0]
    nodes = {n.node_id: n for n in view(job, t).nodes}
    assert nodes["c"].straggler and nodes["c"].steps_per_s == 2.0 and not nodes["b"].straggler
    # it catches up: unflagged at the next check (at most every STRAGGLER_CHECK_S per job), said once
    lines = _beat(job, {"a": 10.0, "b": 10.0, "c": 9.0}, t) + _beat(job, {"a": 10.0, "b": 10.0, "c": 9.0}, t + 2)
    assert not job.nodes["c"].straggler and len(lines) == 1 and "no longer a straggler" in lines[0]


def test_a_brief_slowdown_is_not_a_straggler_and_plain_heartbeats_change_nothing() -> None:
    job = form(["a", "b", "c"])
    t = 10.0
    for i in range(40):
        slow = 2.0 if i % 10 < 5 else 10.0  # slow for 10 s out of every 20 s
        assert _beat(job, {"a": 10.0, "b": 10.0, "c": slow}, t) == []
        assert rounds.heartbeat(job, "c", t + 0.5) == []  # a plain heartbeat
        t += 2.0
    assert not any(n.straggler for n in job.nodes.values())
    assert job.nodes["c"].step is not None  # plain heartbeats keep the last progress


def test_progress_since_is_when_the_step_last_advanced() -> None:
    job = form(["a", "b"])
    rounds.heartbeat(job, "a", 10.0, step=5, rate=1.0)
    rounds.heartbeat(job, "a", 12.0, step=5, rate=0.0)  # no new step
    nodes = {n.node_id: n for n in view(job, 15.0).nodes}
    assert nodes["a"].step == 5 and nodes["a"].since_progress_s == 5.0
    assert nodes["b"].step is None and nodes["b"].since_progress_s is None
    rounds.heartbeat(job, "a", 16.0, step=6, rate=0.5)
    assert {n.node_id: n for n in view(job, 17.0).nodes}["a"].since_progress_s == 1.0
