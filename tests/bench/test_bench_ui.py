"""Rows 11 and 12 (event delivery, /ui page load) must not rot: a tiny run of
bench/ui_events.py. No timing assertions: only that it runs, prints its rows
and gives positive numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import browser as chromium

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def test_bench_ui_events_smoke():
    proc = subprocess.run(
        [sys.executable, "-m", "bench.ui_events", "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
        start_new_session=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = [ln for ln in proc.stdout.splitlines() if ln.startswith("| ")]
    data = json.loads(proc.stdout[: proc.stdout.rindex("}") + 1])
    d = data["delivery"]
    assert d["missing"] == 0 and d["deliveries"] == 30 and 0 < d["p50_s"] <= d["p99_s"] <= d["max_s"], d
    assert table[0].startswith("| 11. Events: round completed") and "p99" in table[0]
    page = data["page"]
    if not chromium.available():
        assert "skipped" in page and "not measured" in table[1]
        return
    assert page["rows"] == 50 and page["assigned"] == 50, page
    assert page["ready_p50_s"] > 0 and page["refresh_p50_s"] > 0, page
    assert table[1].startswith("| 12. /ui:")
