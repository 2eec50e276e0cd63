"""Restart storms in the round machine (pure; plain numbers for time): a job
that restarts ``storm_restarts`` times in a row without progress fails with
``stop="no_progress"``; progress is a step beyond the highest seen when the
round began, or a round that ran ``min_round_s``; ``max_restarts`` stays the
hard budget."""

from __future__ import annotations

from rdzv_common.protocol import AssignedMsg, DoneMsg, ExitRecord, JobSpec, JobState, JoinMsg, RestartMsg
from rdzv_server import rounds

EXIT = [ExitRecord(local_rank=0, rank=0, pid=1, exit_code=1, message="boom")]


def spec(**kw: object) -> JobSpec:
    base: dict[str, object] = dict(min_nodes=2, max_nodes=2, max_restarts=20, storm_restarts=3, min_round_s=60.0)
    return JobSpec(**{**base, **kw})  # type: ignore[arg-type]


def join(node_id: str, sp: JobSpec, resume: int | None = None) -> JoinMsg:
    return JoinMsg(
        job_id="j", node_id=node_id, host=node_id, addr="10.0.0.1", local_world_size=1, master_port=29500, spec=sp
    )


def started(sp: JobSpec) -> tuple[rounds.Job, float]:
    job = rounds.new_job("j", sp, 0.0)
    for n in ("a", "b"):
        rounds.join(job, join(n, sp), 0.0)
    assert not job.forming and job.round == 0
    return job, 0.0


def fail_and_rejoin(job: rounds.Job, now: float) -> rounds.Effects:
    """Node a's workers fail; if the round restarts, both rejoin at once."""
    fx = rounds.fail(job, "a", job.round, EXIT, now)
    if not job.finished:
        assert any(isinstance(m, RestartMsg) for _, m in fx.messages())
        for n in ("a", "b"):
            fx.merge(rounds.join(job, join(n, job.spec), now))
        assert not job.forming
        assert any(isinstance(m, AssignedMsg) for _, m in fx.messages())
    return fx


def done(fx: rounds.Effects) -> DoneMsg:
    msgs = [m for _, m in fx.messages() if isinstance(m, DoneMsg)]
    assert {n for n, m in fx.messages() if isinstance(m, DoneMsg)} == {"a", "b"}
    return msgs[0]


def test_n_restarts_in_a_row_without_progress_fail_the_job_with_no_progress() -> None:
    job, now = started(spec(storm_restarts=3))
    for i in range(3):
        now += 1.0
        fx = fail_and_rejoin(job, now)
        assert not job.finished and job.restarts == i + 1 and job.no_progress == i + 1
    now += 1.0
    fx = fail_and_rejoin(job, now)
    assert job.state == JobState.FAILED and job.restarts == 3
    msg = done(fx)
    assert msg.state == "failed" and msg.stop == "no_progress"
    assert msg.reason.startswith("no progress in 3 restarts") and "boom" in msg.reason
    assert "no progress in 3 restarts" in (job.end_reason or "")


def test_a_step_beyond_the_round_start_resets_the_count() -> None:
    job, now = started(spec(storm_restarts=2))
    rounds.heartbeat(job, "a", 0.5, step=10, rate=1.0)
    for _ in range(2):  # the steps seen before each round began are not progress in it
        now += 1.0
        fail_and_rejoin(job, now)
        rounds.heartbeat(job, "a", now + 0.1, step=10, rate=1.0)  # restarted from its checkpoint, no further
    assert job.no_progress == 1  # round 0 had progress (10 beyond nothing); round 1 did not
    rounds.heartbeat(job, "b", now + 0.2, step=11, rate=1.0)  # beyond 10: progress
    now += 1.0
    fail_and_rejoin(job, now)
    assert job.no_progress == 0 and not job.finished
    for _ in range(2):
        now += 1.0
        fail_and_rejoin(job, now)
        assert not job.finished
    now += 1.0
    fx = fail_and_rejoin(job, now)
    assert job.finished and done(fx).stop == "no_progress"


def test_a_round_that_lasted_min_round_s_is_progress_for_scripts_without_steps() -> None:
    job, now = started(spec(storm_restarts=1, min_round_s=30.0))
    now += 1.0
    fail_and_rejoin(job, now)  # short round: 1 restart without progress
    assert job.no_progress == 1
    now += 30.0  # this round ran min_round_s: progress
    fail_and_rejoin(job, now)
    assert not job.finished and job.no_progress == 0 and job.restarts == 2
    now += 29.0
    fail_and_rejoin(job, now)
    assert not job.finished and job.no_progress == 1
    now += 1.0
    fx = fail_and_rejoin(job, now)
    assert job.finished and done(fx).reason.startswith("no progress in 1 restarts")


def test_storm_restarts_0_is_off_and_max_restarts_decides() -> None:
    job, now = started(spec(storm_restarts=0, max_restarts=6))
    for _ in range(6):
        now += 1.0
        fail_and_rejoin(job, now)
        assert not job.finished
    now += 1.0
    fx = fail_and_rejoin(job, now)
    msg = done(fx)
    assert msg.stop is None and msg.reason.startswith("restart budget of 6 spent")


def test_max_restarts_stays_the_hard_budget() -> None:
    job, now = started(spec(storm_restarts=5, max_restarts=2))
    for _ in range(2):
        now += 1.0
        fail_and_rejoin(job, now)
    now += 1.0
    fx = fail_and_rejoin(job, now)
    msg = done(fx)
    assert job.state == JobState.FAILED and msg.stop is None and msg.reason.startswith("restart budget of 2 spent")


def test_the_count_and_spec_survive_a_record_and_defaults_keep_old_records() -> None:
    job, now = started(spec(storm_restarts=4, min_round_s=5.0))
    rounds.heartbeat(job, "a", 0.5, step=7, rate=1.0)
    fail_and_rejoin(job, 1.0)
    fail_and_rejoin(job, 2.0)
    rec = rounds.to_record(job)
    back = rounds.from_record(rec)
    assert (back.no_progress, back.max_step, back.round_step) == (1, 7, 7)
    assert (back.spec.storm_restarts, back.spec.min_round_s) == (4, 5.0)
    plain, _ = started(JobSpec(min_nodes=2, max_nodes=2))
    rec = rounds.to_record(plain)
    assert not {"storm_restarts", "min_round_s"} & rec["spec"].keys()
    assert not {"no_progress", "max_step", "round_step"} & rec.keys()
    assert rounds.from_record(rec).spec == plain.spec
