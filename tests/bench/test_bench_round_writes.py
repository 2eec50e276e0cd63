"""bench/round_writes.py must not rot: 64 nodes, both backends, the old way (each
survivor joins again: two SQLite transactions a change) and --direct (the round
formed as it opens: one). No timing assertions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.bench_run import run_bench

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


@pytest.mark.parametrize(("direct", "sqlite_requests"), [(False, 2), (True, 1)])
def test_round_writes_bench_smoke(tmp_path: Path, direct: bool, sqlite_requests: int) -> None:
    out = tmp_path / "writes.json"
    argv = ["--nodes", "64", "--changes", "2", "--out", str(out), *(["--direct"] if direct else [])]
    run_bench("bench.round_writes", *argv)
    rows = {r["backend"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"sqlite", "etcd"} and all(r["first_bytes"] > 0 for r in rows.values()), rows
    assert rows["sqlite"]["first_requests"] == sqlite_requests, rows
