"""The job lifecycle in the pure round machine (issue 12): a node whose
launcher gives up ends the job; a finished job id starts a new run. Plain
numbers for time, as in test_rounds.py."""

from __future__ import annotations

import json

import pytest

from rdzv_common.logs import Line
from rdzv_common.protocol import (
    DoneMsg,
    EvictedError,
    ExitRecord,
    FailedMsg,
    JobFinishedError,
    JobSecretMismatchError,
    JobSpec,
    JobState,
    JoinedMsg,
    JoinMsg,
    StaleRoundError,
)
from rdzv_server import rounds


def spec(**kw) -> JobSpec:
    return JobSpec(**{"min_nodes": 1, "max_nodes": 4, "last_call_s": 1.0, **kw})


def join_msg(node_id: str, sp: JobSpec, **kw) -> JoinMsg:
    return JoinMsg(
        job_id="j",
        node_id=node_id,
        host=node_id,
        addr=f"{node_id}.addr",
        local_world_size=1,
        master_port=29500,
        spec=sp,
        **kw,
    )


def sent(fx: rounds.Effects, kind: type) -> dict:
    return {nid: m for nid, m in fx.messages() if isinstance(m, kind)}


def record(job: rounds.Job) -> dict:
    return json.loads(json.dumps(rounds.to_record(job)))


def form(ids, sp: JobSpec, now: float = 0.0, job: rounds.Job | None = None) -> rounds.Job:
    """A running job whose round 0 holds ``ids`` (hosts = ids), formed at ``now``."""
    job = job or rounds.new_job("j", sp, now)
    for nid in ids:
        rounds.join(job, join_msg(nid, sp), now)
    if job.forming:
        rounds.tick(job, now + sp.last_call_s)
    assert job.state == JobState.RUNNING
    return job


BOOM = ExitRecord(local_rank=0, rank=1, pid=77, exit_code=1, timestamp=5.0, message="RuntimeError: boom")
ECHO = ExitRecord(local_rank=0, rank=0, pid=78, exit_code=1, timestamp=6.0, message="RuntimeError: Connection closed")


# ------------------------------------------------------------------ give up


def test_a_node_that_gives_up_fails_the_job_and_every_node_is_told():
    """Budget left on the server (torchrun keeps its own): a give-up still ends
    the job at once, named after the failure; no round opens, nothing charged."""
    job = form(["a", "b"], spec(min_nodes=2, max_nodes=2, max_restarts=100))
    fx = rounds.give_up(job, "b", 0, [BOOM], 7.0)
    assert job.state == JobState.FAILED and job.round == 0 and job.restarts == 0
    assert "node b (b) rank 1" in job.root_cause and "RuntimeError: boom" in job.root_cause
    assert "gave up" in job.end_reason and "RuntimeError: boom" in job.end_reason
    done = sent(fx, DoneMsg)
    assert set(done) == {"a", "b"} and {m.state for m in done.values()} == {"failed"}
    assert done["a"].root_cause == job.root_cause
    assert fx.persist and fx.host_failures == [("b", "worker failure: " + BOOM.describe())]


def test_a_give_up_writes_a_node_failed_line():
    """The server log says which node's workers failed, as for a plain failure."""
    job = form(["a", "b"], spec(min_nodes=2, max_nodes=2, max_restarts=100))
    fx = rounds.give_up(job, "b", 0, [BOOM], 7.0)
    failed = [ln for ln in fx.logs if isinstance(ln, Line) and ln.fields["event"] == "node_failed"]
    assert len(failed) == 1, fx.logs
    f = failed[0].fields
    assert (f["job"], f["round"], f["node"], f["host"]) == (job.job_id, 0, "b", "b")
    assert f["exit"]["pid"] == BOOM.pid and "RuntimeError: boom" in failed[0]


def test_giving_up_after_a_peer_was_lost_names_the_lost_peer():
    """A collective broke because a peer died (its connection is down, within
    its grace): the peer's loss is the root cause, and the host of the node that
    gave up is not blamed."""
    job = form(["a", "b", "c"], spec(min_nodes=1, max_nodes=3))
    rounds.disconnect(job, "c", 2.0, grace_s=0.5)
    fx = rounds.give_up(job, "a", 0, [ECHO], 2.1)
    assert job.state == JobState.FAILED
    assert "node c" in job.root_cause and "connection lost" in job.root_cause
    assert "Connection closed" in job.end_reason and not fx.host_failures


def test_giving_up_in_a_round_that_already_ended_names_what_ended_it():
    """A member left (round 1 opens); the rejoining node's workers had failed in
    round 0 and its launcher gives up: what opened round 1 is the root cause."""
    job = form(["a", "b", "c"], spec(min_nodes=1, max_nodes=3))
    rounds.leave(job, "c", "sigterm", 2.0)
    assert job.round == 1 and job.forming
    rounds.give_up(job, "a", 0, [ECHO], 2.1)
    assert job.state == JobState.FAILED and "left (sigterm)" in job.root_cause


def test_give_up_refusals_change_nothing():
    job = form(["a", "b"], spec(min_nodes=1, max_nodes=2))
    before = record(job)
    with pytest.raises(EvictedError):
        rounds.give_up(job, "ghost", 0, [BOOM], 2.0)
    with pytest.raises(StaleRoundError):
        rounds.give_up(job, "a", 5, [BOOM], 2.0)
    rounds.succeed(job, "a", 0, 2.0)
    before = record(job)
    with pytest.raises(StaleRoundError):
        rounds.give_up(job, "a", 0, [BOOM], 2.0)
    assert record(job) == before
    rounds.give_up(job, "b", 0, [BOOM], 3.0)
    before = record(job)
    with pytest.raises(JobFinishedError):
        rounds.give_up(job, "b", 0, [BOOM], 4.0)
    assert record(job) == before


def test_a_plain_failure_report_keeps_its_frame_and_a_give_up_says_so():
    """The wire: a failure report is the frame it always was; a give-up adds one field."""
    plain = FailedMsg(round=1, failures=[BOOM])
    assert "give_up" not in plain.model_dump_json()
    final = FailedMsg(round=1, failures=[BOOM], give_up=True)
    assert '"give_up":true' in final.model_dump_json()
    assert FailedMsg.model_validate_json(final.model_dump_json()).give_up is True


# --------------------------------------------------------------------- runs


def finish(job: rounds.Job, how: str, now: float) -> None:
    if how == "close":
        rounds.close(job, now)
    elif how == "fail":
        rounds.give_up(job, next(iter(job.nodes)), job.round, [BOOM], now)
    else:
        for nid in list(job.order):
            rounds.succeed(job, nid, job.round, now)
    assert job.finished


@pytest.mark.parametrize("how", ["succeed", "fail", "close"])
def test_a_fresh_join_to_a_finished_job_starts_the_next_run(how):
    """The same command again: a join without a run, a node secret or a resume
    starts run 2 with the join's settings; run 1 is kept as a summary."""
    sp = spec(min_nodes=2, max_nodes=2)
    job = form(["a", "b"], sp)
    rounds.leave(job, "b", "sigterm", 1.5)  # round 1 forms
    rounds.join(job, join_msg("a", sp), 1.6)
    rounds.join(job, join_msg("c", sp), 1.6)
    assert job.round == 1 and job.state == JobState.RUNNING
    finish(job, how, 2.0)
    state, reason = job.state.value, job.end_reason
    sp2 = spec(min_nodes=1, max_nodes=3)  # a new run may change the settings
    fx = rounds.join(job, join_msg("x", sp2), 10.0)
    assert job.run == 2 and job.state == JobState.WAITING and job.round == 0 and job.restarts == 0
    assert set(job.nodes) == {"x"} and job.spec == sp2 and job.root_cause is None and job.end_reason is None
    assert sent(fx, JoinedMsg)["x"].run == 2 and fx.persist
    assert job.history[0].reason == f"run 2 started (run 1 {state})" and len(job.history) == 1
    (prev,) = job.runs
    assert (prev.run, prev.state, prev.reason, prev.rounds) == (1, state, reason, 2)
    assert (prev.started_at, prev.ended_at) == (0.0, 2.0)
    rounds.tick(job, 11.0)  # last call
    assert job.state == JobState.RUNNING and job.run_started_at == 10.0


OWNER = "team-secret-0123456789"  # job secrets are at least 16 characters


@pytest.mark.parametrize("how", ["succeed", "fail", "close"])
@pytest.mark.parametrize("stranger", [{}, {"job_secret": "stranger-secret-0123"}])
def test_a_finished_job_with_a_secret_is_owned_a_stranger_cannot_start_its_next_run(how, stranger):
    """Issue 19 item 3: the last run had a job secret, so the id is owned by
    whoever knows it. A fresh join without it, or with another, is refused
    (saying how to reuse the id) and changes nothing: the job still shows the
    ended run. The owner then starts run 2, with other settings if it likes."""
    sp = spec(min_nodes=1, max_nodes=2)
    job = rounds.new_job("j", sp, 0.0, job_secret=OWNER)
    rounds.join(job, join_msg("a", sp, job_secret=OWNER), 0.0)
    rounds.tick(job, 1.0)
    finish(job, how, 2.0)
    before = record(job)
    with pytest.raises(JobSecretMismatchError, match="owned by its run 1.*same job secret.*rdzv delete j"):
        rounds.join(job, join_msg("x", spec(min_nodes=1, max_nodes=1), **stranger), 3.0)
    assert record(job) == before and job.run == 1 and job.finished
    sp2 = spec(min_nodes=1, max_nodes=3)  # the owner may change the settings
    fx = rounds.join(job, join_msg("y", sp2, job_secret=OWNER), 4.0)
    assert job.run == 2 and job.state == JobState.WAITING and job.spec == sp2
    assert sent(fx, JoinedMsg)["y"].run == 2 and fx.persist
    assert job.secret_hash == rounds.job_secret_hash("j", OWNER)


def test_a_finished_job_without_a_secret_is_anyones_next_run():
    """No job secret: as before, any fresh join starts the next run, a secret
    it brings becomes the new run's (and owns the id from then on)."""
    sp = spec(min_nodes=1, max_nodes=1)
    job = form(["a"], sp)
    finish(job, "succeed", 2.0)
    rounds.join(job, join_msg("x", sp, job_secret=OWNER), 3.0)
    assert job.run == 2 and job.secret_hash == rounds.job_secret_hash("j", OWNER)


@pytest.mark.parametrize(
    "late",
    [
        dict(run=1),  # an agent of run 1 that rejoins as a new node (after an eviction)
        dict(resume_round=0),  # reconnecting to the round its workers ran
        dict(node_secret="s3cret-of-run-1"),  # a node of run 1 that still holds its secret
    ],
)
def test_a_late_agent_of_the_finished_run_is_told_it_finished(late):
    sp = spec(min_nodes=1, max_nodes=2)
    job = form(["a"], sp)
    finish(job, "close", 2.0)
    before = record(job)
    with pytest.raises(JobFinishedError, match="run 1"):
        rounds.join(job, join_msg("new-id", sp, **late), 3.0)
    with pytest.raises(JobFinishedError, match="run 1"):
        rounds.join(job, join_msg("a", sp), 3.0)  # a node of run 1 by its id
    assert record(job) == before


def test_a_late_agent_of_run_1_cannot_join_run_2():
    sp = spec(min_nodes=1, max_nodes=2)
    job = form(["a"], sp)
    finish(job, "succeed", 2.0)
    rounds.join(job, join_msg("b", sp), 3.0)
    rounds.tick(job, 4.0)
    assert job.run == 2 and job.state == JobState.RUNNING
    before = record(job)
    with pytest.raises(JobFinishedError, match="run 1 .*over.*run 2"):
        rounds.join(job, join_msg("a2", sp, run=1), 5.0)
    assert record(job) == before
    fx = rounds.join(job, join_msg("c", sp, run=2), 5.0)  # an agent of run 2 is welcome (a scale-up)
    assert sent(fx, JoinedMsg)["c"].run == 2


def test_runs_are_bounded_and_survive_a_record_round_trip():
    sp = spec(min_nodes=1, max_nodes=1)
    job = form(["n0"], sp)
    for i in range(1, rounds.MAX_RUNS + 5):
        finish(job, "succeed", 10.0 * i)
        form([f"n{i}"], sp, now=10.0 * i + 1, job=job)
    assert job.run == rounds.MAX_RUNS + 5
    assert len(job.runs) == rounds.MAX_RUNS
    assert [r.run for r in job.runs] == list(range(5, rounds.MAX_RUNS + 5))
    again = rounds.from_record(record(job))
    assert again.runs == job.runs and again.run == job.run and again.run_started_at == job.run_started_at
    view = rounds.view(job, 1000.0)
    assert view.run == job.run and [r.run for r in view.runs] == [r.run for r in job.runs]
    assert view.runs[-1].state == "succeeded" and rounds.summary(job).run == job.run


def test_an_old_record_loads_as_run_1_and_a_job_that_never_reran_saves_no_new_fields():
    sp = spec(min_nodes=1, max_nodes=1)
    job = form(["a"], sp)
    rec = record(job)
    assert not {"run", "runs", "run_started_at"} & set(rec)  # the record older code wrote
    loaded = rounds.from_record(rec)
    assert (loaded.run, loaded.runs, loaded.run_started_at) == (1, [], None)


def test_rdzv_status_lists_the_earlier_runs_only_when_there_are_some():
    from rdzv_client import cli

    sp = spec(min_nodes=1, max_nodes=1)
    job = form(["a"], sp)
    assert "earlier runs" not in cli.render_job(rounds.view(job, 1.0))
    finish(job, "close", 2.0)
    form(["b"], sp, now=3.0, job=job)
    text = cli.render_job(rounds.view(job, 4.0))
    assert "this is run 2; earlier runs:" in text
    (row,) = [ln for ln in text.splitlines()[text.splitlines().index("this is run 2; earlier runs:") + 2 :]]
    assert row.split()[:2] == ["1", "closed"] and row.rstrip().endswith("closed by request")


def test_an_agent_that_may_not_start_a_new_run_is_told_the_run_finished():
    """``--no-new-run`` (a Kubernetes pod that starts after its run ended): a
    finished job refuses it as before, nothing changes; it still creates a new
    job id and joins a forming round."""
    sp = spec(min_nodes=1, max_nodes=2)
    job = rounds.new_job("j", sp, 0.0)
    rounds.join(job, join_msg("a", sp, new_run=False), 0.0)  # it creates a new job's first run
    rounds.join(job, join_msg("b", sp, new_run=False), 0.5)  # and joins its forming round
    assert job.state == JobState.RUNNING and job.order == ["a", "b"]
    finish(job, "succeed", 3.0)
    before = record(job)
    with pytest.raises(JobFinishedError, match="already succeeded"):
        rounds.join(job, join_msg("late-pod", sp, new_run=False), 4.0)
    assert record(job) == before and not rounds.starts_run(job, join_msg("late-pod", sp, new_run=False))


def test_no_new_run_reaches_the_join_from_the_flag_and_the_environment(monkeypatch: pytest.MonkeyPatch):
    from rdzv_client.config import build_parser, config_from_args
    from rdzv_client.session import NodeSession

    base = ["--endpoint", "127.0.0.1:29400", "--job-id", "j", "--local-addr", "127.0.0.1", "train.py"]
    monkeypatch.delenv("RDZV_NO_NEW_RUN", raising=False)
    assert config_from_args(build_parser().parse_args(base)).new_run is True
    assert config_from_args(build_parser().parse_args(["--no-new-run", *base])).new_run is False
    monkeypatch.setenv("RDZV_NO_NEW_RUN", "1")
    cfg = config_from_args(build_parser().parse_args(base))
    assert cfg.new_run is False
    session = NodeSession(job_id="j", host="h", nproc=1, spec=cfg.spec_fields(), addr="127.0.0.1", new_run=cfg.new_run)
    assert JoinMsg.model_validate_json(json.dumps(session.join_msg())).new_run is False


def test_only_a_member_of_the_round_may_give_up():
    """A node that had no workers in the round cannot end the job by "giving up" on it (issue 19 review: with
    --operator-token, a token holder joining as a spare or a queued node could fail any job without a secret)."""
    sp = spec(min_nodes=1, max_nodes=2)
    job = form(["a", "b"], sp)
    rounds.join(job, join_msg("spare", sp), 1.0)  # beyond max_nodes: a spare
    assert job.nodes["spare"].state == rounds.SPARE
    before = record(job)
    with pytest.raises(StaleRoundError, match="not a member"):
        rounds.give_up(job, "spare", 0, [BOOM], 2.0)
    assert record(job) == before and not job.finished
    # a member whose round ended and that has not rejoined since still may (torchrun gave up instead)
    rounds.fail(job, "a", 0, [BOOM], 3.0)
    assert job.round == 1 and job.nodes["b"].state == rounds.REJOINING
    rounds.give_up(job, "b", 0, [BOOM], 4.0)
    assert job.finished


def test_under_kubernetes_a_fresh_agent_may_not_start_a_new_run_unless_told(monkeypatch: pytest.MonkeyPatch):
    """Issue 25, item 2: a pod the scheduler restarts after its job failed must not start the job id's next run
    alone. In a Kubernetes pod (KUBERNETES_SERVICE_HOST) the default is --no-new-run; --new-run,
    RDZV_NO_NEW_RUN=0 or --rdzv-conf new_run=1 allow it; --no-new-run stays no whatever the key says."""
    from rdzv_client.config import build_parser, config_from_args
    from rdzv_client.session import new_run_default

    base = ["--endpoint", "127.0.0.1:29400", "--job-id", "j", "--local-addr", "127.0.0.1", "train.py"]

    def new_run(*flags: str) -> bool:
        return config_from_args(build_parser().parse_args([*flags, *base])).new_run

    monkeypatch.delenv("RDZV_NO_NEW_RUN", raising=False)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    assert new_run_default() is False and new_run() is False
    assert new_run("--new-run") is True
    assert new_run("--rdzv-conf", "new_run=1") is True
    assert new_run("--no-new-run", "--rdzv-conf", "new_run=1") is False
    monkeypatch.setenv("RDZV_NO_NEW_RUN", "0")
    assert new_run() is True and new_run("--no-new-run") is False
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    monkeypatch.delenv("RDZV_NO_NEW_RUN")
    assert new_run_default() is True and new_run() is True
    assert new_run_default({"KUBERNETES_SERVICE_HOST": "", "RDZV_NO_NEW_RUN": ""}) is True
    assert new_run_default({"RDZV_NO_NEW_RUN": "1"}) is False


def test_a_spent_budget_names_the_failure_that_spent_it_as_the_last_one():
    """Issue 25: the reason said "first failure:" before the last attempt's record (its pid): the failure that
    spent the budget is the last one, and the reason says so."""
    sp = spec(min_nodes=1, max_nodes=1, max_restarts=1)
    job = form(["a"], sp)
    rounds.fail(job, "a", 0, [BOOM], 5.0)  # restart 1/1: round 1
    rounds.join(job, join_msg("a", sp), 6.0)
    rounds.tick(job, 6.0 + sp.last_call_s)
    assert job.state == JobState.RUNNING and job.round == 1
    last = BOOM.model_copy(update={"pid": 88, "timestamp": 9.0, "message": "RuntimeError: again"})
    rounds.fail(job, "a", 1, [last], 9.0)
    assert job.state == JobState.FAILED
    assert "last failure: " in job.end_reason and "pid 88" in job.end_reason, job.end_reason
    assert "first failure" not in job.end_reason, job.end_reason
