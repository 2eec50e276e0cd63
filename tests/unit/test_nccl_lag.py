"""Stragglers NCCL RAS names (rounds.nccl_lag; pure: explicit clock): an
agent's heartbeat names a local rank its RAS readings saw behind; the server
flags its node like a compute straggler (rule nccl_lag): the view, the event,
the host's record, straggler_policy replace; a bad local rank changes nothing."""

from __future__ import annotations

import pytest
from test_rounds import form, join_msg, record, rejoin, sent, spec

from rdzv_common.errors import RequestError
from rdzv_common.protocol import RankLag, RankTiming, RestartMsg, SpareMsg, heartbeat_interval
from rdzv_server import rounds
from rdzv_server.rounds import nccl_lag
from rdzv_server.rounds.views import view

WINDOW_S = 10.0
LAG = RankLag(local_rank=1, share=0.8, readings=10, behind=2, window_s=WINDOW_S)


def _job(**kw: object) -> rounds.Job:
    sp = spec(min_nodes=1, max_nodes=3, straggler_window_s=WINDOW_S, **kw)
    return form(["a", "b", "c"], sp, lws=2)


def _flags(fx: rounds.Effects) -> list[rounds.Event]:
    return [ev for ev in fx.events if ev.kind == "straggler_flagged"]


def test_a_lagging_rank_named_by_its_agent_flags_its_node_once_in_the_view_event_and_host_record() -> None:
    job = _job()
    fx = rounds.heartbeat(job, "b", 100.0, lag=(LAG,))  # no step: its workers call nothing
    node = job.nodes["b"]
    assert node.straggler and node.slow_rank is not None and node.slow_rank.rule == "nccl_lag"
    assert not job.nodes["a"].straggler and not job.nodes["c"].straggler
    [ev] = _flags(fx)
    rank = node.rank_offset + 1
    assert ev.node == "b" and ev.fields["rule"] == "nccl_lag" and ev.fields["rank"] == rank
    assert ev.fields["lag_share"] == 0.8 and ev.fields["readings"] == 10 and ev.fields["collectives_behind"] == 2
    assert ev.fields["window_s"] == WINDOW_S and "behind its communicator in 80% of 10 readings" in ev.text
    assert [h for h, _ in fx.host_failures] == ["b"] and "straggler" in fx.host_failures[0][1]
    shown = {n.node_id: n for n in view(job, 101.0).nodes}["b"].slow_rank
    assert shown is not None and shown.rule == "nccl_lag" and shown.rank == rank and shown.local_rank == 1
    assert shown.lag_share == 0.8 and shown.readings == 10 and shown.collectives_behind == 2
    assert shown.ratio is None and shown.window_s == WINDOW_S + 1.0
    # renewed with each heartbeat: still flagged, nothing said again
    fx = rounds.Effects()
    for t in (102.0, 104.0, 106.0):
        fx.merge(rounds.heartbeat(job, "b", t, lag=(LAG,)))
        fx.merge(rounds.heartbeat(job, "a", t, step=int(t), rate=10.0))
    assert node.straggler and not _flags(fx) and not fx.host_failures
    # not saved: the next heartbeat brings it back
    assert record(job)["nodes"] and all("nccl_lag" not in n for n in record(job)["nodes"])


@pytest.mark.parametrize("how", ["empty", "progress", "stale"])
def test_the_flag_ends_when_its_agent_says_so_or_its_report_goes_stale(how: str) -> None:
    job = _job()
    rounds.heartbeat(job, "b", 100.0, lag=(LAG,))
    assert job.nodes["b"].straggler
    if how == "empty":  # none lags any more
        fx = rounds.heartbeat(job, "b", 102.0, lag=())
    elif how == "progress":  # a progress heartbeat without it: its agent sees none lagging
        fx = rounds.heartbeat(job, "b", 102.0, step=5, rate=1.0)
    else:  # its agent went quiet: older than the window plus two heartbeats at the next check
        late = 100.0 + WINDOW_S + 2 * heartbeat_interval(job.spec)
        fx = rounds.heartbeat(job, "a", late - 0.5, step=1, rate=1.0)
        assert job.nodes["b"].straggler
        fx = rounds.heartbeat(job, "a", late + 1.0, step=2, rate=1.0)
    assert not job.nodes["b"].straggler and job.nodes["b"].slow_rank is None
    assert any("no longer a straggler" in str(ln) for ln in fx.logs) and not _flags(fx)


def test_a_bad_local_rank_is_refused_and_changes_nothing() -> None:
    job = _job()
    before = (job.nodes["b"].last_seen, job.nodes["b"].nccl_lag)
    bad = RankLag(local_rank=2, share=0.8, readings=10, behind=2, window_s=WINDOW_S)  # the node has 2
    with pytest.raises(RequestError, match="nccl_lag: local rank 2, but node 'b' has 2 local rank"):
        rounds.heartbeat(job, "b", 100.0, lag=(LAG, bad))
    assert (job.nodes["b"].last_seen, job.nodes["b"].nccl_lag) == before and not job.nodes["b"].straggler


def test_the_worst_rank_is_named_and_other_rules_leave_the_flag_alone() -> None:
    job = _job()
    mild = RankLag(local_rank=0, share=0.4, readings=10, behind=5, window_s=WINDOW_S)
    fx = rounds.heartbeat(job, "b", 100.0, step=1, rate=10.0, lag=(mild, LAG))
    assert [ev.fields["local_rank"] for ev in _flags(fx)] == [1]
    # the step-rate rule (every node at the same rate) never lifts a flag that is not its own
    for t in (101.5, 103.0, 104.5):
        for n in ("a", "b", "c"):
            fx.merge(rounds.heartbeat(job, n, t, step=int(t), rate=10.0, lag=(LAG,) if n == "b" else None))
    assert job.nodes["b"].straggler and len(_flags(fx)) == 1
    # nor the compute rule: equal timings everywhere (lock-step, nobody computes longer)
    t = 106.0
    for n in ("a", "b", "c"):
        timing = RankTiming(local_rank=0, window_s=2.0, steps=20, compute_s=1.0, wait_s=1.0)
        fx.merge(rounds.heartbeat(job, n, t, step=200, rate=10.0, timings=(timing,), lag=(LAG,) if n == "b" else None))
        t += 1.5
    assert nccl_lag.owns(job.nodes["b"]) and len(_flags(fx)) == 1


def test_replace_swaps_the_lagging_node_for_a_waiting_spare_without_charging_a_restart() -> None:
    job = _job(straggler_policy="replace")
    rounds.join(job, join_msg("spare", sp=job.spec, lws=2), 99.0)
    assert job.nodes["spare"].state == rounds.SPARE
    fx = rounds.heartbeat(job, "b", 100.0, lag=(LAG,))
    assert job.round == 1 and job.forming and job.restarts == 0
    assert "straggler" in sent(fx, RestartMsg)["a"].reason
    told = sent(rejoin(job, ["b"], 101.0), SpareMsg)["b"]
    assert told.reason is not None and "behind its NCCL communicator in 80% of 10 RAS readings" in told.reason
    assert job.nodes["b"].nccl_lag is None and job.nodes["b"].slow_rank is None
