"""The round machine with a host gate (pure; plain numbers for time): nodes
of blocked hosts wait as spares, told why; drain replaces running nodes;
failures are counted against the root cause's host only."""

from __future__ import annotations

from rdzv_common.protocol import AssignedMsg, ExitRecord, JobSpec, JoinMsg, RestartMsg, SpareMsg
from rdzv_server import rounds
from rdzv_server.hosts import HostRules, Hosts

SPEC = JobSpec(
    min_nodes=2,
    max_nodes=2,
    max_restarts=5,
    last_call_s=1.0,
    heartbeat_timeout_s=6.0,
    join_timeout_s=60.0,
    scale_up_window_s=0.5,
)
EXIT = [ExitRecord(local_rank=0, rank=0, pid=1, exit_code=1, message="boom")]


def join(node_id: str, spec: JobSpec = SPEC) -> JoinMsg:
    return JoinMsg(
        job_id="j", node_id=node_id, host=node_id, addr="10.0.0.1", local_world_size=1, master_port=29500, spec=spec
    )


def job_with(hosts: Hosts, spec: JobSpec = SPEC) -> rounds.Job:
    job = rounds.new_job("j", spec, 0.0)
    job.gate = hosts
    return job


def sent(fx: rounds.Effects, node_id: str, kind: type) -> list:
    return [m for n, m in fx.messages() if n == node_id and isinstance(m, kind)]


def test_a_cordoned_host_joins_as_a_spare_with_the_reason_and_is_admitted_after_uncordon() -> None:
    hosts = Hosts()
    hosts.cordon("b", "bad DIMM", None, False, 0.0)
    job = job_with(hosts)
    rounds.join(job, join("a"), 0.0)
    fx = rounds.join(job, join("b"), 0.1)
    spare = sent(fx, "b", SpareMsg)
    assert spare and spare[0].reason is not None and "bad DIMM" in spare[0].reason
    assert job.nodes["b"].state == rounds.SPARE and job.forming
    view = rounds.view(job, 0.2)
    assert view.spares[0].host_blocked is not None and "bad DIMM" in view.spares[0].host_blocked
    hosts.uncordon("b", 1.0)
    fx = rounds.hosts_changed(job, 1.0, set())
    assert not job.forming and {n for n, m in fx.messages() if isinstance(m, AssignedMsg)} == {"a", "b"}


def test_drain_opens_a_round_without_the_host_and_a_spare_takes_its_place() -> None:
    hosts = Hosts()
    job = job_with(hosts)
    for n in ("a", "b"):
        rounds.join(job, join(n), 0.0)
    rounds.join(job, join("c"), 0.5)  # a spare
    assert job.nodes["c"].state == rounds.SPARE
    hosts.cordon("b", "swap", 3600.0, True, 1.0)
    fx = rounds.hosts_changed(job, 1.0, {"b"})
    restart = sent(fx, "b", RestartMsg)
    assert restart and "drain" in restart[0].reason and job.restarts == 0
    fx = rounds.join(job, join("a"), 1.1)
    fx.merge(rounds.join(job, join("b"), 1.2))
    assert job.nodes["b"].state == rounds.SPARE and not job.forming
    assert job.order == ["a", "c"]


def test_a_cooled_down_spare_is_not_promoted_when_a_round_opens() -> None:
    hosts = Hosts(HostRules(failures=1))
    job = job_with(hosts)
    for n in ("a", "b"):
        rounds.join(job, join(n), 0.0)
    rounds.join(job, join("c"), 0.5)
    hosts.record_failure("c", "other-job", "x", 0.6)  # c's host cooled down by another job
    rounds.hosts_changed(job, 0.6, set())
    fx = rounds.fail(job, "a", 0, EXIT, 1.0)
    assert fx.host_failures == [("a", fx.host_failures[0][1])] and "boom" in fx.host_failures[0][1]
    assert job.nodes["c"].state == rounds.SPARE  # not promoted to the forming round


def test_a_failure_charged_to_a_dropped_node_counts_against_no_host() -> None:
    job = job_with(Hosts())
    for n in ("a", "b"):
        rounds.join(job, join(n), 0.0)
    rounds.disconnect(job, "b", 1.0, 0.5)
    fx = rounds.fail(job, "a", 0, EXIT, 1.1)
    assert fx.host_failures == []


def test_silence_counts_against_the_host() -> None:
    job = job_with(Hosts())
    for n in ("a", "b"):
        rounds.join(job, join(n), 0.0)
    rounds.heartbeat(job, "a", 5.0)
    fx = rounds.tick(job, 6.5)
    assert [h for h, _ in fx.host_failures] == ["b"] and "no heartbeat" in fx.host_failures[0][1]


def test_a_cool_down_never_stalls_a_job_that_cannot_form_without_the_host() -> None:
    """Every node of the job on one host (or a single-node job): after K
    failures the host is cooled down, but its nodes are still admitted; a
    cordon holds them all the same (an operator's decision)."""
    hosts = Hosts(HostRules(failures=1))
    spec = SPEC.model_copy(update={"min_nodes": 1, "max_nodes": 1})
    job = job_with(hosts, spec)
    rounds.join(job, join("a", spec), 0.0)
    fx = rounds.fail(job, "a", 0, EXIT, 1.0)
    for host, reason in fx.host_failures:
        hosts.record_failure(host, "j", reason, 1.0)
    assert hosts.blocked("a", 1.1) is not None
    fx = rounds.join(job, join("a", spec), 1.1)
    assert sent(fx, "a", AssignedMsg) and not sent(fx, "a", SpareMsg)
    hosts.cordon("a", "maintenance", None, False, 2.0)
    fx = rounds.fail(job, "a", 1, EXIT, 2.0)
    fx = rounds.join(job, join("a", spec), 2.1)
    assert sent(fx, "a", SpareMsg)[0].reason is not None and job.forming
