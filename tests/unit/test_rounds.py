"""The round state machine, driven with plain numbers for time (no clocks)."""

from __future__ import annotations

import json

import pytest

from rdzv_common.protocol import (
    AssignedMsg,
    DoneMsg,
    EvictedMsg,
    ExitRecord,
    JobSpec,
    JobState,
    JoinedMsg,
    JoinMsg,
    RestartMsg,
    SpareMsg,
)
from rdzv_server import rounds

BASE = dict(
    min_nodes=2,
    max_nodes=4,
    max_restarts=2,
    last_call_s=1.0,
    heartbeat_timeout_s=6.0,
    join_timeout_s=60.0,
    scale_up_window_s=0.5,
)
EXIT = ExitRecord(local_rank=1, rank=3, pid=4242, exit_code=7, message="boom")


def spec(**kw) -> JobSpec:
    return JobSpec(**{**BASE, **kw})


def join_msg(
    node_id: str,
    host: str | None = None,
    *,
    sp: JobSpec | None = None,
    lws: int = 1,
    rank: int | None = None,
    resume: int | None = None,
    port: int = 29500,
) -> JoinMsg:
    host = host or node_id
    return JoinMsg(
        job_id="j",
        node_id=node_id,
        host=host,
        addr=f"{host}.addr",
        local_world_size=lws,
        master_port=port,
        spec=sp or spec(),
        requested_rank=rank,
        resume_round=resume,
    )


def sent(fx: rounds.Effects, kind: type) -> dict:
    """The messages of one kind in an Effects, by node id."""
    return {nid: m for nid, m in fx.messages() if isinstance(m, kind)}


def record(job: rounds.Job) -> dict:
    """A deep, JSON-checked snapshot of the job."""
    return json.loads(json.dumps(rounds.to_record(job)))


def live_counts(job: rounds.Job) -> dict:
    return {k: v for k, v in job.counts.items() if v}


def form(ids, sp: JobSpec | None = None, now: float = 0.0, **kw) -> rounds.Job:
    """A running job whose round 0 holds ``ids`` (hosts = ids), formed at ``now``."""
    sp = sp or spec(min_nodes=1, max_nodes=max(4, len(ids)))
    job = rounds.new_job("j", sp, now)
    for nid in ids:
        rounds.join(job, join_msg(nid, sp=sp, **kw), now)
    if job.forming:
        rounds.tick(job, now + sp.last_call_s)
    assert job.state == JobState.RUNNING
    for nid in ids:
        rounds.heartbeat(job, nid, now + sp.last_call_s)
    return job


def alive(job: rounds.Job, now: float) -> None:
    """Every node heartbeats at ``now``."""
    for nid in list(job.nodes):
        rounds.heartbeat(job, nid, now)


def rejoin(job: rounds.Job, ids, now: float) -> rounds.Effects:
    fx = rounds.Effects()
    for nid in ids:
        fx.merge(rounds.join(job, join_msg(nid, sp=job.spec), now))
    return fx


# ------------------------------------------------------------ first formation


def test_below_min_waits_and_says_how_many_are_missing():
    """Below min_nodes the round waits, and says how many more nodes it needs."""
    sp = spec(min_nodes=3, max_nodes=4)
    job = rounds.new_job("j", sp, 0.0)
    fx = rounds.join(job, join_msg("a", sp=sp), 0.0)
    rounds.join(job, join_msg("b", sp=sp), 1.0)
    assert sent(fx, JoinedMsg)["a"].round == 0
    assert "2 more node(s) to reach min 3" in sent(fx, JoinedMsg)["a"].waiting_for.text
    assert rounds.waiting_info(job, 2.0).text == "1 more node(s) to reach min 3"
    assert job.last_call_deadline is None
    rounds.heartbeat(job, "a", 30.0)
    rounds.heartbeat(job, "b", 30.0)
    assert not sent(rounds.tick(job, 30.0), AssignedMsg)
    assert job.state == JobState.WAITING


def test_reaching_min_starts_last_call_which_completes_on_tick():
    """Reaching min starts a last call of last_call_s; only a tick at its deadline completes."""
    job = rounds.new_job("j", spec(), 0.0)
    rounds.join(job, join_msg("a"), 0.0)
    rounds.join(job, join_msg("b"), 1.0)
    assert job.last_call_deadline == 2.0
    assert "last call: 1.0s left" in rounds.waiting_info(job, 1.0).text
    rounds.join(job, join_msg("c"), 1.5)
    assert job.last_call_deadline == 2.0  # a later join does not extend it
    fx = rounds.tick(job, 1.999)
    assert not sent(fx, AssignedMsg) and job.state == JobState.WAITING
    fx = rounds.tick(job, 2.0)
    assert set(sent(fx, AssignedMsg)) == {"a", "b", "c"}
    assert job.state == JobState.RUNNING and job.round == 0 and job.last_call_deadline is None


def test_reaching_max_completes_at_once():
    """The join that reaches max_nodes completes the round, with no tick and no last call."""
    sp = spec(min_nodes=1, max_nodes=3)
    job = rounds.new_job("j", sp, 0.0)
    rounds.join(job, join_msg("a", sp=sp), 0.0)
    rounds.join(job, join_msg("b", sp=sp), 0.1)
    fx = rounds.join(job, join_msg("c", sp=sp), 0.2)
    assert set(sent(fx, AssignedMsg)) == {"a", "b", "c"}
    assert job.state == JobState.RUNNING
    assert fx.messages()[0] == ("c", sent(fx, JoinedMsg)["c"])  # joined is said before assigned


def test_nodes_beyond_max_are_spares():
    """A node that arrives when the job runs at max_nodes is told it is a spare."""
    job = form(["a", "b"], spec(min_nodes=1, max_nodes=2))
    fx = rounds.join(job, join_msg("c", sp=job.spec), 5.0)
    assert sent(fx, SpareMsg) == {"c": SpareMsg(round=0)}
    assert sent(fx, JoinedMsg)["c"].round == 1
    assert job.nodes["c"].state == rounds.SPARE and job.scale_up_deadline is None
    assert job.round == 0 and job.order == ["a", "b"]


# --------------------------------------------------------------- stable ranks


@pytest.mark.parametrize(
    "joins, expected",
    [
        ([("x", "node10"), ("y", "node2"), ("z", "node1")], ["z", "y", "x"]),
        ([("b", "h1"), ("a", "h1"), ("c", "h0")], ["c", "a", "b"]),
        ([("n1", "Rack2-Node10"), ("n2", "rack2-node9"), ("n3", "rack10-node1")], ["n2", "n1", "n3"]),
    ],
)
def test_new_nodes_get_natural_host_order_then_node_id(joins, expected):
    """New nodes are ranked by natural host order (node2 before node10), then node id."""
    sp = spec(min_nodes=1, max_nodes=len(joins))
    job = rounds.new_job("j", sp, 0.0)
    for nid, host in joins:
        rounds.join(job, join_msg(nid, host, sp=sp), 0.0)
    assert job.order == expected
    assert [job.nodes[n].group_rank for n in expected] == list(range(len(expected)))


@pytest.mark.parametrize(
    "requests, expected",
    [
        ({"c": 0}, ["c", "a", "b"]),
        ({"a": 2}, ["b", "c", "a"]),
        ({"c": 3}, ["a", "b", "c"]),  # not smaller than the world: ignored
        ({"b": 0, "c": 0}, ["b", "a", "c"]),  # taken: the second one falls back to order
        ({"a": 1, "b": 0}, ["b", "a", "c"]),
    ],
)
def test_requested_rank_is_honoured_when_free_and_below_world(requests, expected):
    """A requested rank is given when free and < world; the others fill the gaps in order."""
    sp = spec(min_nodes=1, max_nodes=3)
    job = rounds.new_job("j", sp, 0.0)
    for nid in ["a", "b", "c"]:
        rounds.join(job, join_msg(nid, sp=sp, rank=requests.get(nid)), 0.0)
    assert job.order == expected


def test_surviving_rank0_keeps_rank0_and_master():
    """Rank 0 stays on its node across a re-formed round, even if a newcomer asks for rank 0."""
    job = form(["a", "b", "c"], spec(min_nodes=1, max_nodes=4))
    master = (job.master_addr, job.master_port)
    rounds.join(job, join_msg("d", "a0", sp=job.spec, rank=0), 10.0)
    alive(job, 10.0)
    rounds.tick(job, 10.5)
    assert job.round == 1 and job.forming
    fx = rejoin(job, ["c", "b", "a"], 10.6)
    assert job.order == ["a", "b", "c", "d"]
    assert sent(fx, AssignedMsg)["a"].assignment.group_rank == 0
    assert (job.master_addr, job.master_port) == master


def test_previous_members_keep_relative_order_and_new_nodes_follow():
    """Survivors keep their relative order whatever order they rejoin in; newcomers come after."""
    job = form(["n1", "n2", "n3", "n4"], spec(min_nodes=1, max_nodes=6))
    rounds.leave(job, "n1", "sigterm", 5.0)  # rank 0 leaves: n2 becomes rank 0
    rounds.join(job, join_msg("n0", sp=job.spec), 5.1)  # would sort first as a new node
    rejoin(job, ["n4", "n3", "n2"], 5.2)
    assert job.order == ["n2", "n3", "n4", "n0"]
    assert job.master_addr == "n2.addr"


def test_ranks_and_prefix_sums_for_heterogeneous_local_world_sizes():
    """Global rank offsets are prefix sums of local world sizes in group-rank order."""
    sp = spec(min_nodes=3, max_nodes=3)
    job = rounds.new_job("j", sp, 0.0)
    fx = rounds.Effects()
    for nid, lws in [("node1", 8), ("node2", 2), ("node3", 4)]:
        fx.merge(rounds.join(job, join_msg(nid, sp=sp, lws=lws, port=30000 + lws), 0.0))
    got = {nid: m.assignment for nid, m in sent(fx, AssignedMsg).items()}
    assert [(got[n].group_rank, got[n].rank_offset, got[n].local_world_size) for n in ["node1", "node2", "node3"]] == [
        (0, 0, 8),
        (1, 8, 2),
        (2, 10, 4),
    ]
    assert {(a.world_size, a.group_world_size, a.master_addr, a.master_port) for a in got.values()} == {
        (14, 3, "node1.addr", 30008)
    }


# ----------------------------------------------------------- re-formed rounds


@pytest.mark.parametrize("how", ["disconnect", "silence"])
def test_lost_member_opens_a_round_that_completes_when_survivors_are_back(how):
    """A lost member is evicted, survivors restart, and the round completes on the last rejoin."""
    job = form(["a", "b", "c"])  # heartbeats at 1.0
    if how == "disconnect":
        rounds.disconnect(job, "b", 2.0, grace_s=2.0)
        assert not rounds.tick(job, 3.99).sends
        fx = rounds.tick(job, 4.0)
    else:
        for nid in ["a", "c"]:
            rounds.heartbeat(job, nid, 6.0)
        assert not rounds.tick(job, 6.99).sends
        fx = rounds.tick(job, 7.0)
    now = 7.0
    assert set(sent(fx, EvictedMsg)) == {"b"} and fx.evicted == ["b"]
    assert sent(fx, RestartMsg) == {n: RestartMsg(round=1, reason=job.history[-1].reason) for n in ["a", "c"]}
    assert "node b" in job.history[-1].reason
    assert job.forming and job.round == 1 and "b" not in job.nodes
    info = rounds.waiting_info(job, now)
    assert info.text.startswith("previous members not back: a, c") and info.missing == ["a", "c"]
    fx = rejoin(job, ["c"], now)
    assert not sent(fx, AssignedMsg)
    assert rounds.waiting_info(job, now).missing == ["a"]
    fx = rejoin(job, ["a"], now)
    assert set(sent(fx, AssignedMsg)) == {"a", "c"}  # no last call in a re-formed round
    assert job.order == ["a", "c"] and job.restarts == 0 and job.last_call_deadline is None
    assert sent(fx, AssignedMsg)["c"].assignment.round == 1


def test_a_member_back_after_restart_naming_its_run_is_told_nothing_until_assigned():
    """A previous member's rejoin that names the job's run (its agent holds this
    run's `joined`) gets no `joined` again: it knows the round from `restart`.
    A join without the run (a fresh agent process) and a new node still do."""
    job = form(["a", "b", "c", "d"])
    rounds.leave(job, "d", "sigterm", 2.0)
    assert job.forming and job.round == 1
    run = job.run
    fx = rounds.join(job, join_msg("a", sp=job.spec).model_copy(update={"run": run}), 2.1)
    assert not fx.sends and job.nodes["a"].state == rounds.WAITING
    fx = rounds.join(job, join_msg("b", sp=job.spec), 2.2)  # no run: told as before
    assert sent(fx, JoinedMsg)["b"].round == 1 and not sent(fx, AssignedMsg)
    fx = rounds.join(job, join_msg("c", sp=job.spec).model_copy(update={"run": run}), 2.3)
    assert set(sent(fx, AssignedMsg)) == {"a", "b", "c"} and not sent(fx, JoinedMsg)
    assert job.order == ["a", "b", "c"] and sent(fx, AssignedMsg)["a"].assignment.round == 1


def test_a_member_back_after_restart_in_a_round_that_waits_hears_its_status():
    """Told no `joined`, a member back in a round that waits (below min here) still
    hears an answer to its join within the status push interval: its agent's
    --server-timeout clock runs from its join until the server answers it."""
    from rdzv_common.protocol import StatusMsg
    from rdzv_server.rounds.machine import STATUS_PUSH_INTERVAL_S

    job = form(["a", "b", "c"], spec(min_nodes=3, max_nodes=3, join_timeout_s=600.0))
    rounds.leave(job, "c", "sigterm", 2.0)
    rounds.tick(job, 2.0)  # the round's first status (nobody back yet)
    for nid in ("a", "b"):
        fx = rounds.join(job, join_msg(nid, sp=job.spec).model_copy(update={"run": job.run}), 2.1)
        assert not fx.sends
    assert job.forming and rounds.next_due(job) <= 2.0 + STATUS_PUSH_INTERVAL_S
    fx = rounds.tick(job, 2.0 + STATUS_PUSH_INTERVAL_S)
    told = sent(fx, StatusMsg)
    assert set(told) == {"a", "b"} and "1 more node(s) to reach min 3" in told["a"].waiting_for.text


def test_reformed_round_waits_for_a_live_member_even_when_max_nodes_wait():
    """Promoted spares reaching max do not complete a re-formed round before a live member is back."""
    job = form(["a", "b"], spec(min_nodes=1, max_nodes=2))
    rounds.join(job, join_msg("c", sp=job.spec), 1.5)
    rounds.fail(job, "b", 0, [EXIT], 2.0)
    fx = rejoin(job, ["b"], 2.1)  # b and the promoted spare c: max_nodes waiting
    assert not sent(fx, AssignedMsg) and job.forming
    assert rounds.waiting_info(job, 2.1).missing == ["a"]
    fx = rejoin(job, ["a"], 2.2)
    assert job.order == ["a", "b"] and sent(fx, SpareMsg) == {"c": SpareMsg(round=1)}


def test_spare_is_promoted_when_a_member_is_lost():
    """When a member leaves, the spare joins the next round; that costs no restart."""
    job = form(["a", "b"], spec(min_nodes=1, max_nodes=2))
    rounds.join(job, join_msg("c", sp=job.spec), 1.5)
    fx = rounds.leave(job, "b", "sigterm", 2.0)
    assert set(sent(fx, RestartMsg)) == {"a"} and not sent(fx, EvictedMsg)
    assert job.nodes["c"].state == rounds.WAITING
    fx = rejoin(job, ["a"], 2.1)
    assert job.order == ["a", "c"] and set(sent(fx, AssignedMsg)) == {"a", "c"}
    assert job.restarts == 0


def test_scale_up_batches_arrivals_into_one_round():
    """Nodes arriving below max within the scale-up window cost one new round, after the window."""
    job = form(["a", "b"])
    alive(job, 10.0)
    fx = rounds.join(job, join_msg("c", sp=job.spec), 10.0)
    assert sent(fx, JoinedMsg)["c"].round == 1 and not sent(fx, SpareMsg)
    assert job.scale_up_deadline == 10.5
    rounds.join(job, join_msg("d", sp=job.spec), 10.3)
    assert job.scale_up_deadline == 10.5
    assert not rounds.tick(job, 10.49).sends and job.round == 0
    fx = rounds.tick(job, 10.5)
    assert job.round == 1 and set(sent(fx, RestartMsg)) == {"a", "b"}
    assert job.history[-1].reason.startswith("scale-up: 2 new node(s)")
    fx = rejoin(job, ["a", "b"], 10.6)
    assert job.order == ["a", "b", "c", "d"] and len(sent(fx, AssignedMsg)) == 4
    assert job.round == 1 and job.restarts == 0
    fx = rounds.join(job, join_msg("e", sp=job.spec), 11.0)
    assert sent(fx, SpareMsg) == {"e": SpareMsg(round=1)} and job.scale_up_deadline is None


# ------------------------------------------------------------ restart budget


@pytest.mark.parametrize(
    "record_, words",
    [
        (EXIT, ["node b (b)", "rank 3", "exit code 7", "boom"]),
        (
            ExitRecord(local_rank=0, rank=1, pid=9, signal="SIGKILL"),
            ["node b (b)", "rank 1", "signal SIGKILL", "out of memory?"],
        ),
    ],
)
def test_failures_spend_the_restart_budget_then_fail_the_job(record_, words):
    """Each failure costs a restart; the one after max_restarts fails the job naming the root cause."""
    job = form(["a", "b"], spec(min_nodes=1, max_restarts=2))
    now = 1.0
    for restart in (1, 2):
        fx = rounds.fail(job, "b", job.round, [record_], now)
        assert job.restarts == restart and job.round == restart and fx.restarts == 1
        assert set(sent(fx, RestartMsg)) == {"a", "b"}
        fx = rejoin(job, ["a", "b"], now)
        assert {m.assignment.restarts for m in sent(fx, AssignedMsg).values()} == {restart}
        now += 1.0
    fx = rounds.fail(job, "b", job.round, [record_], now)
    assert job.state == JobState.FAILED and job.restarts == 2
    for w in words:
        assert w in job.root_cause
    done = sent(fx, DoneMsg)
    assert set(done) == {"a", "b"} and {m.state for m in done.values()} == {"failed"}
    assert done["a"].root_cause == job.root_cause and "restart budget of 2 spent" in done["a"].reason


def test_first_failure_is_the_earliest_record():
    """Of several exit records, the earliest (then the lowest rank) is named."""
    job = form(["a", "b"], spec(min_nodes=1, max_restarts=0))
    late = ExitRecord(local_rank=0, rank=0, pid=1, exit_code=1, timestamp=20.0)
    early = ExitRecord(local_rank=1, rank=1, pid=2, exit_code=2, timestamp=10.0)
    rounds.fail(job, "a", 0, [late, early], 1.0)
    assert job.state == JobState.FAILED and "rank 1 " in job.root_cause and "exit code 2" in job.root_cause


@pytest.mark.parametrize("change", ["loss", "leave", "scale-up"])
def test_membership_changes_do_not_spend_the_budget(change):
    """Losing, leaving or adding a node opens a round without counting a restart."""
    job = form(["a", "b", "c"], spec(min_nodes=1, max_nodes=4, max_restarts=0))
    if change == "loss":
        rounds.disconnect(job, "c", 2.0, grace_s=0.5)
        rounds.tick(job, 2.5)
    elif change == "leave":
        rounds.leave(job, "c", "sigterm", 2.5)
    else:
        rounds.join(job, join_msg("d", sp=job.spec), 2.0)
        rounds.tick(job, 2.5)
    assert job.round == 1 and job.restarts == 0
    fx = rejoin(job, ["a", "b"] + (["c"] if change == "scale-up" else []), 2.6)
    assert {m.assignment.restarts for m in sent(fx, AssignedMsg).values()} == {0}
    assert {m.assignment.round for m in sent(fx, AssignedMsg).values()} == {1}


def test_failure_echoing_a_dropped_peer_is_charged_to_the_lost_node():
    """A worker failure reported while a member's connection is down (within its
    grace) loses that member instead: no restart is charged and the round's
    reason names the lost node, not the survivor whose collective broke."""
    from rdzv_common.protocol import ExitRecord

    job = form(["a", "b", "c"], spec(min_nodes=1, max_nodes=3, max_restarts=0))
    rounds.disconnect(job, "c", 2.0, grace_s=0.5)
    fx = rounds.fail(job, "a", 0, [ExitRecord(local_rank=0, rank=0, pid=9, exit_code=1, timestamp=2.1)], 2.1)
    assert job.state == JobState.WAITING and job.round == 1 and job.restarts == 0
    assert "c" not in job.nodes and "connection lost" in job.history[-1].reason and "node c" in job.history[-1].reason
    assert set(sent(fx, RestartMsg)) == {"a", "b"}
    rejoin(job, ["a", "b"], 2.2)
    assert job.state == JobState.RUNNING and job.order == ["a", "b"]


def test_failure_after_a_server_restart_spares_nodes_not_back_yet():
    """After a restart, members that have not reconnected yet are not taken for
    dead by a failure report: the failure is charged and they keep their timeout."""
    from rdzv_common.protocol import ExitRecord

    job = rounds.from_record(json.loads(json.dumps(rounds.to_record(form(["a", "b", "c"])))))
    rounds.restored(job, 10.0)
    rounds.join(job, join_msg("a", sp=job.spec, resume=0), 10.1)
    rounds.fail(job, "a", 0, [ExitRecord(local_rank=0, rank=0, pid=9, exit_code=1, timestamp=10.2)], 10.2)
    assert job.restarts == 1 and set(job.nodes) == {"a", "b", "c"} and job.round == 1


def test_below_min_after_a_loss_waits_for_join_timeout_then_fails():
    """When fewer than min_nodes remain, the job waits join_timeout_s for new nodes, then fails."""
    job = form(["a", "b"], spec(min_nodes=2, max_nodes=3))
    rounds.leave(job, "b", "sigterm", 10.0)
    rejoin(job, ["a"], 10.1)
    assert job.forming and rounds.waiting_info(job, 10.1).text == "1 more node(s) to reach min 2"
    rounds.heartbeat(job, "a", 69.0)
    fx = rounds.tick(job, 69.99)
    assert job.forming and not sent(fx, DoneMsg)
    fx = rounds.tick(job, 70.0)
    assert job.state == JobState.FAILED
    assert job.end_reason == "join timeout: 1 of min 2 nodes joined within 60s"
    assert sent(fx, DoneMsg)["a"].state == "failed"


def test_a_new_node_rescues_a_round_below_min():
    """A node arriving before the join timeout completes a re-formed round at once."""
    job = form(["a", "b"], spec(min_nodes=2, max_nodes=3))
    rounds.leave(job, "b", "sigterm", 10.0)
    rejoin(job, ["a"], 10.1)
    fx = rounds.join(job, join_msg("c", sp=job.spec), 30.0)
    assert job.order == ["a", "c"] and set(sent(fx, AssignedMsg)) == {"a", "c"}


# ------------------------------------------------------------------ success


def test_job_succeeds_when_every_member_succeeded():
    """The job succeeds on the last member's success report, and everyone is told."""
    job = form(["a", "b", "c"], spec(min_nodes=1))
    rounds.join(job, join_msg("d", sp=job.spec), 1.5)
    rounds.tick(job, 2.0)
    rejoin(job, ["a", "b", "c"], 2.0)
    for nid in ["a", "b", "c"]:
        fx = rounds.succeed(job, nid, 1, 3.0)
        assert job.state == JobState.RUNNING and not fx.sends
    fx = rounds.succeed(job, "d", 1, 3.0)
    assert job.state == JobState.SUCCEEDED
    assert sent(fx, DoneMsg) == {
        n: DoneMsg(state="succeeded", reason="all 4 nodes of round 1 succeeded") for n in ["a", "b", "c", "d"]
    }


def test_a_succeeded_node_that_goes_away_opens_no_round():
    """A node that reported success may disconnect and fall silent without a restart."""
    job = form(["a", "b"])
    rounds.succeed(job, "a", 0, 2.0)
    rounds.disconnect(job, "a", 2.1, grace_s=0.1)
    rounds.heartbeat(job, "b", 50.0)
    fx = rounds.tick(job, 50.0)
    assert not fx.sends and job.round == 0 and job.state == JobState.RUNNING
    assert rounds.succeed(job, "b", 0, 51.0).sends and job.state == JobState.SUCCEEDED
