"""bench/join_cost.py must not rot: 32 nodes, two re-formations, the table and the JSON.
No timing assertions: only that it ran every phase (it checks each re-formation
completed and told every survivor restart and assigned, no joined again, and that each member's
resume told it assigned once) and measured them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.bench_run import run_bench

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


def test_join_cost_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "join_cost.json"
    proc = run_bench("bench.join_cost", "--nodes", "32", "--reps", "2", "--out", str(out))
    assert "| 32 nodes, sqlite, best of 2: CPU µs per survivor | µs |" in proc.stdout, proc.stdout
    rows = ("| restart (", "| rejoin (", "| - of which the parse", "| complete (", "| total |", "| one assigned: build")
    rows += ("| resume (",)
    for row in rows:
        assert row in proc.stdout, proc.stdout
    r = json.loads(out.read_text())
    assert r["nodes"] == 32 and r["reps"] == 2
    for key in (
        "restart_us",
        "rejoin_us",
        "parse_us",
        "complete_us",
        "total_us",
        "formation_us",
        "assigned_build_us",
        "resume_us",
    ):
        assert r[key] > 0, r
    assert r["gc_us"] >= 0 and r["total_us"] >= r["rejoin_us"] and r["assigned_bytes"] > 100


def test_join_cost_bench_direct_smoke(tmp_path: Path) -> None:
    """``--direct``: each re-formation is the leave alone, one restart (with its place) per survivor."""
    out = tmp_path / "join_cost.json"
    proc = run_bench("bench.join_cost", "--nodes", "32", "--reps", "9", "--direct", "--out", str(out))
    assert "| 32 nodes, sqlite, direct re-formation, best of 4: CPU µs per survivor | µs |" in proc.stdout, proc.stdout
    r = json.loads(out.read_text())
    assert r["direct"] is True and r["reps"] == 4 and r["total_us"] > 0 and r["rejoin_us"] < r["total_us"], r
    assert r["resume_us"] > 0 and "| resume (" in proc.stdout, proc.stdout
