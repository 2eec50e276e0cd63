"""Identity and trust in the pure round machine: node secrets, job secrets,
the whole spec on every join, repeated reports, and network text in logs."""

from __future__ import annotations

import json

import pytest
from test_rounds import EXIT, form, join_msg, record, sent, spec

from rdzv_common.protocol import (
    AssignedMsg,
    ExitRecord,
    JobSecretMismatchError,
    JobState,
    JoinedMsg,
    NodeSecretMismatchError,
    SpecMismatchError,
    StaleRoundError,
)
from rdzv_server import rounds


def _join(job, node_id, now, *, issue=None, **kw):
    """rounds.join with the fields a test sets on the JoinMsg (node_secret, job_secret, spec...)."""
    sp = kw.pop("sp", job.spec)
    msg = join_msg(node_id, sp=sp, resume=kw.pop("resume", None), port=kw.pop("port", 29500))
    if kw:
        msg = msg.model_copy(update=kw)
    return rounds.join(job, msg, now, node_secret=issue)


# ------------------------------------------------------------- node secrets


def test_a_new_node_gets_its_secret_in_joined_and_the_job_keeps_only_a_hash():
    """The secret the store issues reaches the joining node in `joined`; the
    record (what goes to disk) holds a hash of it, never the secret."""
    job = rounds.new_job("j", spec(), 0.0)
    fx = _join(job, "a", 0.0, issue="s3cret-for-a")
    assert sent(fx, JoinedMsg)["a"].node_secret == "s3cret-for-a"
    text = json.dumps(rounds.to_record(job))
    assert "s3cret-for-a" not in text
    assert job.nodes["a"].secret_hash and job.nodes["a"].secret_hash in text
    restored = rounds.from_record(json.loads(text))
    assert restored.nodes["a"].secret_hash == job.nodes["a"].secret_hash


@pytest.mark.parametrize("given", [None, "wrong", "s3cret-for-a "], ids=["none", "wrong", "almost"])
@pytest.mark.parametrize("resume", [None, 0], ids=["join", "resume"])
def test_a_join_naming_a_known_node_without_its_secret_changes_nothing(given, resume):
    """An impostor's join or resume with a live node's id, without that node's
    secret, is refused with NodeSecretMismatchError and leaves the job as it was
    (its addr and master port included)."""
    job = rounds.new_job("j", spec(min_nodes=2, max_nodes=2), 0.0)
    _join(job, "a", 0.0, issue="s3cret-for-a")
    _join(job, "b", 0.1, issue="s3cret-for-b")
    assert job.state == JobState.RUNNING and job.master_addr == "a.addr"
    before = record(job)
    with pytest.raises(NodeSecretMismatchError, match="'a'"):
        _join(job, "a", 0.5, issue="fresh", node_secret=given, resume=resume, addr="6.6.6.6", port=4444)
    assert record(job) == before


def test_the_right_secret_reconnects_and_a_restart_round_keeps_rank_0s_master():
    """With its secret the node reconnects (same assignment); after a restart
    round the master is still the address of the node holding group rank 0."""
    job = rounds.new_job("j", spec(min_nodes=2, max_nodes=2), 0.0)
    _join(job, "a", 0.0, issue="sa")
    _join(job, "b", 0.1, issue="sb")
    fx = _join(job, "a", 0.5, node_secret="sa", resume=0)
    assert sent(fx, AssignedMsg)["a"].assignment.master_addr == "a.addr"
    with pytest.raises(NodeSecretMismatchError):
        _join(job, "a", 0.6, node_secret="sb")  # another node's secret is no proof either
    rounds.fail(job, "b", 0, [EXIT], 1.0)
    assert job.round == 1 and job.forming
    with pytest.raises(NodeSecretMismatchError):
        _join(job, "a", 1.1, addr="6.6.6.6")
    _join(job, "b", 1.2, node_secret="sb")
    fx = _join(job, "a", 1.3, node_secret="sa")
    assert job.state == JobState.RUNNING and job.order == ["a", "b"]
    assert (job.master_addr, job.master_port) == ("a.addr", 29500)
    assert not any(m.node_secret for m in sent(fx, JoinedMsg).values())  # issued once, at creation


def test_a_node_without_a_secret_hash_is_not_checked():
    """Nodes saved before node secrets existed (no hash) still rejoin (an upgrade must not strand them)."""
    job = form(["a", "b"])
    assert job.nodes["a"].secret_hash is None
    fx = _join(job, "a", 2.0, resume=0)
    assert "a" in sent(fx, AssignedMsg)


# --------------------------------------------------------------- job spec


SPEC_CHANGES = {
    "max_restarts": 0,
    "last_call_s": 30.0,
    "heartbeat_timeout_s": 15.0,
    "join_timeout_s": 5.0,
    "scale_up_window_s": 2.0,
}


@pytest.mark.parametrize(("field", "value"), SPEC_CHANGES.items(), ids=SPEC_CHANGES.keys())
def test_every_spec_field_must_match(field, value):
    """A join whose spec differs from the job's in any field is refused naming the field and both values."""
    job = rounds.new_job("j", spec(), 0.0)
    _join(job, "a", 0.0)
    before = record(job)
    ours = getattr(job.spec, field)
    with pytest.raises(SpecMismatchError) as info:
        _join(job, "b", 0.5, sp=spec(**{field: value}))
    text = str(info.value)
    assert field in text and f"{ours:g}" in text and f"{value:g}" in text, text
    assert record(job) == before


# ------------------------------------------------------------- job secrets


def test_job_secret_is_set_by_the_first_join_and_required_after():
    """A job created with a secret refuses joins without it or with another,
    saying which; the right one joins; the record holds only a hash."""
    job = rounds.new_job("j", spec(), 0.0, job_secret="team-secret-0123456789")
    _join(job, "a", 0.0, job_secret="team-secret-0123456789")
    before = record(job)
    with pytest.raises(JobSecretMismatchError, match="requires a job secret"):
        _join(job, "b", 0.1)
    with pytest.raises(JobSecretMismatchError, match="wrong job secret"):
        _join(job, "b", 0.1, job_secret="guess-0123456789abcdef")
    assert record(job) == before
    _join(job, "b", 0.2, job_secret="team-secret-0123456789")
    assert "team-secret-0123456789" not in json.dumps(rounds.to_record(job))
    assert rounds.from_record(json.loads(json.dumps(rounds.to_record(job)))).secret_hash == job.secret_hash


def test_a_job_without_a_secret_refuses_a_join_that_brings_one():
    """Two people who picked the same job id: the one with a secret is told the job has none."""
    job = rounds.new_job("j", spec(), 0.0)
    _join(job, "a", 0.0)
    before = record(job)
    with pytest.raises(JobSecretMismatchError, match="was created without a job secret"):
        _join(job, "b", 0.1, job_secret="mine-0123456789abcdef")
    assert record(job) == before


def test_same_job_secret_in_another_job_hashes_differently():
    """The stored hash depends on the job id: equal secrets of two jobs do not show as equal hashes."""
    one = rounds.new_job("j1", spec(), 0.0, job_secret="same-0123456789abcdef")
    two = rounds.new_job("j2", spec(), 0.0, job_secret="same-0123456789abcdef")
    assert one.secret_hash and two.secret_hash and one.secret_hash != two.secret_hash


# ---------------------------------------------------------- repeated reports


def test_a_repeated_success_changes_nothing_and_asks_for_no_write():
    """A second `succeeded` from a node that already succeeded: no persist, no log, no message, no change."""
    job = form(["a", "b"])
    assert rounds.succeed(job, "a", 0, 2.0).persist
    before = record(job)
    for i in range(3):
        fx = rounds.succeed(job, "a", 0, 3.0 + i)
        assert (fx.persist, fx.logs, fx.sends) == (False, [], [])
    assert record(job) == before


def test_a_repeated_success_after_the_job_succeeded_is_still_acked():
    """The last node's success ended the job; that node repeating it (a lost ack) is not an error."""
    job = form(["a", "b"])
    rounds.succeed(job, "a", 0, 2.0)
    rounds.succeed(job, "b", 0, 2.0)
    assert job.state == JobState.SUCCEEDED
    before = record(job)
    fx = rounds.succeed(job, "b", 0, 3.0)
    assert (fx.persist, fx.logs, fx.sends) == (False, [], [])
    assert record(job) == before


def test_a_node_that_succeeded_cannot_fail_in_that_round():
    """A failure report after the node's own success is stale: refused, nothing charged."""
    job = form(["a", "b"], spec(min_nodes=1, max_restarts=2))
    rounds.succeed(job, "a", 0, 2.0)
    before = record(job)
    with pytest.raises(StaleRoundError, match="already succeeded"):
        rounds.fail(job, "a", 0, [EXIT], 3.0)
    assert record(job) == before and job.restarts == 0


# ------------------------------------------------------ network text in logs

HOSTILE = "bye\nINFO rdzv_server.store: job j round 9 complete: forged\x1b[2J\x1b]0;pwned\x07"


def _one_line(text: str) -> None:
    assert "\n" not in text and "\r" not in text and "\x1b" not in text and "\x07" not in text, repr(text)


def test_a_leave_reason_reaches_logs_and_history_escaped():
    """A leave reason with a newline and escape sequences is one escaped line in the log and the round history."""
    job = form(["a", "b"])
    fx = rounds.leave(job, "b", HOSTILE, 2.0)
    lines = [line for line in fx.logs if "bye" in line]
    assert lines
    for line in fx.logs + [job.history[-1].reason]:
        _one_line(line)
    assert "bye\\nINFO" in lines[0] and "\\x1b[2J" in lines[0]


def test_a_failure_signal_and_message_reach_logs_and_root_cause_escaped():
    """Failure `signal` and `message` with control characters are escaped in the log, history and root cause."""
    job = form(["a", "b"], spec(min_nodes=1, max_restarts=1))
    bad = ExitRecord(local_rank=0, rank=0, pid=7, exit_code=None, signal="SIG\x1b[2J\nX", message="\x1b[2J" + HOSTILE)
    fx = rounds.fail(job, "a", 0, [bad], 2.0)
    assert any("\\x1b[2J" in line for line in fx.logs), fx.logs
    for line in fx.logs + [job.history[-1].reason]:
        _one_line(line)
    rounds.join(job, join_msg("a", sp=job.spec), 2.1)
    rounds.join(job, join_msg("b", sp=job.spec), 2.1)
    fx = rounds.fail(job, "a", 1, [bad], 3.0)
    assert job.state == JobState.FAILED
    _one_line(job.root_cause)
    for line in fx.logs:
        _one_line(line)


# ------------------------------------------------------------- the agent side


def test_worker_env_withholds_the_agents_credentials():
    """RDZV_TOKEN and RDZV_JOB_SECRET in the agent's environment never reach a worker's."""
    from test_workers import assignment

    from rdzv_client.workers import worker_env

    env = worker_env(
        {"RDZV_TOKEN": "t", "RDZV_JOB_SECRET": "s", "RDZV_ENDPOINT": "h:1", "HOME": "/h"},
        assignment(),
        0,
        "job1",
        "/tmp/err.json",
    )
    assert "RDZV_TOKEN" not in env and "RDZV_JOB_SECRET" not in env
    assert (env["RDZV_ENDPOINT"], env["HOME"]) == ("h:1", "/h")  # the rest is kept


def test_agent_job_secret_from_flag_or_environment(monkeypatch):
    """--job-secret, else $RDZV_JOB_SECRET; a secret that is not printable ASCII, or shorter
    than 16 characters, is a usage error; the config's repr never shows it."""
    from rdzv_client.agent import UsageError, build_parser, config_from_args

    argv = ["--endpoint", "127.0.0.1:1", "--job-id", "j", "train.py"]
    monkeypatch.setenv("RDZV_JOB_SECRET", "from-env-0123456789")
    assert config_from_args(build_parser().parse_args(argv)).job_secret == "from-env-0123456789"
    cfg = config_from_args(build_parser().parse_args(["--job-secret", "from-flag-0123456789", *argv]))
    assert cfg.job_secret == "from-flag-0123456789" and "from-flag" not in repr(cfg)
    monkeypatch.setenv("RDZV_JOB_SECRET", "two\nlines-0123456789")
    with pytest.raises(UsageError, match="job secret"):
        config_from_args(build_parser().parse_args(argv))
    for short in ("x", "s3cret", "0123456789abcde"):  # 15 characters: one too few
        monkeypatch.setenv("RDZV_JOB_SECRET", short)
        with pytest.raises(UsageError, match=f"must be 16-256 printable ASCII characters \\(this one has {len(short)}"):
            config_from_args(build_parser().parse_args(argv))
        with pytest.raises(UsageError, match="must be 16"):
            config_from_args(build_parser().parse_args(["--job-secret", short, *argv]))
    monkeypatch.setenv("RDZV_JOB_SECRET", "0123456789abcdef")  # 16: enough
    assert config_from_args(build_parser().parse_args(argv)).job_secret == "0123456789abcdef"
    monkeypatch.delenv("RDZV_JOB_SECRET")
    assert config_from_args(build_parser().parse_args(argv)).job_secret is None
