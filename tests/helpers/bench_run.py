"""Run one bench script to its end, as the smoke tests of tests/bench do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_bench(module: str, *argv: str, timeout: float = 50) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGV`` from the repository root, in a session of its own; it must exit 0."""
    proc = subprocess.run(
        [sys.executable, "-m", module, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc
