"""bench/fanout.py must not rot: 8 connections, one round of each message by each path.
No timing assertions: only that it ran and measured all four cases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.bench_run import run_bench

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


def test_fanout_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "fanout.json"
    proc = run_bench("bench.fanout", "--nodes", "8", "--rounds", "1", "--out", str(out))
    assert "| 8 | broadcast |" in proc.stdout and "| 8 | per node |" in proc.stdout, proc.stdout
    (r,) = json.loads(out.read_text())
    for key in ("direct broadcast us", "direct per node us", "queued broadcast us", "queued per node us"):
        assert r[key] > 0, r
