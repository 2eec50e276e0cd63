"""Job secrets that stay out of ps (issue 19 item 9): a file form for
rdzv-agent (--job-secret-file, $RDZV_JOB_SECRET_FILE) and the torchrun plugin
(--rdzv-conf job_secret_file=PATH, and $RDZV_JOB_SECRET), and one warning
when the secret is given on the command line."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from rdzv_client import secret_source

ARGV = ["--endpoint", "127.0.0.1:1", "--job-id", "j", "train.py"]


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RDZV_JOB_SECRET", "RDZV_JOB_SECRET_FILE", "RDZV_TOKEN", "RDZV_ENDPOINT", "SLURM_JOB_ID"):
        monkeypatch.setenv(name, "x")
        monkeypatch.delenv(name)
    monkeypatch.setattr(secret_source, "_warned", set())


def _secret_file(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    p = tmp_path / "secret"
    p.write_text(text)
    os.chmod(p, mode)
    return p


def _agent_secret(*argv: str) -> str | None:
    from rdzv_client.agent import build_parser, config_from_args

    return config_from_args(build_parser().parse_args([*argv, *ARGV])).job_secret


def test_agent_reads_the_secret_file_and_its_environment_form(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    p = _secret_file(tmp_path, "s3cret-from-file-0123456789ab\n")
    with caplog.at_level(logging.WARNING):
        assert _agent_secret("--job-secret-file", str(p)) == "s3cret-from-file-0123456789ab"
        monkeypatch.setenv("RDZV_JOB_SECRET_FILE", str(p))
        monkeypatch.setenv("RDZV_JOB_SECRET", "from-env-0123456789ab")  # the file wins over the plain variable
        assert _agent_secret() == "s3cret-from-file-0123456789ab"
    assert not caplog.records  # no warning: nothing on the command line, the file is private


def test_agent_warns_once_when_the_secret_is_on_the_command_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert _agent_secret("--job-secret", "from-flag-0123456789ab") == "from-flag-0123456789ab"
        assert _agent_secret("--job-secret", "from-flag-0123456789ab") == "from-flag-0123456789ab"
    said = [r.getMessage() for r in caplog.records if "command line" in r.getMessage()]
    assert len(said) == 1 and "--job-secret-file" in said[0] and "from-flag-0123456789ab" not in said[0], said


@pytest.mark.parametrize(
    ("text", "why"),
    [("", "empty"), ("a\nb\n", "only line"), ("x" * 5000, "over"), ("caf\u00e9", "ASCII")],
)
def test_a_bad_secret_file_is_a_usage_error(tmp_path: Path, text: str, why: str) -> None:
    from rdzv_client.agent import UsageError

    p = _secret_file(tmp_path, text)
    with pytest.raises(UsageError, match=why):
        _agent_secret("--job-secret-file", str(p))


def test_missing_file_and_both_forms_are_usage_errors(tmp_path: Path) -> None:
    from rdzv_client.agent import UsageError

    with pytest.raises(UsageError, match="cannot read"):
        _agent_secret("--job-secret-file", str(tmp_path / "nope"))
    p = _secret_file(tmp_path, "abc-0123456789abcdef")
    with pytest.raises(UsageError, match="not both"):
        _agent_secret("--job-secret", "abc", "--job-secret-file", str(p))


def test_a_file_others_can_read_is_said(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    p = _secret_file(tmp_path, "abc-0123456789abcdef\n", mode=0o644)
    with caplog.at_level(logging.WARNING):
        assert _agent_secret("--job-secret-file", str(p)) == "abc-0123456789abcdef"
    assert any("chmod 600" in r.getMessage() for r in caplog.records)


def test_plugin_reads_the_file_form_and_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("torch")
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from rdzv_client.torch_plugin import RdzvRendezvousHandler

    def secret(**conf: str) -> str | None:
        params = RendezvousParameters(
            backend="rdzv", endpoint="127.0.0.1:1", run_id="j", min_nodes=1, max_nodes=1, local_addr="127.0.0.1", **conf
        )
        return RdzvRendezvousHandler(params).job_secret

    p = _secret_file(tmp_path, "plug-secret-0123456789ab\n")
    with caplog.at_level(logging.WARNING):
        assert secret(job_secret_file=str(p)) == "plug-secret-0123456789ab"
        monkeypatch.setenv("RDZV_JOB_SECRET", "env-secret-0123456789ab")
        assert secret() == "env-secret-0123456789ab"
        assert "RDZV_JOB_SECRET" not in os.environ  # popped: torchrun's workers never inherit it
    assert not caplog.records
    with caplog.at_level(logging.WARNING):
        assert secret(job_secret="on-the-line-0123456789ab") == "on-the-line-0123456789ab"
    assert any("ps" in r.getMessage() and "job_secret_file" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="not both"):
        secret(job_secret="a", job_secret_file=str(p))
