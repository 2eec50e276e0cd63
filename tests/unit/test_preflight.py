"""rdzv-agent checks the command its workers would run before it joins (issue 25, item 5):
rdzv_client/preflight.py on the real commands config_from_args builds from the flags."""

from __future__ import annotations

import os
import stat
import sys
import zipfile
from pathlib import Path

import pytest

from rdzv_client.config import build_parser, config_from_args
from rdzv_client.preflight import command_problem

BASE = ["--endpoint", "127.0.0.1:1", "--job-id", "j"]


@pytest.fixture(autouse=True)
def in_tmp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A working directory of the test's own, and no PET_/RDZV_/SLURM_ variable of the caller."""
    for name in list(os.environ):
        if name.startswith(("PET_", "RDZV_", "SLURM_")):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def problem(*argv: str) -> str | None:
    """The problem with the command the agent builds from ``argv`` (flags, script and its args)."""
    return command_problem(config_from_args(build_parser().parse_args([*BASE, *argv])).cmd)


def executable(path: Path, text: str = "#!/bin/sh\nexit 0\n") -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_a_script_that_exists_passes(in_tmp: Path) -> None:
    (in_tmp / "train.py").write_text("print('hi')\n")
    assert problem("train.py", "--lr", "1") is None
    assert problem(str(in_tmp / "train.py")) is None


def test_a_missing_script_is_named_with_the_working_directory(in_tmp: Path) -> None:
    said = problem("nosuch.py", "--lr", "1")
    assert said == f"training script 'nosuch.py' not found (working directory {in_tmp})"


@pytest.mark.parametrize("flag", ["--run-path", "--run_path"])
def test_run_path_checks_the_script_too(flag: str) -> None:
    assert problem(flag, "nosuch.py") is not None and "nosuch.py" in str(problem(flag, "nosuch.py"))


def test_a_directory_or_zip_runs_only_with_a_main(in_tmp: Path) -> None:
    (in_tmp / "app").mkdir()
    assert "directory without __main__.py" in str(problem("app"))
    (in_tmp / "app" / "__main__.py").write_text("")
    assert problem("app") is None
    with zipfile.ZipFile(in_tmp / "bundle.pyz", "w") as z:
        z.writestr("other.py", "")
    assert "zip file without __main__.py" in str(problem("bundle.pyz"))
    with zipfile.ZipFile(in_tmp / "ok.pyz", "w") as z:
        z.writestr("__main__.py", "")
    assert problem("ok.pyz") is None


def test_modules_are_found_as_python_m_finds_them(in_tmp: Path) -> None:
    assert problem("-m", "json.tool") is None
    assert problem("-m", "sys") is None  # built in
    said = problem("-m", "no_such_module_xyz.train")
    assert said is not None and "no module 'no_such_module_xyz'" in said
    (in_tmp / "mypkg").mkdir()  # in the working directory, where `python -m` looks first
    (in_tmp / "mypkg" / "__init__.py").write_text("raise SystemExit('imported')\n")
    assert problem("-m", "mypkg.train") is None  # found, and not imported (it would exit)


def test_no_python_commands_are_executables(in_tmp: Path) -> None:
    assert problem("--no-python", "true") is None  # on PATH
    assert (
        problem("--no-python", "no-such-command-xyz") == "--no-python command 'no-such-command-xyz' not found on PATH"
    )
    assert problem("--no-python", "./run.sh") == "--no-python command './run.sh' not found"
    (in_tmp / "run.sh").write_text("#!/bin/sh\n")
    assert problem("--no-python", "./run.sh") == "--no-python command './run.sh' is not an executable file"
    executable(in_tmp / "run.sh")
    assert problem("--no-python", "./run.sh") is None
    (in_tmp / "bin").mkdir()
    assert problem("--no-python", sys.executable, "-u", "-c", "pass") is None  # python's own options: not a script
    assert "is not an executable file" in str(problem("--no-python", "./bin"))


def test_a_per_worker_name_is_left_to_the_workers() -> None:
    assert problem("train_${local_rank}.py") is None
    assert problem("--no-python", "./run_$local_rank.sh") is None
