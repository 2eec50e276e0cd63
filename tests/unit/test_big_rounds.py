"""A big round (issue 24): its formation is not a flood of events (item 4): node_joined for
the first MAX_JOIN_EVENTS nodes waiting in a forming round, then the round's
one round_completed counts the new members (new_nodes). A small job keeps one
node_joined per node. And its status pushes stay under a rate in all."""

from __future__ import annotations

from rdzv_server import rounds
from rdzv_server.rounds.events import MAX_JOIN_EVENTS
from tests.unit.test_rounds import join_msg, spec


def _kinds(n: int) -> tuple[list[rounds.Event], rounds.Job]:
    sp = spec(min_nodes=n, max_nodes=n)
    job = rounds.new_job("j", sp, 0.0)
    evs: list[rounds.Event] = []
    for i in range(n):
        evs += rounds.join(job, join_msg(f"n{i}", sp=sp), 1.0).events
    assert job.state.value == "running"
    return evs, job


def test_a_big_formation_has_a_bounded_number_of_join_events_and_one_count():
    n = MAX_JOIN_EVENTS + 40
    evs, job = _kinds(n)
    joined = [e for e in evs if e.kind == "node_joined"]
    assert [e.node for e in joined] == [f"n{i}" for i in range(MAX_JOIN_EVENTS)]  # one each before
    (done,) = [e for e in evs if e.kind == "round_completed"]
    assert done.fields["nodes"] == n and done.fields["new_nodes"] == n


def test_a_small_formation_keeps_one_join_event_per_node():
    evs, _ = _kinds(5)
    assert [e.node for e in evs if e.kind == "node_joined"] == [f"n{i}" for i in range(5)]
    (done,) = [e for e in evs if e.kind == "round_completed"]
    assert done.fields["new_nodes"] == 5


def test_a_re_formed_round_counts_only_its_new_members():
    evs, job = _kinds(4)
    rounds.leave(job, "n3", "bye", 2.0)  # round 1 opens for the other three
    sp = job.spec
    got: list[rounds.Event] = []
    for i in range(3):
        got += rounds.join(job, join_msg(f"n{i}", sp=sp), 2.0).events
    got += rounds.join(job, join_msg("n9", sp=sp), 2.0).events
    (done,) = [e for e in got if e.kind == "round_completed"]
    assert done.fields["new_nodes"] == 1 and [e.node for e in got if e.kind == "node_joined"] == ["n9"]


def test_a_big_forming_round_pushes_its_status_less_often():
    """StatusMsg goes to every waiting node at most MAX_STATUS_RATE messages a second
    in all: 1 s apart for a small round, len(waiting) / MAX_STATUS_RATE for a big one
    (every second to 16,384 nodes was 16,384 messages a second while it formed)."""
    from rdzv_common.protocol import StatusMsg
    from rdzv_server.rounds.machine import MAX_STATUS_RATE, STATUS_PUSH_INTERVAL_S

    for n in (3, int(MAX_STATUS_RATE * 3)):
        sp = spec(min_nodes=n + 1, max_nodes=n + 1)
        job = rounds.new_job("j", sp, 0.0)
        for i in range(n):
            rounds.join(job, join_msg(f"n{i}", sp=sp), 0.0)
        fx = rounds.tick(job, 0.5)
        assert sum(isinstance(m, StatusMsg) for _, m in fx.sends) == n
        assert job.next_status_at - 0.5 == max(STATUS_PUSH_INTERVAL_S, n / MAX_STATUS_RATE)


def test_each_members_assignment_is_what_validating_it_whole_makes():
    """A completion validates what all members share once and copies it per member with
    its own fields (rounds.forming.assigned): every copy must equal the member's assignment
    built and validated whole, field for field and byte for byte, whatever differs between
    members (rank, size, offset, watch peers, whether it gets the probe key)."""
    from rdzv_common.protocol import AssignedMsg
    from rdzv_server.rounds.forming import _assignment

    n = 7
    sp = spec(min_nodes=n, max_nodes=n)
    job = rounds.new_job("j", sp, 0.0)
    job.probe_seed = bytes(range(16))
    sends = []
    for i in range(n):
        msg = join_msg(f"n{i}", f"h{i}", sp=sp, lws=(1, 2, 4, 8)[i % 4], rank=(n - 1 if i == 2 else None))
        msg = msg.model_copy(update={"probe_port": 40000 + i if i % 3 else None})
        sends += rounds.join(job, msg, 1.0, seen_addr=f"10.0.0.{i + 1}").messages()
    got = {node: m.assignment for node, m in sends if isinstance(m, AssignedMsg)}
    members = [job.nodes[node_id] for node_id in job.order]
    whole = {node.node_id: _assignment(job, node) for node in members}
    assert got == whole
    assert [got[k].model_dump_json() for k in job.order] == [whole[k].model_dump_json() for k in job.order]
    assert len({a.rank_offset for a in got.values()}) == n
    assert {a.local_world_size for a in got.values()} == {1, 2, 4, 8}
    assert sum(a.probe_key is None for a in got.values()) == 3 and got["n2"].group_rank == n - 1
