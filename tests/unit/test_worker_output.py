"""The worker supervisor's messages, logs and console, driven with real tiny
child processes (the rest: test_workers.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from pathlib import Path

import pytest

from rdzv_client.workers import (
    LaunchConfig,
    Std,
    WorkerGroup,
    describe,
    error_file_path,
    read_error_file,
)
from tests.unit.test_workers import WAIT_S, Console, make_group

# ----------------------------------------------------------------- messages


async def test_error_file_from_torch_record_is_parsed(tmp_path: Path) -> None:
    """A worker decorated with torch's @record fails with its exception message and traceback."""
    code = """
        from torch.distributed.elastic.multiprocessing.errors import record

        def inner():
            raise ValueError("boom 42")

        @record
        def main():
            inner()

        main()
    """
    group = make_group(["import time; time.sleep(60)", code], tmp_path, console=None)
    await group.start()
    [info] = await asyncio.wait_for(group.wait(), 60)
    await group.stop(timeout=5)
    assert info.exit_code == 1
    assert info.message.splitlines()[0] == "ValueError: boom 42"
    assert "in inner" in info.message and "Traceback" in info.message
    assert describe(info).endswith(": ValueError: boom 42") and info.source == "error_file"


async def test_string_error_file_and_stale_file(tmp_path: Path) -> None:
    """The plain-string error file format is read, and a stale file from an earlier run is removed."""
    stale = error_file_path(tmp_path / "errors", 0, 0)
    stale.parent.mkdir(parents=True)
    stale.write_text('{"message": "stale"}')
    code = """
        import json, os, sys
        path = os.environ["TORCHELASTIC_ERROR_FILE"]
        if os.path.exists(path):
            sys.exit(9)
        with open(path, "w") as fp:
            json.dump({"message": "plain text failure", "timestamp": 1}, fp)
        sys.exit(5)
    """
    group = make_group(code, tmp_path, console=None)
    await group.start()
    [info] = await asyncio.wait_for(group.wait(), WAIT_S)
    await group.stop()
    assert (info.exit_code, info.message) == (5, "plain text failure")
    # the file the worker was given (a worker kept in place wrote its first round's): what summaries name
    assert info.error_file == str(error_file_path(tmp_path / "errors", 0, 0)) and info.error_file == str(stale)


async def test_stderr_tail_when_no_error_file(tmp_path: Path) -> None:
    """Without an error file, a failure's message is the end of its stderr."""
    code = """
        import sys
        for i in range(100):
            print("noise", i, file=sys.stderr)
        print("fatal: disk full", file=sys.stderr)
        raise SystemExit(2)
    """
    group = make_group(code, tmp_path, console=None)
    await group.start()
    [info] = await asyncio.wait_for(group.wait(), WAIT_S)
    await group.stop()
    # the error line first (the server's root cause reads it), then the tail before it
    assert info.message.splitlines()[0] == "fatal: disk full"
    assert info.message.splitlines()[-1] == "noise 99"
    assert "noise 0" not in info.message and info.source == "stderr"
    assert describe(info).endswith("exited with code 2: fatal: disk full")


SHARED_CODE = """
    import sys
    print("out 1", flush=True)
    sys.stderr.write("\\rbar 1\\rbar 2\\n"); sys.stderr.flush()
    print("out 2", flush=True)
    print("fatal: disk full", file=sys.stderr, flush=True)
    raise SystemExit(2)
"""


async def test_shared_console_one_file_keeps_order_and_bytes(tmp_path: Path) -> None:
    """share_console with the agent's stdout and stderr one file (``> log 2>&1``):
    both of a worker's streams land there in the order written, unprefixed,
    carriage returns intact; stderr's tail still explains the failure."""
    with open(tmp_path / "agent.log", "w") as log:
        group = make_group(SHARED_CODE, tmp_path, console=log, stderr=log, share_console=True)
        await group.start()
        [info] = await asyncio.wait_for(group.wait(), WAIT_S)
        await group.stop()
    assert (tmp_path / "agent.log").read_bytes().decode() == "out 1\n\rbar 1\rbar 2\nout 2\nfatal: disk full\n"
    assert info.exit_code == 2 and info.message.splitlines()[0] == "fatal: disk full", info


async def test_shared_console_stdout_is_the_agents_own(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """share_console with stdout and stderr apart: the worker writes to the
    agent's stdout itself; its stderr is copied byte for byte to the agent's
    stderr; a filter, tee or redirect turns sharing off (prefixed lines)."""
    with open(tmp_path / "err.log", "w") as err:
        group = make_group(SHARED_CODE, tmp_path, stderr=err, share_console=True)
        await group.start()
        [info] = await asyncio.wait_for(group.wait(), WAIT_S)
        await group.stop()
    assert capfd.readouterr().out == "out 1\nout 2\n"
    assert (tmp_path / "err.log").read_bytes().decode() == "\rbar 1\rbar 2\nfatal: disk full\n"
    assert info.message.splitlines()[0] == "fatal: disk full"
    console = Console()
    group = make_group(SHARED_CODE, tmp_path, console=console, share_console=True, local_ranks_filter={0})
    await group.start()
    await asyncio.wait_for(group.wait(), WAIT_S)
    await group.stop()
    assert "[8]: out 1" in console.lines() and "[8]: fatal: disk full" in console.lines()


async def test_shared_console_closed_output_does_not_block_workers(tmp_path: Path) -> None:
    """The agent's stderr is a pipe whose reader went away (``| head``): the
    copy keeps draining, so a worker writing a lot still ends, and its tail
    still explains the failure."""
    r, w = os.pipe()
    os.close(r)
    code = (
        "import sys; sys.stderr.write('x' * 100 + '\\n'); [sys.stderr.write('y' * 1000 + '\\n') for _ in range(2000)]; "
    )
    code += "print('fatal: after the flood', file=sys.stderr); sys.exit(3)"
    err = os.fdopen(w, "w")
    try:
        group = make_group(code, tmp_path, stderr=err, share_console=True)
        await group.start()
        [info] = await asyncio.wait_for(group.wait(), WAIT_S)
        await group.stop()
    finally:
        with contextlib.suppress(BrokenPipeError):
            err.close()  # it may still hold what it could not write
    assert info.exit_code == 3 and info.message.splitlines()[0] == "fatal: after the flood", info


async def test_stderr_tail_from_redirected_file(tmp_path: Path) -> None:
    """When stderr is redirected to its log file, the message comes from that file."""
    code = "import sys; print('fatal: from file', file=sys.stderr); sys.exit(4)"
    group = make_group(code, tmp_path, console=Console(), log_dir=tmp_path / "logs", redirects=Std.ERR)
    await group.start()
    [info] = await asyncio.wait_for(group.wait(), WAIT_S)
    await group.stop()
    assert info.message == "fatal: from file"


def test_error_message_is_trimmed(tmp_path: Path) -> None:
    """A huge traceback is cut to its head plus its last lines, within the wire's message limit."""
    from rdzv_common.protocol import MAX_ERROR_MESSAGE

    path = tmp_path / "error.json"
    frames = "".join(f'  File "x.py", line {i}, in f{i}\n    f{i + 1}()\n' for i in range(500))
    path.write_text(
        '{"message": {"message": "RecursionError: deep", "extraInfo": {"py_callstack": '
        + __import__("json").dumps("Traceback (most recent call last):\n" + frames + "RecursionError: deep\n")
        + ', "timestamp": "1"}}}'
    )
    message = read_error_file(path)
    assert message is not None and len(message) <= MAX_ERROR_MESSAGE
    assert len(message) > MAX_ERROR_MESSAGE // 2  # trimmed, not emptied
    assert message.startswith("RecursionError: deep\n")
    assert message.rstrip().endswith("f500()")
    assert read_error_file(tmp_path / "absent.json") is None


# ------------------------------------------------------------ logs and console


async def test_log_files_per_attempt(tmp_path: Path) -> None:
    """Redirected streams go to attempt_N/<local_rank>/{stdout,stderr}.log and not to the console."""
    code = (
        "import os, sys; print('out', os.environ['LOCAL_RANK']); "
        "print('err', os.environ['LOCAL_RANK'], file=sys.stderr)"
    )
    console = Console()
    log_dir = tmp_path / "logs"
    for attempt in (0, 3):
        group = make_group([code, code], tmp_path, attempt=attempt, console=console, log_dir=log_dir, redirects=Std.ALL)
        await group.start()
        infos = await asyncio.wait_for(group.wait(), WAIT_S)
        await group.stop()
        assert all(i.ok for i in infos)
    assert console.getvalue() == ""
    for attempt in (0, 3):
        for rank in (0, 1):
            d = log_dir / f"attempt_{attempt}" / str(rank)
            assert (d / "stdout.log").read_text() == f"out {rank}\n"
            assert (d / "stderr.log").read_text() == f"err {rank}\n"


async def test_tee_and_redirect_per_rank(tmp_path: Path) -> None:
    """tee copies to file and console; a redirect keeps the stream off the console; others show as usual."""
    code = "import os, sys; r = os.environ['LOCAL_RANK']; print('out', r); print('err', r, file=sys.stderr)"
    console = Console()
    log_dir = tmp_path / "logs"
    group = make_group(
        [code, code, code],
        tmp_path,
        console=console,
        log_dir=log_dir,
        tee={0: Std.OUT},
        redirects={1: Std.ERR},
    )
    await group.start()
    await asyncio.wait_for(group.wait(), WAIT_S)
    await group.stop()
    assert sorted(console.lines()) == sorted(["[8]: out 0", "[8]: err 0", "[9]: out 1", "[10]: out 2", "[10]: err 2"])
    d = log_dir / "attempt_0"
    assert (d / "0" / "stdout.log").read_text() == "out 0\n"
    assert not (d / "0" / "stderr.log").exists()
    assert (d / "1" / "stderr.log").read_text() == "err 1\n"
    assert not (d / "1" / "stdout.log").exists()
    assert not (d / "2" / "stdout.log").exists()


async def test_local_ranks_filter(tmp_path: Path) -> None:
    """local_ranks_filter limits the console but never the log files."""
    code = "import os; print('hello', os.environ['LOCAL_RANK'])"
    console = Console()
    log_dir = tmp_path / "logs"
    group = make_group([code, code], tmp_path, console=console, log_dir=log_dir, tee=Std.ALL, local_ranks_filter={1})
    await group.start()
    await asyncio.wait_for(group.wait(), WAIT_S)
    await group.stop()
    assert console.lines() == ["[9]: hello 1"]
    assert (log_dir / "attempt_0" / "0" / "stdout.log").read_text() == "hello 0\n"
    assert (log_dir / "attempt_0" / "1" / "stdout.log").read_text() == "hello 1\n"


async def test_custom_prefix_and_partial_last_line(tmp_path: Path) -> None:
    """prefix_fn overrides the prefix, and a last line without newline is still printed whole."""
    config = LaunchConfig(
        cmd=[sys.executable, "-c", "import sys; sys.stdout.write('a\\nno newline')"], local_world_size=1
    )
    console = Console()
    group = WorkerGroup(config, [dict(os.environ)], 0, console=console, prefix_fn=lambda r: f"<w{r}> ")
    await group.start()
    await asyncio.wait_for(group.wait(), WAIT_S)
    await group.stop()
    assert console.getvalue() == "<w0> a\n<w0> no newline\n"


async def test_large_output_does_not_deadlock(tmp_path: Path) -> None:
    """Two workers writing 5 MB each finish, and console lines never interleave mid-line."""
    code = """
        import os, sys
        r = os.environ['LOCAL_RANK']
        line = (r * 99) + "\\n"
        for _ in range(50_000):
            sys.stdout.write(line)
        sys.stderr.write("x" * 200_000 + "\\n")
    """
    console = Console()
    log_dir = tmp_path / "logs"
    group = make_group([code, code], tmp_path, console=console, log_dir=log_dir, tee=Std.OUT)
    await group.start()
    infos = await asyncio.wait_for(group.wait(), 30)
    await group.stop()
    assert all(i.ok for i in infos)
    lines = console.lines()
    out = [ln for ln in lines if "x" not in ln]
    assert len(out) == 2 * 50_000
    assert sorted(set(out)) == ["[8]: " + "0" * 99, "[9]: " + "1" * 99]
    # the 200 KB stderr line is printed in prefixed pieces, never mixed with other lines
    long = [ln for ln in lines if "x" in ln]
    for prefix in ("[8]: ", "[9]: "):
        pieces = [ln[len(prefix) :] for ln in long if ln.startswith(prefix)]
        assert "".join(pieces) == "x" * 200_000
    assert len(long) == sum(1 for ln in long if ln.startswith(("[8]: x", "[9]: x")))
    assert (log_dir / "attempt_0" / "0" / "stdout.log").stat().st_size == 5_000_000


async def test_undecodable_bytes_are_replaced(tmp_path: Path) -> None:
    """Bytes that are not UTF-8 reach the console replaced, not as an error."""
    console = Console()
    group = make_group("import sys; sys.stdout.buffer.write(b'bad \\xff byte\\n')", tmp_path, console=console)
    await group.start()
    await asyncio.wait_for(group.wait(), WAIT_S)
    await group.stop()
    assert console.lines() == ["[8]: bad \ufffd byte"]
