"""The round machine: fencing of stale reports, refusals, close, grace,
restore and records, and its cost at 4,096 nodes (the rest: test_rounds.py)."""

from __future__ import annotations

import pytest

from rdzv_common.protocol import (
    AssignedMsg,
    DoneMsg,
    EvictedError,
    EvictedMsg,
    JobFinishedError,
    JobState,
    RestartMsg,
    SpecMismatchError,
    StaleRoundError,
)
from rdzv_server import rounds
from tests.unit.test_rounds import EXIT, form, join_msg, live_counts, record, rejoin, sent, spec

# ------------------------------------------------------------------ fencing


@pytest.mark.parametrize("op", ["fail", "succeed"])
def test_stale_reports_are_refused_and_change_nothing(op):
    """A failure or success report naming an old round (or a forming one) is refused, changing nothing."""

    def report(job, round_no):
        if op == "fail":
            return rounds.fail(job, "a", round_no, [EXIT], 5.0)
        return rounds.succeed(job, "a", round_no, 5.0)

    job = form(["a", "b"])
    rounds.fail(job, "b", 0, [EXIT], 2.0)
    before = record(job)
    with pytest.raises(StaleRoundError, match="forming round 1"):
        report(job, 1)  # round 1 is still forming
    rejoin(job, ["a", "b"], 3.0)
    before = record(job)
    with pytest.raises(StaleRoundError, match="round 0 .* stale"):
        report(job, 0)
    assert record(job) == before and job.restarts == 1


def test_unknown_node_resume_is_evicted():
    """A node the job does not know that tries to resume is told it was evicted."""
    job = form(["a", "b"])
    before = record(job)
    with pytest.raises(EvictedError):
        rounds.join(job, join_msg("ghost", sp=job.spec, resume=0), 2.0)
    with pytest.raises(EvictedError):
        rounds.fail(job, "ghost", 0, [EXIT], 2.0)
    assert record(job) == before


def test_resume_of_the_running_round_resends_the_same_assignment():
    """A node that reconnects to the round it runs gets the same assignment and no restart."""
    sp = spec(min_nodes=2, max_nodes=2)
    job = rounds.new_job("j", sp, 0.0)
    first = rounds.join(job, join_msg("a", sp=sp), 0.0).merge(rounds.join(job, join_msg("b", sp=sp), 0.0))
    rounds.disconnect(job, "a", 1.0, grace_s=2.0)
    fx = rounds.join(job, join_msg("a", sp=sp, resume=0), 2.0)
    assert fx.messages() == [("a", sent(first, AssignedMsg)["a"])]
    assert not fx.persist and not fx.rounds_opened
    rounds.heartbeat(job, "b", 3.5)
    assert not rounds.tick(job, 3.5).sends  # the old lost deadline is gone
    assert job.round == 0 and job.state == JobState.RUNNING


def test_resume_after_a_missed_restart_is_told_to_restart():
    """A node that missed a restart and resumes its old round is told to restart into the new one."""
    job = form(["a", "b"])
    rounds.fail(job, "b", 0, [EXIT], 2.0)
    rounds.disconnect(job, "a", 2.0, grace_s=5.0)
    fx = rounds.join(job, join_msg("a", sp=job.spec, resume=0), 3.0)
    assert fx.messages() == [("a", RestartMsg(round=1, reason=job.history[-1].reason))]
    assert job.nodes["a"].connected and job.nodes["a"].lost_deadline is None
    assert job.nodes["a"].state == rounds.REJOINING


def test_resume_of_an_older_round_while_running_is_refused_unchanged():
    """A running member resuming a round that is over is refused and nothing changes."""
    job = form(["a", "b"])
    rounds.fail(job, "b", 0, [EXIT], 2.0)
    rejoin(job, ["a", "b"], 2.5)
    rounds.disconnect(job, "a", 3.0, grace_s=5.0)
    before = record(job)
    with pytest.raises(StaleRoundError):
        rounds.join(job, join_msg("a", sp=job.spec, resume=0), 4.0)
    assert record(job) == before


# ------------------------------------------------------------------ refusals


def test_spec_mismatch_is_refused_naming_both_values():
    """A join with other min:max is refused, naming both, and changes nothing."""
    job = rounds.new_job("j", spec(), 0.0)
    rounds.join(job, join_msg("a"), 0.0)
    before = record(job)
    with pytest.raises(SpecMismatchError, match=r"nnodes 2:4.*asked for 1:8"):
        rounds.join(job, join_msg("b", sp=spec(min_nodes=1, max_nodes=8)), 0.5)
    assert record(job) == before


@pytest.mark.parametrize("end", ["close", "fail", "succeed"])
def test_finished_job_refuses_joins_and_ignores_leaves(end):
    """A finished job refuses its nodes' joins and reports, and a leave does not
    reopen it (a fresh agent's join starts its next run: test_job_lifecycle.py)."""
    job = form(["a", "b"], spec(min_nodes=1, max_restarts=0))
    if end == "close":
        rounds.close(job, 2.0)
    elif end == "fail":
        rounds.fail(job, "a", 0, [EXIT], 2.0)
    else:
        rounds.succeed(job, "a", 0, 2.0)
        rounds.succeed(job, "b", 0, 2.0)
    before = record(job)
    with pytest.raises(JobFinishedError, match="this agent belongs to that run"):
        rounds.join(job, join_msg("b", sp=job.spec), 3.0)
    with pytest.raises(JobFinishedError):
        rounds.fail(job, "a", 0, [EXIT], 3.0)
    assert not rounds.leave(job, "b", "sigterm", 3.0).sends
    assert not rounds.close(job, 3.0).sends
    assert not rounds.tick(job, 1000.0).sends
    assert record(job) == before


def test_plain_join_from_a_running_member_gets_its_assignment_again():
    """A member whose assignment was sent while it was away (it joins again
    without resume_round) gets the same assignment; nothing else changes."""
    job = form(["a", "b"])
    rounds.disconnect(job, "a", 1.9, grace_s=0.5)
    before = record(job)
    fx = rounds.join(job, join_msg("a", sp=job.spec), 2.0)
    after = record(job)
    assert sent(fx, AssignedMsg)["a"].assignment == rounds.forming._assignment(job, job.nodes["a"])
    assert job.round == 0 and job.state == JobState.RUNNING and job.nodes["a"].connected
    for key in ("round", "order", "restarts", "history", "state"):
        assert after[key] == before[key]


def test_succeeded_member_cannot_join_again():
    """A plain join from a node that already succeeded is refused, changing nothing."""
    job = form(["a", "b"])
    rounds.succeed(job, "a", 0, 2.0)
    before = record(job)
    with pytest.raises(StaleRoundError, match="cannot join again"):
        rounds.join(job, join_msg("a", sp=job.spec), 2.1)
    assert record(job) == before


# --------------------------------------------- close, grace, restore, records


def test_close_tells_everyone_and_ends_the_job():
    """Closing a job sends DoneMsg(closed) to every node, spares included."""
    job = form(["a", "b"], spec(min_nodes=1, max_nodes=2))
    rounds.join(job, join_msg("c", sp=job.spec), 1.5)
    fx = rounds.close(job, 2.0)
    assert job.state == JobState.CLOSED and fx.persist
    assert sent(fx, DoneMsg) == {n: DoneMsg(state="closed", reason="closed by request") for n in ["a", "b", "c"]}


def test_grace_gives_everyone_a_full_heartbeat_timeout():
    """After grace(now), silent and disconnected nodes are lost only a full heartbeat timeout later."""
    job = form(["a", "b", "c"])
    rounds.disconnect(job, "c", 1.0, grace_s=1.0)
    rounds.grace(job, 100.0)
    assert not rounds.tick(job, 105.99).sends and job.round == 0
    fx = rounds.tick(job, 106.0)
    assert set(sent(fx, EvictedMsg)) == {"a", "b", "c"}


def test_restored_job_waits_a_heartbeat_timeout_for_its_nodes():
    """A job loaded from disk marks everyone disconnected and gives them a heartbeat timeout to reappear."""
    job = rounds.from_record(record(form(["a", "b", "c"])))
    rounds.restored(job, 100.0)
    assert not any(n.connected for n in job.nodes.values())
    for nid in ["a", "b"]:
        fx = rounds.join(job, join_msg(nid, sp=job.spec, resume=0), 101.0)
        assert sent(fx, AssignedMsg)[nid].assignment.round == 0
    assert not rounds.tick(job, 105.99).sends
    fx = rounds.tick(job, 106.0)
    assert set(sent(fx, EvictedMsg)) == {"c"} and job.round == 1


def test_a_failover_grace_is_longer_and_a_stall_does_not_shorten_it():
    """A new HA leader gives every node the heartbeat timeout (6 s) plus
    extra_s (5 s): c, not back, is lost at 111, not 106; a stall grace on the
    way (at 102) does not bring that forward; a, back at 101 and silent after,
    is judged by its heartbeat as usual (lost at 107, before c)."""
    job = rounds.from_record(record(form(["a", "b", "c"])))
    rounds.restored(job, 100.0, extra_s=5.0)
    assert rounds.next_due(job) == 111.0
    rounds.join(job, join_msg("a", sp=job.spec, resume=0), 101.0)
    rounds.join(job, join_msg("b", sp=job.spec, resume=0), 101.0)
    rounds.grace(job, 102.0, stall=True)
    assert job.nodes["c"].lost_deadline == 111.0
    assert rounds.next_due(job) == 108.0  # a and b: heard from at 102 (the stall's grace)
    rounds.heartbeat(job, "b", 107.5)
    rounds.heartbeat(job, "b", 110.5)
    assert not rounds.tick(job, 107.99).sends
    fx = rounds.tick(job, 108.0)
    assert set(sent(fx, EvictedMsg)) == {"a"}
    rounds.heartbeat(job, "b", 110.9)
    assert "c" not in sent(rounds.tick(job, 110.99), EvictedMsg)
    fx = rounds.tick(job, 111.0)
    assert "c" in sent(fx, EvictedMsg)


def _job_in_every_state() -> list[rounds.Job]:
    forming = rounds.new_job("j", spec(), 0.0)
    rounds.join(forming, join_msg("a", lws=3, rank=1), 0.0)
    rounds.join(forming, join_msg("b"), 0.5)  # last call running
    running = form(["a", "b"], spec(min_nodes=1, max_nodes=2))
    rounds.join(running, join_msg("c", sp=running.spec), 1.5)  # a spare
    rounds.succeed(running, "a", 0, 1.6)
    reforming = form(["a", "b", "c"])
    rounds.fail(reforming, "a", 0, [EXIT], 2.0)
    rejoin(reforming, ["b"], 2.1)
    rounds.disconnect(reforming, "c", 2.2, grace_s=3.0)
    failed = form(["a"], spec(min_nodes=1, max_restarts=0))
    rounds.fail(failed, "a", 0, [EXIT], 2.0)
    return [forming, running, reforming, failed]


@pytest.mark.parametrize("index", range(4))
def test_record_roundtrip_keeps_everything_including_counts(index):
    """to_record is JSON-able and from_record rebuilds the same job with the same per-state counts."""
    job = _job_in_every_state()[index]
    rec = record(job)
    back = rounds.from_record(rec)
    assert record(back) == rec
    assert live_counts(back) == live_counts(job)
    assert rounds.view(back, 3.0) == rounds.view(job, 3.0)


# -------------------------------------------------------------- performance


@pytest.mark.timeout(20)
def test_4096_nodes_join_complete_and_succeed_in_linear_time():
    """4096 joins complete one round with 4096 assignments, and views and reports stay cheap."""
    n = 4096
    sp = spec(min_nodes=n, max_nodes=n)
    job = rounds.new_job("j", sp, 0.0)
    fx = rounds.Effects()
    for i in range(n):
        fx = rounds.join(job, join_msg(f"n{i}", f"host{i}", sp=sp, lws=1 + i % 8), i * 1e-4)
    assigned = sent(fx, AssignedMsg)
    assert len(assigned) == n and job.state == JobState.RUNNING
    assert [assigned[nid].assignment.group_rank for nid in job.order] == list(range(n))
    assert job.world_size == sum(1 + i % 8 for i in range(n))
    assert len(rounds.view(job, 1.0).nodes) == n
    rounds.tick(job, 1.0)
    for i in range(n):
        rounds.succeed(job, f"n{i}", 0, 2.0)
    assert job.state == JobState.SUCCEEDED
