"""Progress on heartbeats and the straggler flag (rounds, pure: explicit clock)."""

from __future__ import annotations

import pytest
from test_rounds import form, join_msg, record, rejoin, sent, spec

from rdzv_common.protocol import AssignedMsg, RestartMsg, SpareMsg, SpecMismatchError
from rdzv_common.wire import DEFAULT_STRAGGLER_WINDOW_S as STRAGGLER_WINDOW_S
from rdzv_server import rounds
from rdzv_server.rounds.views import view


def _beat(job: rounds.Job, rates: dict[str, float], now: float) -> list[str]:
    lines: list[str] = []
    for nid, rate in rates.items():
        lines += rounds.heartbeat(job, nid, now, step=int(now * rate), rate=rate).logs
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
        assert rounds.heartbeat(job, "c", t + 0.5).logs == []  # a plain heartbeat
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


# ------------------------------------------------ --straggler-policy, fraction, window


def _slow_c(job: rounds.Job, t: float, until: float) -> tuple[rounds.Effects, float]:
    """a and b run at 10 steps/s, c at 2 until ``until``; every 2 s."""
    fx = rounds.Effects()
    while t <= until:
        for nid, rate in {"a": 10.0, "b": 10.0, "c": 2.0}.items():
            if nid in job.nodes and job.nodes[nid].state == rounds.RUNNING:
                fx.merge(rounds.heartbeat(job, nid, t, step=int(t * rate), rate=rate))
        for nid in job.nodes:  # spares and others: plain heartbeats
            if job.nodes[nid].state != rounds.RUNNING:
                rounds.heartbeat(job, nid, t)
        t += 2.0
    return fx, t


def _policy_job(policy: str, spare: bool, **kw: object) -> rounds.Job:
    sp = spec(min_nodes=3, max_nodes=3, straggler_policy=policy, **kw)
    job = form(["a", "b", "c"], sp)
    if spare:
        fx = rounds.join(job, join_msg("d", sp=sp), 1.0)
        assert job.nodes["d"].state == rounds.SPARE and sent(fx, SpareMsg)
    return job


def test_policy_replace_with_a_spare_opens_a_round_without_the_straggler_and_the_spare_takes_its_place() -> None:
    job = _policy_job("replace", spare=True)
    fx, t = _slow_c(job, 10.0, 10.0 + STRAGGLER_WINDOW_S + 4)
    assert job.round == 1 and job.forming and job.restarts == 0  # not charged to the budget
    restarts = sent(fx, RestartMsg)
    assert set(restarts) == {"a", "b", "c"} and "straggler" in restarts["c"].reason
    assert "node(s) c (c) replaced by a spare" in restarts["c"].reason
    assert any("is a straggler" in line for line in fx.logs)
    assert "straggler" in job.history[-1].reason
    # the straggler rejoins: it waits as a spare, told why; a, b and the spare d form the round
    fx = rejoin(job, ["c"], t)
    assert job.nodes["c"].state == rounds.SPARE and job.forming
    told = sent(fx, SpareMsg)["c"]
    assert told.reason is not None and "replaced as a straggler" in told.reason and "2 steps/s" in told.reason
    fx = rejoin(job, ["a", "b"], t)
    assert not job.forming and set(job.order) == {"a", "b", "d"} and job.nodes["c"].state == rounds.SPARE
    assert set(sent(fx, AssignedMsg)) == {"a", "b", "d"} and job.restarts == 0
    assert not job.nodes["c"].straggler
    # c is a spare like any other now: it may rejoin again, and stays a spare while the job is full
    rejoin(job, ["c"], t + 1)
    assert job.nodes["c"].state == rounds.SPARE and not job.forming


def test_policy_replace_without_a_spare_warns_only_then_replaces_when_a_spare_arrives() -> None:
    job = _policy_job("replace", spare=False)
    fx, t = _slow_c(job, 10.0, 10.0 + STRAGGLER_WINDOW_S + 4)
    assert job.round == 0 and not job.forming and job.nodes["c"].straggler  # nothing else changed
    assert not sent(fx, RestartMsg)
    warned = [line for line in fx.logs if "no spare waits" in line]
    assert len(warned) == 1 and "flagged only" in warned[0]
    nodes = {n.node_id: n for n in view(job, t).nodes}
    assert nodes["c"].straggler_note is not None and "no spare waits" in nodes["c"].straggler_note
    assert nodes["a"].straggler_note is None
    fx, t = _slow_c(job, t, t + 6)  # said once, not every check
    assert not [line for line in fx.logs if "no spare waits" in line] and job.round == 0
    # a spare arrives: the next check replaces the straggler
    rounds.join(job, join_msg("d", sp=job.spec), t)
    fx, t = _slow_c(job, t, t + 2)
    assert job.round == 1 and "c" in sent(fx, RestartMsg)
    assert {n.node_id: n for n in view(job, t).nodes}["c"].straggler_note is None


def test_policy_warn_flags_and_changes_nothing_even_with_a_spare() -> None:
    job = _policy_job("warn", spare=True)
    before = (job.round, list(job.order), job.nodes["d"].state)
    fx, _ = _slow_c(job, 10.0, 10.0 + STRAGGLER_WINDOW_S + 4)
    assert job.nodes["c"].straggler and (job.round, list(job.order), job.nodes["d"].state) == before
    assert not fx.sends and not fx.persist and not job.nodes["c"].straggler_note


def test_straggler_fraction_and_window_are_per_job() -> None:
    job = _policy_job("warn", spare=False, straggler_fraction=0.1, straggler_window_s=4.0)
    _slow_c(job, 10.0, 30.0)  # 2 steps/s is not below 0.1 x 10
    assert not job.nodes["c"].straggler
    job = _policy_job("warn", spare=False, straggler_fraction=0.9, straggler_window_s=4.0)
    fx, _ = _slow_c(job, 10.0, 16.0)  # flagged after 4 s, not 30
    assert job.nodes["c"].straggler and any("is a straggler" in line for line in fx.logs)


def test_straggler_spec_fields_are_left_out_of_records_at_their_defaults_and_kept_otherwise() -> None:
    job = form(["a", "b"])
    rec = record(job)
    assert not {"straggler_policy", "straggler_fraction", "straggler_window_s"} & set(rec["spec"])
    assert all("replaced" not in n for n in rec["nodes"])
    sp = spec(straggler_policy="replace", straggler_fraction=0.25, straggler_window_s=12.0)
    job = form(["a", "b"], sp)
    job.nodes["a"].replaced = "replaced as a straggler"
    rec = record(job)
    assert rec["spec"]["straggler_policy"] == "replace" and rec["spec"]["straggler_window_s"] == 12.0
    back = rounds.from_record(rec)
    assert back.spec == sp and back.nodes["a"].replaced == "replaced as a straggler"


def test_a_join_with_another_straggler_policy_is_refused_naming_it() -> None:
    job = _policy_job("replace", spare=False)
    with pytest.raises(SpecMismatchError, match="straggler_policy replace, but node 'e' asked for warn"):
        rounds.join(job, join_msg("e", sp=spec(min_nodes=3, max_nodes=3)), 2.0)
