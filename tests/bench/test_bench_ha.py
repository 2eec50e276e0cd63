"""bench/ha.py (issue 11's HA rows) must not rot: ``--quick`` once (a real
3-member etcd, 3 replicas, 20 simulated nodes, a real 2-agent job, a leader
kill, the torchrun counterpart, the 8-node formation on SQLite and on etcd).
No timing assertions: only that the table prints with every row and that
every process the run started is gone when it returns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TAG_VAR = "HABENCH_SMOKE_TAG"  # inherited by every process the bench starts (not an RDZV_ name: agents scrub those)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

ROWS = ("HA 1. Leader kill -9", "HA 1a.", "HA 1b.", "HA 1c.", "HA 1d.", "HA 2. Formation N=8")


def _tagged(tag: str) -> list[str]:
    needle = f"{TAG_VAR}={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ")[:200].decode(errors="replace")
            found.append(f"{entry}: {cmdline}")
        except OSError:
            continue
    return found


def test_bench_ha_quick(tmp_path: Path) -> None:
    tag = uuid.uuid4().hex
    out = tmp_path / "ha.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.ha", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=140,
        start_new_session=True,
        env={**os.environ, TAG_VAR: tag, "TMPDIR": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout
    assert "| high availability | rdzv | torchrun (same run) | target | met |" in table, table
    for row in ROWS:
        assert sum(line.startswith(f"| {row}") for line in table.splitlines()) >= 1, (row, table)
    assert "SQLite (--data-dir)" in table and "etcd (3 replicas, 3 members)" in table, table
    data = json.loads(out.read_text())
    (run,) = data["failover"]
    assert "error" not in run, run
    assert data["torchrun"], data
    assert _tagged(tag) == [], "the bench left processes behind"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("rdzv-bench-")] == [], "its tmp dir is left"
