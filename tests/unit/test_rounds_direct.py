"""Direct re-formation (design.md "Direct re-formation"): a round change the
server can form itself is formed at once, and each member's ``restart``
carries its place; rank 0's MASTER_PORT is never a port its last round's store
listened on."""

from __future__ import annotations

import pytest
from test_rounds import BASE, alive, join_msg, sent, spec

from rdzv_common.protocol import AssignedMsg, JobState, JoinMsg, RestartMsg, SpareMsg
from rdzv_server import rounds


def direct_join(node_id: str, port: int, *, sp=None, resume: int | None = None, ports=None) -> JoinMsg:
    """A join offering direct ports (``port+1..port+4`` unless ``ports``), as rdzv-agent's."""
    msg = join_msg(node_id, sp=sp, port=port, resume=resume)
    return msg.model_copy(update={"direct_ports": list(ports if ports is not None else range(port + 1, port + 5))})


def formed(ids, sp=None, direct=True) -> rounds.Job:
    sp = sp or spec(min_nodes=1, max_nodes=max(4, len(ids)))
    job = rounds.new_job("j", sp, 0.0)
    for i, nid in enumerate(ids):
        port = 20000 + 100 * i
        rounds.join(job, direct_join(nid, port, sp=sp) if direct else join_msg(nid, sp=sp, port=port), 0.0)
    if job.forming:
        rounds.tick(job, sp.last_call_s)
    assert job.state == JobState.RUNNING
    return job


def lose(job: rounds.Job, node_id: str, now: float) -> rounds.Effects:
    alive(job, now)
    rounds.disconnect(job, node_id, now, 0.5)
    return rounds.tick(job, now + 0.5)


def test_a_node_loss_forms_the_next_round_at_once_and_each_restart_carries_the_place():
    job = formed(["a", "b", "c"])
    assert job.master_port == 20000
    fx = lose(job, "b", 5.0)
    assert job.state == JobState.RUNNING and job.round == 1 and job.order == ["a", "c"]
    restarts = sent(fx, RestartMsg)
    assert set(restarts) == {"a", "c"} and not sent(fx, AssignedMsg)
    a, c = restarts["a"].assignment, restarts["c"].assignment
    assert (a.round, a.group_rank, c.group_rank, c.rank_offset, a.world_size) == (1, 0, 1, 1, 2)
    assert restarts["a"].reason == job.history[-1].reason and "node b" in restarts["a"].reason
    # rank 0's store listened on 20000 in round 0: round 1's is one it offered and never used
    assert a.master_port == c.master_port == job.master_port == 20001
    assert fx.rounds_opened == 1 and fx.rounds_completed == 1 and fx.persist
    (opened,) = [ev for ev in fx.events if ev.kind == "round_opened"]
    assert opened.fields["waiting_for"] == 0 and "placing its 2 member(s) at once a, c" in opened.text
    assert [ev.fields.get("state") for ev in fx.events if ev.kind == "job_state"] == ["waiting", "running"]
    # what goes on the wire, validated as the agent reads it
    assert RestartMsg.model_validate_json(restarts["c"].model_dump_json()) == restarts["c"]


def test_rank0_takes_a_fresh_port_each_direct_round_then_joins_again_when_none_is_left():
    job = formed(["a", "b", "c", "d", "e", "f"], sp=spec(min_nodes=1, max_nodes=8))
    ports = [job.master_port]
    for i, victim in enumerate(["b", "c", "d", "e"]):
        fx = lose(job, victim, 10.0 * (i + 1))
        assert sent(fx, RestartMsg)["a"].assignment is not None
        ports.append(job.master_port)
    assert ports == [20000, 20001, 20002, 20003, 20004]
    # its four offered ports are spent: the next round change asks everyone to join again
    fx = lose(job, "f", 60.0)
    assert job.forming and sent(fx, RestartMsg)["a"].assignment is None
    fx = rounds.join(job, direct_join("a", 30000, sp=job.spec), 61.0)
    assert job.state == JobState.RUNNING and job.master_port == 30000
    assert sent(fx, AssignedMsg)["a"].assignment.master_port == 30000


def test_a_new_rank0_uses_its_join_port_which_its_workers_never_listened_on():
    job = formed(["a", "b", "c"])
    fx = lose(job, "a", 5.0)
    assert job.order == ["b", "c"] and job.master_port == 20100
    assert sent(fx, RestartMsg)["b"].assignment.master_port == 20100
    lose(job, "c", 10.0)
    assert job.master_port == 20101  # b held rank 0 on 20100: a port of its offer now


@pytest.mark.parametrize(
    "why",
    ["an agent that joins again after every restart", "too few to form", "a blocked host", "a replaced straggler"],
)
def test_a_round_the_server_cannot_form_itself_asks_its_members_to_join_again(why):
    sp = spec(min_nodes=3, max_nodes=4) if why == "too few to form" else None
    job = formed(["a", "b", "c"], sp=sp)
    if why == "an agent that joins again after every restart":
        rounds.join(job, join_msg("c", sp=job.spec, port=20200, resume=0), 1.0)  # its resume offers none
        job.nodes["c"].direct_ports = None
    if why == "a blocked host":

        class Gate:
            def blocked(self, host, now):
                return "cordoned" if host == "c" else None

            def cordoned(self, host, now):
                return host == "c"

            def cools_down(self, host, now):
                return False

        job.gate = Gate()
    if why == "a replaced straggler":
        job.nodes["c"].replaced = "a straggler, replaced by a spare"
    fx = lose(job, "b", 5.0)
    assert job.forming and job.round == 1
    assert {nid: m.assignment for nid, m in sent(fx, RestartMsg).items()} == {"a": None, "c": None}
    (opened,) = [ev for ev in fx.events if ev.kind == "round_opened"]
    assert opened.fields["waiting_for"] == 2 and "waiting for 2 node(s) a, c" in opened.text
    assert not sent(fx, AssignedMsg)


def test_newcomers_and_promoted_spares_are_assigned_with_the_direct_round():
    sp = spec(min_nodes=1, max_nodes=2)
    job = formed(["a", "b"], sp=sp)
    rounds.join(job, direct_join("s", 40000, sp=sp), 1.0)
    assert job.nodes["s"].state == rounds.SPARE
    fx = lose(job, "b", 5.0)
    assert job.order == ["a", "s"] and not job.forming
    assert sent(fx, RestartMsg)["a"].assignment.group_rank == 0
    assert sent(fx, AssignedMsg)["s"].assignment.group_rank == 1
    assert not sent(fx, SpareMsg)


def test_a_worker_failure_reforms_directly_and_is_charged():
    from test_rounds import EXIT

    job = formed(["a", "b"])
    fx = rounds.fail(job, "b", 0, [EXIT], 5.0)
    assert job.restarts == 1 and job.round == 1 and not job.forming
    assert sent(fx, RestartMsg)["b"].assignment.group_rank == 1


@pytest.mark.parametrize("cools", [False, True])
def test_a_failure_that_cools_its_host_down_makes_everyone_join_again(cools):
    """Its host is blocked once the failure is counted (after the step): at its
    join it is held as a spare, so it must join; a failure that does not cool
    the host down re-forms directly."""
    from test_rounds import EXIT

    class Gate:
        def blocked(self, host, now):
            return None

        def cordoned(self, host, now):
            return False

        def cools_down(self, host, now):
            return cools and host == "b"

    job = formed(["a", "b", "c"])
    job.gate = Gate()
    fx = rounds.fail(job, "b", 0, [EXIT], 5.0)
    assert fx.host_failures and job.forming is cools
    assert (sent(fx, RestartMsg)["b"].assignment is None) is cools


def test_a_member_that_missed_its_restart_hears_it_again_when_it_resumes():
    job = formed(["a", "b", "c"])
    lose(job, "c", 5.0)
    fx = rounds.join(job, direct_join("b", 20100, sp=job.spec, resume=0, ports=[50001, 50002]), 6.0)
    msg = sent(fx, RestartMsg)["b"]
    assert msg.round == 1 and msg.assignment.group_rank == 1 and msg.assignment.master_port == 20001
    assert job.nodes["b"].direct_ports == [50001, 50002]  # its fresh offer replaces the old one


def test_a_missed_restart_resumed_from_a_new_address_is_probed_there():
    """As a plain reconnect: the address its connection came from this time, and its join's probe port."""
    job = formed(["a", "b", "c"])
    lose(job, "c", 5.0)
    resumed = direct_join("b", 20100, sp=job.spec, resume=0).model_copy(update={"probe_port": 41000})
    rounds.join(job, resumed, 6.0, seen_addr="10.0.0.7")
    assert (job.nodes["b"].probe_addr, job.nodes["b"].probe_port) == ("10.0.0.7", 41000)


def test_the_running_rank0s_resume_never_leaves_its_in_use_port_for_the_next_round():
    """A record saved before direct ports existed: rank 0's master_port is its
    store's. Its resume's offer gives the next round a fresh one."""
    job = formed(["a", "b"], direct=False)
    assert job.nodes["a"].master_port == job.master_port == 20000 and job.nodes["a"].direct_ports is None
    for nid, port in (("a", 20000), ("b", 20100)):
        rounds.join(job, direct_join(nid, 20000, sp=job.spec, resume=0, ports=[port + 7, port + 8]), 1.0)
    assert job.nodes["a"].master_port == 20007
    rounds.join(job, direct_join("c", 20200, sp=job.spec), 2.0)
    rounds.tick(job, 2.0 + BASE["scale_up_window_s"])  # a scale-up, formed at once
    assert job.order == ["a", "b", "c"] and job.master_port == 20007 and not job.forming


def test_direct_ports_are_not_saved():
    job = formed(["a", "b"])
    assert "direct_ports" not in str(rounds.to_record(job))
    back = rounds.from_record(rounds.to_record(job))
    assert all(n.direct_ports is None for n in back.nodes.values())


@pytest.mark.parametrize(
    ("ports", "words"),
    [([20001, 20001], "differ"), ([20000], "differ"), (list(range(1, 10)), "at most 8")],
)
def test_a_join_offering_repeated_or_too_many_ports_is_refused(ports, words):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=words):
        JoinMsg.model_validate({**direct_join("a", 20000).model_dump(), "direct_ports": ports})
