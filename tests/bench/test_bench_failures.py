"""bench/failures.py (rows 11 and 12) must not rot: each row once, rdzv only,
tiny bounds. No timing assertions: only that it runs, prints its row and
produces a positive number where rdzv recovers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(115)]


def _run(tmp_path: Path, only: str, *flags: str) -> tuple[str, dict]:
    out = tmp_path / "failures.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.failures", "--smoke", "--only", only, *flags, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
        start_new_session=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| row | rdzv median (min-max) | torchrun median (min-max) |" in proc.stdout
    return proc.stdout, json.loads(out.read_text())


def test_hang_row_smoke(tmp_path: Path) -> None:
    # --hang-timeout 3 (default 5): the workers step every 0.1 s, as in the e2e hang tests
    table, data = _run(tmp_path, "hang", "--hang-timeout", "3")
    assert "13. Worker hangs" in table and "`--hang-timeout 3`" in table
    (rdzv,) = data["hang"]["rdzv"]
    assert rdzv["failure"] is None and rdzv["value"] > 0, rdzv
    assert rdzv["info"]["hang_reported_s"] > 0 and rdzv["info"]["stop_to_first_step"] > 0, rdzv


def test_bad_host_row_smoke(tmp_path: Path) -> None:
    table, data = _run(tmp_path, "bad_host")
    assert "14. A host whose worker fails at every start" in table
    (rdzv,) = data["bad_host"]["rdzv"]
    assert rdzv["failure"] is None and rdzv["value"] > 0, rdzv
    assert rdzv["info"]["bad_host_state"] == "cooled_down" and rdzv["info"]["failures"] >= 1, rdzv
