"""A round's fan-out written from a template (rdzv_server.rounds.templates): each
member's text is byte for byte what pydantic writes for the model validated whole,
and a template that would write anything else is refused when it is made."""

from __future__ import annotations

import json

import pytest

from rdzv_common.protocol import AssignedMsg, Assignment, RestartMsg
from rdzv_server import rounds
from rdzv_server.rounds import forming, templates
from rdzv_server.rounds.templates import Prepared
from tests.unit.test_rounds import join_msg, spec


def _formed(n: int) -> rounds.Job:
    """A running round of ``n`` members: mixed sizes, some answer probes, the job signs its probes."""
    sp = spec(min_nodes=n, max_nodes=n)
    job = rounds.new_job("j", sp, 0.0)
    job.probe_seed = bytes(range(16))
    for i in range(n):
        msg = join_msg(f"n{i}", f"h{i}", sp=sp, lws=(1, 2, 8)[i % 3])
        msg = msg.model_copy(update={"probe_port": 40000 + i if i % 4 else None})
        rounds.join(job, msg, 1.0, seen_addr=f"10.0.{i // 200}.{i % 200 + 1}")
    assert job.state.value == "running"
    return job


@pytest.mark.parametrize("n", [1, 2, 3, 9])
def test_each_assigned_is_what_pydantic_writes_for_the_whole_model(n: int) -> None:
    job = _formed(n)
    members = [job.nodes[x] for x in job.order]
    got = forming.messages(job, members)
    assert all(isinstance(m, Prepared) and m.op == "assigned" for m in got)
    want = [AssignedMsg(assignment=forming._assignment(job, node)).model_dump_json() for node in members]
    assert [m.text for m in got] == want
    assert [m.model() for m in got] == [AssignedMsg(assignment=forming._assignment(job, node)) for node in members]


def test_a_carried_member_gets_its_restart_with_a_reason_that_needs_escaping() -> None:
    job = _formed(5)
    members = [job.nodes[x] for x in job.order]
    reason = 'node "n9" lost \\ its connection\n\u00e9\u2603 \x01'
    carried = {"n1", "n3"}
    got = forming.messages(job, members, reason, carried)
    for node, msg in zip(members, got, strict=True):
        a = forming._assignment(job, node)
        if node.node_id in carried:
            want = RestartMsg(round=job.round, reason=reason, assignment=a).model_dump_json()
        else:
            want = AssignedMsg(assignment=a).model_dump_json()
        assert msg.text == want, node.node_id


def test_the_templates_own_fields_are_the_completions_and_every_other_field_is_the_rounds() -> None:
    """A field added to Assignment fails here until it is placed: the round's (written once, from
    the first member's) or a member's own (templates.OWN, forming._own, RoundTemplate.assignment)."""
    job = _formed(3)
    node = job.nodes["n1"]
    own = forming._own(job, node, lambda i: f"peer {i}")  # the values in OWN's order, as the template takes them
    a = forming._assignment(job, node)
    assert own[:3] == tuple(getattr(a, name) for name in templates.OWN[:3]) and len(own) == len(templates.OWN)
    round_fields = {"job_id", "round", "group_world_size", "world_size", "master_addr", "master_port"}
    round_fields |= {"max_restarts", "restarts"}
    assert set(Assignment.model_fields) == round_fields | set(templates.OWN)


def test_a_template_that_would_not_write_what_pydantic_writes_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    job = _formed(3)
    first = forming._assignment(job, job.nodes[job.order[0]])
    monkeypatch.setattr(templates, "to_json", lambda v: json.dumps(v).encode() + b" ")  # a space too many
    with pytest.raises(AssertionError, match="the template wrote"):
        templates.RoundTemplate(first, None)


def test_a_restart_without_the_rounds_reason_is_refused() -> None:
    job = _formed(2)
    tpl = templates.RoundTemplate(forming._assignment(job, job.nodes["n0"]), None)
    with pytest.raises(AssertionError, match="reason"):
        tpl.restart("{}")


def test_a_probe_key_the_first_member_does_not_hold_is_still_validated() -> None:
    job = _formed(2)
    first = forming._assignment(job, job.nodes["n0"])  # n0 answers no probes: no key of its own
    assert first.probe_key is None
    with pytest.raises(ValueError, match="probe_key"):
        templates.RoundTemplate(first, "not hex")
