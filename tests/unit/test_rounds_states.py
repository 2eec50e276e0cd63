"""Node states as a table of allowed transitions, the named cases of a join,
broadcasts built once, and records saved by older code still loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_rounds import form, join_msg, live_counts, record, sent, spec

from rdzv_common.protocol import (
    AssignedMsg,
    EvictedError,
    ExitRecord,
    JobState,
    JoinedMsg,
    RestartMsg,
    SpareMsg,
    StaleRoundError,
    StatusMsg,
)
from rdzv_server import rounds
from rdzv_server.rounds import NodeState

EXIT = ExitRecord(local_rank=0, rank=0, pid=1, exit_code=1)
OLD_RECORDS = Path(__file__).parent / "data" / "rounds_records_v0.json"


# ----------------------------------------------------------------- the table


def test_state_values_are_the_strings_records_store():
    """Persisted records hold the state as a string: the enum's values are those strings."""
    assert [s.value for s in NodeState] == ["waiting", "rejoining", "running", "succeeded", "spare"]
    assert tuple(NodeState) == (rounds.WAITING, rounds.REJOINING, rounds.RUNNING, rounds.SUCCEEDED, rounds.SPARE)


def _pair(job: rounds.Job, state: NodeState | None) -> rounds.Node:
    node = rounds.Node(
        node_id="x", host="x", addr="x", local_world_size=1, master_port=1, requested_rank=None, last_seen=0.0
    )
    job.nodes["x"] = node
    if state is not None:  # set up directly: the path there is not under test
        node.state, job.counts[state] = state, 1
    return node


@pytest.mark.parametrize("frm,to", [(f, t) for f, ts in rounds.TRANSITIONS.items() for t in sorted(ts, key=str)])
def test_every_allowed_transition_keeps_counts(frm, to):
    job = rounds.new_job("j", spec(), 0.0)
    node = _pair(job, frm)
    rounds.move(job, node, to)
    if to is None:
        assert "x" not in job.nodes and live_counts(job) == {}
    else:
        assert node.state is to and live_counts(job) == {to: 1}


ILLEGAL = [
    (f, t)
    for f in [None, *NodeState]
    for t in [*NodeState, None]
    if t not in rounds.TRANSITIONS.get(f, ()) and not (f is None and t is None)
]


def test_the_table_forbids_what_the_machine_never_does():
    assert (NodeState.SUCCEEDED, NodeState.RUNNING) in ILLEGAL
    assert (NodeState.WAITING, NodeState.REJOINING) in ILLEGAL
    assert (None, NodeState.RUNNING) in ILLEGAL
    assert (NodeState.SPARE, NodeState.RUNNING) in ILLEGAL


@pytest.mark.parametrize("frm,to", ILLEGAL)
def test_an_illegal_transition_raises_and_changes_nothing(frm, to):
    job = rounds.new_job("j", spec(), 0.0)
    node = _pair(job, frm)
    before = (dict(job.counts), dict(job.nodes), node.state)
    with pytest.raises(rounds.IllegalTransitionError, match="illegal node state transition"):
        rounds.move(job, node, to)
    assert (dict(job.counts), dict(job.nodes), node.state) == before


# ------------------------------------------------------ the cases of a join


def test_join_new_node_while_forming_waits_and_gets_its_secret():
    job = rounds.new_job("j", spec(), 0.0)
    fx = rounds.join(job, join_msg("a"), 0.0, node_secret="sa")
    assert job.nodes["a"].state is NodeState.WAITING
    assert sent(fx, JoinedMsg)["a"].node_secret == "sa"


def test_join_new_node_while_running_queues_for_scale_up_or_is_a_spare():
    job = form(["a", "b"], spec(min_nodes=1, max_nodes=3))
    fx = rounds.join(job, join_msg("c", sp=job.spec), 2.0, node_secret="sc")
    assert job.nodes["c"].state is NodeState.WAITING and job.scale_up_deadline == 2.5
    assert sent(fx, JoinedMsg)["c"].round == job.round + 1
    fx = rounds.join(job, join_msg("d", sp=job.spec), 2.0, node_secret="sd")
    assert job.nodes["d"].state is NodeState.SPARE and "d" in sent(fx, SpareMsg)


def test_reconnect_of_a_running_member_resends_its_assignment_and_changes_nothing_else():
    job = form(["a", "b"])
    rounds.disconnect(job, "a", 2.0, grace_s=0.5)
    rec = record(job)
    fx = rounds.join(job, join_msg("a", sp=job.spec, resume=0), 2.1)
    assert [m for _, m in fx.messages()] == [AssignedMsg(assignment=rounds.forming._assignment(job, job.nodes["a"]))]
    assert job.nodes["a"].connected and job.nodes["a"].lost_deadline is None
    after = record(job)
    for d in (rec, after):
        for n in d["nodes"]:
            for k in ("connected", "lost_deadline", "last_seen", "dropped"):
                n.pop(k)
    assert after == rec


def test_resume_of_a_rejoining_node_is_told_to_restart():
    job = form(["a", "b"], spec(min_nodes=2))
    rounds.fail(job, "b", 0, [EXIT], 2.0)
    fx = rounds.join(job, join_msg("a", sp=job.spec, resume=0), 2.1)
    assert sent(fx, RestartMsg)["a"].round == 1 and job.nodes["a"].state is NodeState.REJOINING


def test_resume_of_an_unknown_or_succeeded_node_is_refused():
    job = form(["a", "b"])
    with pytest.raises(EvictedError):
        rounds.join(job, join_msg("z", sp=job.spec, resume=0), 2.0)
    rounds.succeed(job, "a", 0, 2.0)
    with pytest.raises(StaleRoundError):
        rounds.join(job, join_msg("a", sp=job.spec, resume=0), 2.1)


def test_rejoin_of_a_known_node_updates_it_and_issues_no_secret():
    job = form(["a", "b"], spec(min_nodes=2))
    rounds.fail(job, "b", 0, [EXIT], 2.0)
    fx = rounds.join(job, join_msg("a", "a-moved", sp=job.spec, port=4000), 2.1)
    node = job.nodes["a"]
    assert (node.state, node.host, node.master_port) == (NodeState.WAITING, "a-moved", 4000)
    assert sent(fx, JoinedMsg)["a"].node_secret is None


# ------------------------------------------------------------ broadcasts


def test_restart_spare_and_status_messages_are_built_once_per_broadcast():
    """One RestartMsg object for all rejoining members, one SpareMsg for all
    spares, one StatusMsg for all waiting nodes (the store serializes each once)."""
    job = form(["a", "b", "c"], spec(min_nodes=3, max_nodes=3))
    for nid in ("d", "e"):
        rounds.join(job, join_msg(nid, sp=job.spec), 2.0)
    fx = rounds.fail(job, "a", 0, [EXIT], 2.0)
    restarts = list(sent(fx, RestartMsg).values())
    assert len(restarts) == 3 and all(m is restarts[0] for m in restarts)
    fx = rounds.tick(job, 5.0)
    status = list(sent(fx, StatusMsg).values())
    assert len(status) == 2 and all(m is status[0] for m in status)  # d and e wait; a, b, c rejoin
    for nid in ("a", "b"):
        rounds.join(job, join_msg(nid, sp=job.spec), 5.1)
    fx = rounds.join(job, join_msg("c", sp=job.spec), 5.1)  # the last member back: 5 wait for 3 slots
    assert job.state == JobState.RUNNING
    spares = list(sent(fx, SpareMsg).values())
    assert len(spares) == 2 and all(m is spares[0] for m in spares)


# --------------------------------------------------------------- records


@pytest.mark.parametrize("index", [0, 1])
def test_a_record_saved_by_the_old_code_loads(index):
    """Records written before node states were an enum (states as plain strings)
    load into NodeState members with the right counts, and save back unchanged."""
    old = json.loads(OLD_RECORDS.read_text())[index]
    job = rounds.from_record(old)
    assert all(type(n.state) is NodeState for n in job.nodes.values())
    assert live_counts(job) == {
        s: sum(1 for n in old["nodes"] if n["state"] == s.value)
        for s in NodeState
        if any(n["state"] == s.value for n in old["nodes"])
    }
    assert record(job) == old
    rounds.view(job, 200.0)
    rounds.tick(job, 101.0)  # and the machine runs on from it
