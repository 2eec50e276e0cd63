"""One node identity on the client (issue 21, item 3): what a server message
or a link error means is classified once (rdzv_client/session.py
``classify``), and the agent's and the torchrun plugin's reactions follow it.

The agent runs in process here (a real ``Agent`` from real flags) against a
recording link and a stand-in worker group: a unit of its reactions, without
processes or a server. tests/e2e/test_agent_behaves.py and the plugin e2e tests
hold the claims about real processes."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from rdzv_client.agent import EXIT_USAGE, Agent, Phase, build_parser, config_from_args
from rdzv_client.service import refusal
from rdzv_client.session import NEW_NODE_CODES, Meaning, NodeSession, classify
from rdzv_common.errors import ErrorCode, RdzvError, error_from_body
from rdzv_common.protocol import (
    AckMsg,
    AssignedMsg,
    Assignment,
    ErrorMsg,
    EvictedMsg,
    ExitRecord,
    FailedMsg,
    JobSpec,
    JoinedMsg,
    JoinMsg,
)

A = Assignment(
    job_id="j",
    round=2,
    group_rank=0,
    group_world_size=1,
    local_world_size=1,
    rank_offset=0,
    world_size=1,
    master_addr="127.0.0.1",
    master_port=29555,
    max_restarts=3,
    restarts=0,
)
REC = ExitRecord(local_rank=0, rank=0, pid=1, exit_code=1, message="boom", timestamp=1.0)


def _error(code: ErrorCode) -> ErrorMsg:
    return ErrorMsg(code=code, message=f"the server says {code.value}")


class FakeLink:
    """What the session and the agent use of AgentLink, recorded."""

    def __init__(self) -> None:
        self.intent: dict[str, Any] | None = None
        self.intents: list[tuple[dict[str, Any] | None, bool]] = []
        self.pending: list[object] = []
        self.protocol_errors: list[str] = []
        self.observer: Any = None
        self.connected = asyncio.Event()

    def set_intent(self, msg: dict[str, Any] | None, send: bool = True) -> None:
        self.intent = msg
        self.intents.append((msg, send))

    def report(self, msg: object) -> None:
        self.pending.append(msg)

    def clear_reports(self) -> None:
        self.pending.clear()

    def protocol_error(self, what: str) -> None:
        self.protocol_errors.append(what)

    def joins(self) -> list[JoinMsg]:
        return [JoinMsg.model_validate_json(json.dumps(m)) for m, _ in self.intents if m is not None]


class FakeGroup:
    """A running worker group: records how it was stopped."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.pids = [4242]

    def kill_now(self) -> None:
        self.calls.append("kill_now")

    async def stop(self, timeout: float = 10.0, sig: int = 15) -> list[object]:
        self.calls.append(f"stop {timeout:g}")
        return []

    async def wait(self) -> list[object]:
        await asyncio.sleep(3600)
        return []


@pytest.fixture
def agent(tmp_path, monkeypatch) -> Iterator[Agent]:
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the agent's private directory
    cfg = config_from_args(build_parser().parse_args(["--endpoint", "127.0.0.1:1", "--job-id", "j", "true"]))
    a = Agent(cfg)
    a.session.addr = "127.0.0.1"
    a.session.link = FakeLink()  # type: ignore[assignment]
    yield a
    a.watch.close()
    a._dir.close()


def running(agent: Agent) -> FakeGroup:
    """The agent as it runs round A, a failure report pending."""
    group = FakeGroup()
    agent.group = group  # type: ignore[assignment]
    agent.phase = Phase.RUNNING
    agent.session.resume(A)
    agent.session.report_failed(A.round, [REC])
    return group


def react(agent: Agent, msg: object) -> int | None:
    return asyncio.run(agent._on_message(msg))  # type: ignore[arg-type]


# ------------------------------------------------------------ the one classification


def test_new_node_codes_are_evicted_and_node_secret_mismatch() -> None:
    assert {ErrorCode.EVICTED, ErrorCode.NODE_SECRET_MISMATCH} == NEW_NODE_CODES


@pytest.mark.parametrize(
    ("msg", "meaning", "code"),
    [
        (EvictedMsg(reason="gone"), Meaning.NEW_NODE, None),
        (_error(ErrorCode.EVICTED), Meaning.NEW_NODE, ErrorCode.EVICTED),
        (_error(ErrorCode.NODE_SECRET_MISMATCH), Meaning.NEW_NODE, ErrorCode.NODE_SECRET_MISMATCH),
        (_error(ErrorCode.STALE_ROUND), Meaning.REFUSED, ErrorCode.STALE_ROUND),
        (_error(ErrorCode.UNAVAILABLE), Meaning.REFUSED, ErrorCode.UNAVAILABLE),
        (_error(ErrorCode.JOB_SECRET_MISMATCH), Meaning.REFUSED, ErrorCode.JOB_SECRET_MISMATCH),
        (error_from_body("unauthorized", "the server refused the token"), Meaning.LINK_ERROR, ErrorCode.UNAUTHORIZED),
        (AckMsg(of="failed"), Meaning.NEWS, None),
        (AssignedMsg(assignment=A), Meaning.NEWS, None),
    ],
)
def test_classify(msg: object, meaning: Meaning, code: ErrorCode | None) -> None:
    heard = classify(msg)
    assert (heard.meaning, heard.code, heard.msg) == (meaning, code, msg)


def test_the_link_backs_off_on_a_new_node_even_while_served_and_on_any_refusal_of_a_join() -> None:
    """The link's reading (service.refusal) is the same classification."""
    for code in (ErrorCode.EVICTED, ErrorCode.NODE_SECRET_MISMATCH):
        assert refusal(_error(code), serving=True) == f"join refused: {code.value}: the server says {code.value}"
    assert refusal(EvictedMsg(reason="gone"), serving=True) == "join refused: evicted: gone"
    assert refusal(_error(ErrorCode.STALE_ROUND), serving=True) is None  # refuses a report: passed on
    assert (
        refusal(_error(ErrorCode.STALE_ROUND), serving=False)
        == "join refused: stale_round: the server says stale_round"
    )


# ------------------------------------------------------------ the session owns the identity


def test_the_session_learns_its_secret_and_run_from_joined_and_the_intent_carries_them() -> None:
    s = NodeSession(job_id="j", host="h", nproc=1, spec=JobSpec(min_nodes=1, max_nodes=1), addr="127.0.0.1")
    link = FakeLink()
    s.link = link  # type: ignore[assignment]
    assert link.observer == s.heard  # the link hands every served message to the session first
    s.resume(A)
    assert link.intent is not None and link.intent["node_secret"] is None and link.intent["run"] is None
    link.observer(JoinedMsg(node_id=s.node_id, round=2, heartbeat_s=1.0, node_secret="n" * 32, run=7))
    assert (s.node_secret, s.run) == ("n" * 32, 7)
    assert (link.intent["node_secret"], link.intent["run"], link.intent["resume_round"]) == ("n" * 32, 7, 2)
    assert link.intent["master_port"] == A.master_port  # the same intent, now identified
    old = s.node_id
    s.evicted()
    (new,) = link.joins()[-1:]
    assert new.node_id != old and new.node_secret is None and new.run == 7  # the run whatever the node id


@pytest.mark.parametrize("host", ["gpu-é1", "ñode", "节点", "host\u0663"])
def test_a_non_ascii_host_name_makes_a_join_the_server_takes(host: str) -> None:
    """str.isalnum() is true of é, ñ, 节 and Arabic-indic digits: the node id and
    host label kept them, and the server refused the join (its patterns are ASCII)."""
    s = NodeSession(job_id="j", host=host, nproc=1, spec=JobSpec(min_nodes=1, max_nodes=1), addr="127.0.0.1")
    msg = JoinMsg.model_validate_json(json.dumps(s.join_msg()))  # the server's model: raises on a bad id or host
    assert msg.node_id == s.node_id and msg.host.isascii()


# ------------------------------------------------------------ the agent's reactions


@pytest.mark.parametrize(
    "msg",
    [EvictedMsg(reason="gone"), _error(ErrorCode.EVICTED), _error(ErrorCode.NODE_SECRET_MISMATCH)],
    ids=["evicted", "error evicted", "error node_secret_mismatch"],
)
def test_the_agent_fences_then_joins_as_a_new_node(agent: Agent, msg: object) -> None:
    group = running(agent)
    link: FakeLink = agent.link  # type: ignore[assignment]
    old = agent.node_id
    assert react(agent, msg) is None
    assert group.calls == ["kill_now", "stop 1"]  # workers die first
    assert agent.group is None and agent.phase is Phase.JOINING and agent.assignment is None
    assert agent.node_id != old and link.pending == []  # the old node's reports are dropped
    join = link.joins()[-1]
    assert (join.node_id, join.node_secret, join.resume_round, link.intents[-1][1]) == (agent.node_id, None, None, True)


def test_stale_round_while_running_stops_the_workers_and_rejoins_as_the_same_node(agent: Agent) -> None:
    """(An agent that offers no direct ports: with them, tests/unit/test_agent_restart.py.)"""
    agent.session.direct = False
    group = running(agent)
    link: FakeLink = agent.link  # type: ignore[assignment]
    old = agent.node_id
    assert react(agent, _error(ErrorCode.STALE_ROUND)) is None
    assert group.calls == [f"stop {agent.cfg.stop_timeout_s:g}"] and agent.phase is Phase.JOINING
    assert agent.node_id == old and link.joins()[-1].node_id == old and link.joins()[-1].resume_round is None


def test_stale_round_after_a_reported_success_is_done(agent: Agent) -> None:
    agent.phase = Phase.SUCCEEDED
    assert react(agent, _error(ErrorCode.STALE_ROUND)) == 0


def test_a_stale_report_is_said_as_harmless(agent: Agent, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 25: "server: failure report ... is stale: ..." read like an error after a report the round change had
    made moot; the agent's line says it is harmless (the server's words only at debug level)."""
    agent.phase = Phase.REPORTED
    stale = ErrorMsg(code=ErrorCode.STALE_ROUND, message="failure report for round 0 from node 'n' is stale: ...")
    with caplog.at_level(logging.INFO, logger="rdzv_agent"):
        assert react(agent, stale) is None
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert said == ["the round changed before this node's report arrived; nothing to do, nothing charged"], said


@pytest.mark.parametrize("code", [ErrorCode.JOB_SECRET_MISMATCH, ErrorCode.SPEC_MISMATCH, ErrorCode.JOB_FINISHED])
def test_a_fatal_refusal_stops_the_workers_and_exits_2(agent: Agent, code: ErrorCode) -> None:
    group = running(agent)
    old = agent.node_id
    assert react(agent, _error(code)) == EXIT_USAGE
    assert group.calls == [f"stop {agent.cfg.stop_timeout_s:g}"] and agent.node_id == old


def test_unavailable_keeps_everything_and_warns(agent: Agent, caplog: pytest.LogCaptureFixture) -> None:
    group = running(agent)
    link: FakeLink = agent.link  # type: ignore[assignment]
    old = agent.node_id
    with caplog.at_level(logging.WARNING, logger="rdzv_agent"):
        assert react(agent, _error(ErrorCode.UNAVAILABLE)) is None
    assert group.calls == [] and agent.node_id == old and agent.phase is Phase.RUNNING
    assert [type(m) for m in link.pending] == [FailedMsg]  # still to be re-sent after a reconnect
    assert any("server unavailable" in r.getMessage() for r in caplog.records)


def test_another_refusal_of_a_report_is_said_and_the_node_stays(agent: Agent, caplog) -> None:
    group = running(agent)
    old = agent.node_id
    with caplog.at_level(logging.WARNING, logger="rdzv_agent"):
        assert react(agent, _error(ErrorCode.RATE_LIMITED)) is None
    assert group.calls == [] and agent.node_id == old
    assert any("server error rate_limited" in r.getMessage() for r in caplog.records)


def test_the_links_own_error_stops_the_workers_and_exits_2(agent: Agent) -> None:
    group = running(agent)
    err = error_from_body("unauthorized", "the server refused the token")
    assert isinstance(err, RdzvError)
    assert react(agent, err) == EXIT_USAGE
    assert group.calls == [f"stop {agent.cfg.stop_timeout_s:g}"]


# ------------------------------------------------------------ the torchrun plugin's reactions


def _handler() -> Any:
    pytest.importorskip("torch")
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from rdzv_client.torch_plugin import RdzvRendezvousHandler

    params = RendezvousParameters(
        backend="rdzv", endpoint="127.0.0.1:1", run_id="j", min_nodes=1, max_nodes=1, local_addr="127.0.0.1"
    )
    h = RdzvRendezvousHandler(params)
    h.session.link = FakeLink()
    return h


def _next_round(h: Any, *said: object) -> Any:
    """The plugin's rendezvous wait, the link having handed over ``said`` (classified as its dispatcher does)."""

    async def go() -> Any:
        h._inbox, h._news = asyncio.Queue(), asyncio.Event()
        for msg in said:
            h._inbox.put_nowait(classify(msg))
        return await asyncio.wait_for(h._next_round(), 10)

    return asyncio.run(go())


@pytest.mark.parametrize(
    "msg",
    [EvictedMsg(reason="gone"), _error(ErrorCode.EVICTED), _error(ErrorCode.NODE_SECRET_MISMATCH)],
    ids=["evicted", "error evicted", "error node_secret_mismatch"],
)
def test_the_plugin_joins_as_a_new_node_then_takes_its_round(msg: object) -> None:
    h = _handler()
    first = h.node_id
    assert _next_round(h, msg, AssignedMsg(assignment=A)) == A
    link: FakeLink = h.session.link
    joins = link.joins()
    assert [j.node_id for j in joins] == [first, h.node_id, h.node_id] and h.node_id != first
    assert joins[-1].resume_round == A.round  # then it runs the round as the new node


@pytest.mark.parametrize("code", [ErrorCode.STALE_ROUND, ErrorCode.UNAVAILABLE, ErrorCode.RATE_LIMITED])
def test_the_plugin_waits_on_through_a_stale_round_or_a_not_now(code: ErrorCode) -> None:
    h = _handler()
    first = h.node_id
    assert _next_round(h, _error(code), AssignedMsg(assignment=A)) == A
    assert h.node_id == first


def test_the_plugin_ends_its_rendezvous_on_a_refusal_or_the_links_error() -> None:
    from torch.distributed.elastic.rendezvous import RendezvousError

    with pytest.raises(RendezvousError, match="refused this node: the server says job_secret_mismatch"):
        _next_round(_handler(), _error(ErrorCode.JOB_SECRET_MISMATCH))
    with pytest.raises(RendezvousError, match="the server refused the token"):
        _next_round(_handler(), error_from_body("unauthorized", "the server refused the token"))
