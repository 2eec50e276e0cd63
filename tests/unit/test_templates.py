"""A round's fan-out written from a template (rdzv_server.rounds.templates): each
member's text is byte for byte what pydantic writes for the model validated whole,
and a template that would write anything else is refused when it is made."""

from __future__ import annotations

import json

import pytest

from rdzv_common.protocol import AssignedMsg, Assignment, JoinedMsg, RestartMsg, WaitingInfo
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
    assert set(Assignment.model_fields) == set(forming._shared(job)) | set(templates.OWN)


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


def _whole(job: rounds.Job, node: rounds.Node, restart: bool = False) -> str:
    a = forming._assignment(job, node)
    if restart:
        return RestartMsg(round=job.round, reason=job.history[-1].reason, assignment=a).model_dump_json()
    return AssignedMsg(assignment=a).model_dump_json()


def test_a_member_told_again_gets_what_pydantic_writes_from_one_template_per_round() -> None:
    """A reconnect's ``assigned`` and a missed restart's place (rounds.joins) come from the
    round's template kept on the job: byte for byte the whole model's text, for every member."""
    job = _formed(9)
    members = [job.nodes[x] for x in job.order]
    got = [forming.told_again(job, node) for node in members]
    assert [m.text for m in got] == [_whole(job, node) for node in members]
    kept = job.texts
    assert isinstance(kept, forming.RoundTexts)
    again = [forming.told_again(job, node, restart=True) for node in members]
    assert job.texts is kept  # one template for the round, both kinds of message
    assert [m.text for m in again] == [_whole(job, node, restart=True) for node in members]
    assert all(m.op == "restart" for m in again) and again[0].model().assignment is not None  # type: ignore[union-attr]


def test_what_the_round_tells_alike_or_a_watched_address_changing_is_written_anew() -> None:
    job = _formed(9)
    node = job.nodes[job.order[4]]
    first = forming.told_again(job, node).text
    kept = job.texts
    # its first watched member answers from a new address (a resume brings it): written anew
    peer = job.nodes[job.order[5]]
    assert peer.probe_port is not None and peer.probe_addr in first
    peer.probe_addr, peer.probe_port = "10.9.9.9", 41999
    moved = forming.told_again(job, node).text
    assert '"addr":"10.9.9.9","port":41999' in moved and moved == _whole(job, node)
    peer.probe_port = None  # it answers no probes any more: no longer watched
    assert forming.told_again(job, node).text == _whole(job, node) and peer.node_id not in _whole(job, node)
    assert job.texts is kept
    # a restart charged (the round's own field): a new template
    job.restarts += 1
    assert forming.told_again(job, node).text == _whole(job, node) and '"restarts":1' in _whole(job, node)
    assert job.texts is not kept
    # a new seed for the round's probe key (a restarted server draws one): a new template
    keyed = next(job.nodes[x] for x in job.order if job.nodes[x].probe_port is not None)
    before = forming.told_again(job, keyed).text
    kept = job.texts
    job.probe_seed = bytes(16)
    after = forming.told_again(job, keyed).text
    assert after == _whole(job, keyed) and after != before and '"probe_key":"' in after and job.texts is not kept


def test_the_kept_template_is_never_saved_and_goes_when_the_job_ends() -> None:
    job = _formed(3)
    forming.told_again(job, job.nodes["n0"])
    assert job.texts is not None
    record = rounds.to_record(job)
    assert "texts" not in record and rounds.from_record(json.loads(json.dumps(record))).texts is None
    rounds.close(job, 2.0)
    assert job.finished and job.texts is None


@pytest.mark.parametrize(
    "values",
    [
        (0, "n0", 2.0, None, None, 1),
        (7, "node:7@h+1", 0.25, None, "s" * 32, 3),
        (2**31, "a.b_c", 30, None, None, 2**20),  # an int interval is written as the model's float
        (
            1,
            "x",
            1e-3,
            {
                "text": 'q "uoted" \\ \n\x01 é☃',
                "joined": 3,
                "min_nodes": 4,
                "max_nodes": 9,
                "spares": 2,
                "missing": [],
                "last_call_deadline": None,
            },
            "k" * 40,
            1,
        ),
        (
            1,
            "x",
            123.456,
            {
                "text": "",
                "joined": 0,
                "min_nodes": 0,
                "max_nodes": 0,
                "spares": 0,
                "missing": ["n1", "n2"],
                "last_call_deadline": 1764877200.1234567,
            },
            None,
            1,
        ),
        (
            1,
            "x",
            5.0,
            {
                "text": "t",
                "joined": 1,
                "min_nodes": 1,
                "max_nodes": 1,
                "spares": 0,
                "missing": [],
                "last_call_deadline": 1e-7,
            },
            None,
            1,
        ),
    ],
)
def test_a_joined_is_what_pydantic_writes_for_the_model(values: tuple) -> None:
    round_no, node_id, hb, waiting, secret, run = values
    got = templates.joined(round_no, node_id, hb, waiting, secret, run)
    model = JoinedMsg(
        round=round_no,
        node_id=node_id,
        heartbeat_s=hb,
        waiting_for=None if waiting is None else WaitingInfo(**waiting),
        node_secret=secret,
        run=run,
    )
    assert got.op == "joined" and got.text == model.model_dump_json()
    assert got.model() == model


def test_a_forming_rounds_joined_says_what_it_waits_for_as_the_status_does() -> None:
    sp = spec(min_nodes=3, max_nodes=4)
    job = rounds.new_job("j", sp, 0.0)
    fx = rounds.join(job, join_msg("a", sp=sp), 1.0, node_secret="s" * 32)
    ((to, msg),) = fx.messages()
    assert to == "a" and isinstance(msg, JoinedMsg) and msg.node_secret == "s" * 32
    ((_, sent),) = fx.sends  # the text as written, from views.waiting_fields' dict: the model's own
    assert isinstance(sent, Prepared) and sent.text == msg.model_dump_json()
    assert msg.waiting_for == rounds.waiting_info(job, 1.0, detail=False)
    assert msg.waiting_for is not None and msg.waiting_for.text == "2 more node(s) to reach min 3"


def test_what_a_forming_round_says_it_waits_for_stays_within_the_models_bounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A re-formed round may hold more waiting nodes than the protocol's MAX_NODES bound on the
    counts: they are said at that bound, never as a message the agent's model would refuse."""
    from rdzv_server.rounds import views

    monkeypatch.setattr(views, "MAX_NODES", 2)
    sp = spec(min_nodes=4, max_nodes=4)
    job = rounds.new_job("j", sp, 0.0)
    for n in ("a", "b", "c"):
        rounds.join(job, join_msg(n, sp=sp), 1.0)
    fields = views.waiting_fields(job, 1.0, detail=False)
    assert fields is not None and fields["joined"] == 2 and fields["text"] == "1 more node(s) to reach min 4"
