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
