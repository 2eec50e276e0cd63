"""bench/soak_hang.py must not rot: a few seconds of the soak (2 real agents,
real gloo workers, CPU hogs). No timing assertions: it runs, prints its table
and reports steps from both ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(115)]


def test_soak_smoke(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.soak_hang",
            "--minutes",
            "0.05",
            "--hogs",
            "1",
            "--hang-timeout",
            "30",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
        start_new_session=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| hang soak (rdzv only) | result |" in proc.stdout and "false hangs (expected 0)" in proc.stdout
    res = json.loads(out.read_text())
    assert res["state"] == "succeeded" and res["agent_exit_codes"] == [0, 0], res
    assert {k.split()[1] for k in res["steps_per_rank"]} == {"0", "1"} and res["steps"] > 0, res
    assert res["worst_gap_s"] is not None and res["worst_gap_s"] > 0, res
    assert res["hogs"] >= 1 and res["soak_s"] > 0, res
