"""The agent's answer to ``restart`` (in process, as tests/unit/test_node_identity.py):
without an assignment it stops its workers and joins again; with one (design.md
"Direct re-formation") it starts that place without a join. Rank 0 whose store
port is taken when its place comes (with a restart or with ``assigned``) reports
that, not charged, and starts nothing."""

from __future__ import annotations

import socket

import pytest
from test_node_identity import A, FakeLink, _error, agent, react, running  # noqa: F401  (agent: the fixture)

from rdzv_client.agent import Agent, Phase
from rdzv_common.errors import ErrorCode
from rdzv_common.protocol import AssignedMsg, FailedMsg, RestartMsg


@pytest.fixture
def started(agent: Agent, monkeypatch) -> list:
    """The assignments the agent started workers for (none are started here)."""
    calls: list = []

    async def start(a) -> None:
        calls.append(a)

    monkeypatch.setattr(agent, "_start_workers", start)
    return calls


def test_a_restart_without_a_place_stops_the_workers_and_joins_again(agent: Agent, started: list) -> None:
    group = running(agent)
    assert react(agent, RestartMsg(round=3, reason="node x lost")) is None
    assert group.calls == [f"stop {agent.cfg.stop_timeout_s:g}"] and started == []
    join = agent.link.joins()[-1]
    assert join.resume_round is None and agent.phase is Phase.JOINING
    assert len(join.direct_ports) == 4  # no health check: it offers direct ports


def test_a_restart_with_its_place_starts_it_without_a_join(agent: Agent, started: list) -> None:
    group = running(agent)
    link: FakeLink = agent.link  # type: ignore[assignment]
    joins = len(link.joins())
    place = A.model_copy(update={"round": 3, "group_rank": 1, "group_world_size": 2, "world_size": 2, "rank_offset": 1})
    assert react(agent, RestartMsg(round=3, reason="node x lost", assignment=place)) is None
    assert group.calls == [f"stop {agent.cfg.stop_timeout_s:g}"] and started == [place]
    assert len(link.joins()) == joins and link.pending == []  # no join; the old round's report dropped
    # the same restart again (a resume heard it twice) changes nothing once the place runs
    agent.session.resume(place)
    assert react(agent, RestartMsg(round=3, reason="node x lost", assignment=place)) is None and started == [place]


def test_a_place_for_another_round_or_job_is_a_protocol_error(agent: Agent, started: list) -> None:
    running(agent)
    link: FakeLink = agent.link  # type: ignore[assignment]
    for wrong in (A.model_copy(update={"round": 4}), A.model_copy(update={"round": 3, "job_id": "other"})):
        react(agent, RestartMsg(round=3, reason="x", assignment=wrong))
    assert started == [] and len(link.protocol_errors) == 2, link.protocol_errors


@pytest.mark.parametrize("how", ["restart", "assigned"])
def test_rank0_whose_store_port_was_taken_reports_it_instead_of_starting(agent: Agent, how: str) -> None:
    """Its place came with a direct restart, or with ``assigned`` after its join: either
    way the port its join offered was free then and is taken now (the workers' store
    could not listen: a charged worker failure). No workers start; the report costs nothing."""
    group = running(agent)
    link: FakeLink = agent.link  # type: ignore[assignment]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        place = A.model_copy(update={"round": 3, "master_port": s.getsockname()[1]})
        if how == "restart":
            assert react(agent, RestartMsg(round=3, reason="node x lost", assignment=place)) is None
        else:
            assert react(agent, RestartMsg(round=3, reason="node x lost")) is None  # stops, joins again
            link.pending.clear()
            assert react(agent, AssignedMsg(assignment=place)) is None
    assert group.calls == [f"stop {agent.cfg.stop_timeout_s:g}"] and agent.group is None  # none started
    assert agent.phase is Phase.REPORTED and agent.assignment == place
    (report,) = link.pending
    assert isinstance(report, FailedMsg) and report.round == 3
    assert [f.reason for f in report.failures] == ["store_port"]
    assert link.joins()[-1].resume_round == 3  # a reconnect keeps it in its round


def test_a_stale_report_answered_after_the_next_round_started_leaves_its_workers_alone(
    agent: Agent, started: list
) -> None:
    """Its workers failed in round 2 (a peer died) and it reported that; the restart
    of round 3 with its place came first, then the server's stale_round for the
    report. The workers of round 3 run on (a server tells a direct session that
    its round is over with a restart, never with stale_round)."""
    running(agent)
    place = A.model_copy(update={"round": 3})
    react(agent, RestartMsg(round=3, reason="node x lost", assignment=place))
    group = running(agent)  # (its workers of round 3, as _start_workers would have them)
    agent.session.resume(place)
    assert react(agent, _error(ErrorCode.STALE_ROUND)) is None
    assert group.calls == [] and agent.phase is Phase.RUNNING and agent.assignment == place
