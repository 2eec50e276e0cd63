"""bench/metrics_scrape.py must not rot: a tiny run. No timing assertions: it
runs, prints its table and gives positive numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_metrics_scrape_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.metrics_scrape",
            "--jobs",
            "3,10",
            "--nodes",
            "2",
            "--runs",
            "2",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| running jobs | refresh on the loop" in proc.stdout and "| 10 x 2 nodes |" in proc.stdout
    small, big = json.loads(out.read_text())
    assert small["jobs"] == 3 and big["jobs"] == 10
    assert big["series"] > small["series"] > 0 and big["refresh_median_s"] > 0 and big["render_median_s"] > 0
