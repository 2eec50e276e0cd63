"""bench/upgrade_floor.py must not rot: 16 simulated nodes open their WebSocket
to a real rdzv-server and to the floor (a bare uvloop handshake), whose 101
the nodes' client checks as any (the accept key). No timing assertions: both
rows completed, with the CPU counted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def test_upgrade_floor_bench_smoke():
    proc = subprocess.run(
        [sys.executable, "-m", "bench.upgrade_floor", "--nodes", "16", "--reps", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
        start_new_session=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("| rdzv-server") or ln.startswith("| floor")]
    assert [r.split("|")[1].strip() for r in rows] == ["rdzv-server (rep 1)", "floor (rep 1)"], proc.stdout
    for r in rows:
        assert r.split("|")[2].strip().endswith(" us"), r
