"""bench/upgrade_floor.py must not rot: 16 simulated nodes open their WebSocket
to a real rdzv-server and to the floor (a bare uvloop handshake), whose 101
the nodes' client checks as any (the accept key). No timing assertions: both
rows completed, with the CPU counted."""

from __future__ import annotations

import pytest

from tests.helpers.bench_run import run_bench

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def test_upgrade_floor_bench_smoke():
    proc = run_bench("bench.upgrade_floor", "--nodes", "16", "--reps", "1", timeout=110)
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("| rdzv-server") or ln.startswith("| floor")]
    assert [r.split("|")[1].strip() for r in rows] == ["rdzv-server (rep 1)", "floor (rep 1)"], proc.stdout
    for r in rows:
        assert r.split("|")[2].strip().endswith(" us"), r
