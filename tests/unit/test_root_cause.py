"""A failure's root cause is the line that names the error (issue 13, item 13):
the error file's message when the worker wrote one, else the last exception
line of the traceback on stderr, never "Traceback (most recent call last):"
or a warning printed before it."""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rdzv_client.exits import ExitInfo, entrypoint_name, failure_summary
from rdzv_client.workers import LaunchConfig, WorkerGroup, describe, error_file_path, root_cause_line, worker_env
from rdzv_common.protocol import Assignment, ExitRecord

WAIT_S = 30.0

WARNING_THEN_TRACEBACK = """\
/opt/venv/lib/python3.11/site-packages/numpy/_core/getlimits.py:551: UserWarning: The value of the smallest subnormal
  setattr(self, word, getattr(machar, word).flat[0])
Traceback (most recent call last):
  File "/work/train.py", line 12, in <module>
    main()
  File "/work/train.py", line 9, in main
    raise ValueError("bad lr")
ValueError: bad lr
""".splitlines()

CHAINED = """\
Traceback (most recent call last):
  File "t.py", line 3, in <module>
    open("/nope")
FileNotFoundError: [Errno 2] No such file or directory: '/nope'

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "t.py", line 5, in <module>
    raise RuntimeError("cannot load the checkpoint") from e
RuntimeError: cannot load the checkpoint
""".splitlines()


def test_traceback_after_a_warning_names_the_error() -> None:
    assert root_cause_line(WARNING_THEN_TRACEBACK) == "ValueError: bad lr"


def test_chained_exceptions_name_the_last_one() -> None:
    assert root_cause_line(CHAINED) == "RuntimeError: cannot load the checkpoint"


def test_lines_after_the_traceback_do_not_hide_it() -> None:
    # interpreter teardown noise after the exception line
    lines = WARNING_THEN_TRACEBACK + ["[W socket.cpp:663] closing the store", ""]
    assert root_cause_line(lines) == "ValueError: bad lr"


def test_traceback_whose_header_scrolled_out_of_the_tail() -> None:
    # only the last frames of a deep traceback are kept
    lines = [
        '  File "x.py", line 7, in f7',
        "    f8()",
        '  File "x.py", line 8, in f8',
        "    raise KeyError('lr')",
        "KeyError: 'lr'",
    ]
    assert root_cause_line(lines) == "KeyError: 'lr'"


def test_multi_line_exception_message_gives_its_first_line() -> None:
    lines = [
        "Traceback (most recent call last):",
        '  File "t.py", line 1, in <module>',
        "ValueError: first line",
        "second line of the message",
    ]
    assert root_cause_line(lines) == "ValueError: first line"


def test_no_traceback_gives_the_last_line() -> None:
    assert root_cause_line(["starting", "fatal: disk full", "  "]) == "fatal: disk full"
    assert root_cause_line([]) == ""


def _group(code: str, tmp_path: Path) -> WorkerGroup:
    a = Assignment(
        job_id="job1",
        round=0,
        group_rank=0,
        group_world_size=1,
        local_world_size=1,
        rank_offset=0,
        world_size=1,
        master_addr="127.0.0.1",
        master_port=29555,
        max_restarts=0,
        restarts=0,
    )
    env = worker_env(os.environ, a, 0, "job1", str(error_file_path(tmp_path / "errors", 0, 0)))
    env["CODE"] = textwrap.dedent(code)
    env["PYTHONWARNINGS"] = "default"
    cfg = LaunchConfig(cmd=[sys.executable, "-c", "import os; exec(os.environ['CODE'])"], local_world_size=1)
    return WorkerGroup(cfg, [env], attempt=0, console=None)


async def test_real_worker_traceback_reaches_the_exit_record_as_the_error(tmp_path: Path) -> None:
    """A real worker prints a warning, then dies of a chained exception: the
    message the agent reports starts with the error, so the server's root
    cause (ExitRecord.describe, first line) and the agent's line name it."""
    code = """
        import warnings
        warnings.warn("numpy noise before the real error")
        def main():
            try:
                {}["lr"]
            except KeyError as e:
                raise ValueError("bad lr") from e
        main()
    """
    group = _group(code, tmp_path)
    await group.start()
    [info] = await asyncio.wait_for(group.wait(), WAIT_S)
    await group.stop()
    assert info.exit_code == 1 and info.source == "stderr"
    assert info.message.splitlines()[0] == "ValueError: bad lr", info.message
    assert "Traceback (most recent call last):" in info.message  # the tail is still there
    assert describe(info).endswith(": ValueError: bad lr")
    rec = ExitRecord(
        local_rank=0, rank=0, pid=info.pid, exit_code=info.exit_code, message=info.message, timestamp=time.time()
    )
    assert rec.describe().endswith("failed with exit code 1: ValueError: bad lr"), rec.describe()


# ------------------------------------------------- torchrun's failure summary


def test_failure_summary_is_torchruns_block(tmp_path: Path) -> None:
    """Field for field what torch's ChildFailedError.format_msg prints: an
    error file written by @record (the root cause: earliest), a worker killed
    by a signal, and one that exited without an error file."""
    import socket

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure, record

    error_file = tmp_path / "error.json"
    os.environ["TORCHELASTIC_ERROR_FILE"] = str(error_file)
    try:

        @record
        def boom() -> None:
            raise ValueError("boom")

        with pytest.raises(ValueError):
            boom()
    finally:
        del os.environ["TORCHELASTIC_ERROR_FILE"]
    # error files carry whole seconds: on a tie both pick the first failure, the error file's
    theirs = {
        4: ProcessFailure(local_rank=0, pid=101, exitcode=1, error_file=str(error_file)),
        5: ProcessFailure(local_rank=1, pid=102, exitcode=-9, error_file=str(tmp_path / "none.json")),
        6: ProcessFailure(local_rank=2, pid=103, exitcode=3, error_file=str(tmp_path / "none.json")),
    }
    ours = [
        (4, ExitInfo(0, 101, 1, None, "ignored: the error file wins", time.time()), str(error_file)),
        (5, ExitInfo(1, 102, None, "SIGKILL", "", float(theirs[5].timestamp)), str(tmp_path / "none.json")),
        (6, ExitInfo(2, 103, 3, None, "", float(theirs[6].timestamp)), None),
    ]
    expected = ChildFailedError("train.py", theirs).format_msg()
    assert failure_summary("train.py", ours, socket.getfqdn()) == expected.strip("\n")
    hidden = failure_summary("train.py", ours, socket.getfqdn(), show_paths=False)
    assert str(error_file) not in hidden and "error_file: <N/A>" in hidden and "ValueError: boom" in hidden


def test_failure_summary_without_error_file_shows_the_stderr_tail() -> None:
    info = ExitInfo(0, 7, 2, None, "fatal: disk full\nnoise 98\nnoise 99", 1.0e9)
    text = failure_summary("python", [(0, info, None)], "h")
    assert "  traceback : fatal: disk full\n  noise 98\n  noise 99\n" in text
    assert entrypoint_name([sys.executable, "-u", "-m", "pkg.train", "--x"], sys.executable) == "pkg.train"
    assert entrypoint_name(["./run.sh", "a"], sys.executable) == "./run.sh"
