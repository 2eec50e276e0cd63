"""The node session both rdzv-agent and the torchrun plugin drive
(rdzv_client/session.py): joins, resume, eviction, reports, assignment checks,
the server-timeout bookkeeping. A recording link stands in for AgentLink (a
unit); the agent and plugin e2e tests hold the claims about real processes."""

from __future__ import annotations

import json

import pytest
from test_ports import plain_bind

from rdzv_client.session import (
    DIRECT_PORTS,
    OUTAGE_LOG_EVERY_S,
    NodeSession,
    OutageWatch,
    host_label,
    new_node_id,
    port_taken,
)
from rdzv_common.protocol import Assignment, ExitRecord, FailedMsg, JobSpec, JoinMsg, LeaveMsg, SucceededMsg

A = Assignment(
    job_id="j",
    round=3,
    group_rank=0,
    group_world_size=1,
    local_world_size=2,
    rank_offset=0,
    world_size=2,
    master_addr="127.0.0.1",
    master_port=29555,
    max_restarts=3,
    restarts=0,
)


class RecordingLink:
    def __init__(self) -> None:
        self.intents: list[tuple[object, bool]] = []
        self.reports: list[object] = []
        self.cleared = 0

    def set_intent(self, msg, send: bool = True) -> None:
        # a join is a plain JSON object: read it as the server does
        self.intents.append((None if msg is None else JoinMsg.model_validate_json(json.dumps(msg)), send))

    def report(self, msg) -> None:
        self.reports.append(msg)

    def clear_reports(self) -> None:
        self.cleared += 1
        self.reports.clear()


@pytest.fixture
def session() -> NodeSession:
    s = NodeSession(
        job_id="j",
        host="host a",
        nproc=2,
        spec=JobSpec(min_nodes=1, max_nodes=2),
        addr="127.0.0.1",
        job_secret="s3cret-0123456789abcdef",
        requested_rank=1,
    )
    s.link = RecordingLink()
    return s


def test_join_builds_a_fresh_join_and_forgets_the_round(session: NodeSession) -> None:
    session.assignment = A
    session.join()
    ((msg, send),) = session.link.intents
    assert send is True and session.assignment is None
    assert (msg.job_id, msg.node_id, msg.host, msg.local_world_size, msg.requested_rank) == (
        "j",
        session.node_id,
        "host-a",
        2,
        1,
    )
    assert msg.resume_round is None and msg.job_secret == "s3cret-0123456789abcdef" and 0 < msg.master_port < 65536


def test_resume_keeps_the_round_and_its_master_port_without_sending(session: NodeSession) -> None:
    session.resume(A)
    ((msg, send),) = session.link.intents
    assert send is False and session.assignment is A
    assert (msg.resume_round, msg.master_port) == (3, 29555)


def test_a_direct_session_offers_fresh_distinct_ports_on_every_join_and_resume(session: NodeSession) -> None:
    assert session.direct is False
    session.join()
    assert session.link.intents[-1][0].direct_ports == []  # (the plugin's: it joins again after each restart)
    session.direct = True
    session.join()
    session.resume(A)
    for msg, _ in session.link.intents[1:]:
        ports = msg.direct_ports
        assert len(ports) == DIRECT_PORTS and len(set(ports)) == DIRECT_PORTS and msg.master_port not in ports
        assert not any(port_taken(p) for p in ports)


def test_port_taken_is_true_while_another_socket_listens_on_it() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert port_taken(port)
    assert not port_taken(port)


def test_the_ports_a_join_offers_are_held_until_the_next_offer(session: NodeSession) -> None:
    """rdzv_client.ports: a plain bind of them is refused while they are offered; the
    next join's offer lets them go (a resume keeps its master_port)."""
    session.join()
    first = session.link.intents[-1][0]
    offered = [first.master_port, *first.direct_ports]
    assert sorted(session.ports.ports) == sorted(offered) and not any(plain_bind(p) for p in offered)
    session.join()
    assert all(plain_bind(p) for p in offered)


def test_eviction_is_a_new_node_whose_old_reports_are_dropped(session: NodeSession) -> None:
    old = session.node_id
    session.report_succeeded(3)
    session.evicted()
    assert session.node_id != old and session.link.cleared == 1 and session.link.reports == []
    ((msg, send),) = session.link.intents
    assert msg.node_id == session.node_id and msg.node_secret is None and send is True


def test_reports(session: NodeSession) -> None:
    rec = ExitRecord(local_rank=0, rank=0, pid=1, exit_code=1, message="boom", timestamp=1.0)
    session.report_failed(3, [rec])
    session.report_succeeded(4)
    session.leave("bye")
    failed, ok, leave = session.link.reports
    assert isinstance(failed, FailedMsg) and failed.round == 3 and failed.failures == [rec]
    assert isinstance(ok, SucceededMsg) and ok.round == 4
    assert isinstance(leave, LeaveMsg) and leave.reason == "bye"
    assert session.link.intents == [(None, False)]  # a node that left does not rejoin on reconnect


def test_check_assignment(session: NodeSession) -> None:
    assert session.check_assignment(A) is None
    assert "job 'other'" in session.check_assignment(A.model_copy(update={"job_id": "other"}))
    assert "4 local worker(s)" in session.check_assignment(A.model_copy(update={"local_world_size": 4}))


def test_node_ids_and_host_labels() -> None:
    assert new_node_id("a b/c") != new_node_id("a b/c")
    assert new_node_id("...").startswith("node-") and new_node_id("a b").startswith("a-b-")
    assert host_label("") == "node" and host_label("x\ny") == "x-y" and len(host_label("h" * 999)) == 255


def test_outage_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr("rdzv_client.session.time.monotonic", lambda: now[0])
    w = OutageWatch(timeout_s=60)
    assert w.check(0) is None and w.check(1.0) is None  # a reconnect is not news
    assert w.check(0) is None  # nothing was said, so nothing to take back
    first = w.check(3.0)
    assert (first.kind, first.down, first.left) == ("notice", 3.0, 57.0)
    now[0] += 1
    assert w.check(4.0).kind == "ongoing"
    now[0] += OUTAGE_LOG_EVERY_S
    assert w.check(34.0).kind == "notice"
    assert w.check(60.0).kind == "give_up"
    assert w.check(0).kind == "back"
    assert w.check(0) is None
