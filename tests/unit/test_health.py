"""rdzv_client.health: how the agent runs a check (bounded output, timeout
kills the group), and the shipped check against a real server's Date header."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from rdzv_client.health import MAX_LINE, check_clock, check_disk, run_check


def test_run_check_passes_fails_and_keeps_only_the_last_line() -> None:
    assert asyncio.run(run_check("echo one; echo two", 5.0)) == (True, "two")
    ok, line = asyncio.run(run_check("echo disk full; exit 3", 5.0))
    assert not ok and line == "exit status 3: disk full"
    ok, line = asyncio.run(run_check("head -c 1000000 /dev/zero | tr '\\0' x; echo; echo last", 5.0))
    assert ok and line == "last"
    ok, line = asyncio.run(run_check("printf 'x%.0s' $(seq 1 2000)", 5.0))
    assert ok and len(line) <= MAX_LINE


def test_run_check_timeout_kills_the_check() -> None:
    ok, line = asyncio.run(run_check("echo started; sleep 30", 0.5))
    assert not ok and line.startswith("timed out after 0.5s") and "started" in line


def test_disk_check(tmp_path: Path) -> None:
    assert check_disk(tmp_path, 1) is None
    failed = check_disk(tmp_path, 2**62)
    assert failed is not None and "bytes free" in failed
    assert "cannot stat" in (check_disk(tmp_path / "missing", 1) or "")


def test_clock_check_against_an_unreachable_server() -> None:
    failed = check_clock("127.0.0.1:1", 5.0, timeout=2.0)
    assert failed is not None and failed.startswith("clock: cannot reach")
    assert check_clock(None, 5.0) is None


def test_module_runs_without_torch_and_says_one_line(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['torch'] = None; sys.argv = ['h', '--log-dir', %r, '--min-free-disk', '1'];"
        "import runpy; runpy.run_module('rdzv_client.health', run_name='__main__')" % str(tmp_path)
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "health check passed", out
    code = code.replace("'1']", "str(2**62)]")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stdout.strip().startswith("health check failed: disk:"), out
