"""examples/train_ddp.py under the stock torchrun: it trains, checkpoints and resumes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_ddp.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")


def run_torchrun(nproc: int, ckpt_dir: Path, *args: str, timeout: float = 60.0) -> str:
    """Run the example under torchrun and return its output; fail (and clean up) on timeout."""
    cmd = [
        str(TORCHRUN) if TORCHRUN.exists() else sys.executable,
        *([] if TORCHRUN.exists() else ["-m", "torch.distributed.run"]),
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(SCRIPT),
        "--ckpt-dir",
        str(ckpt_dir),
        "--step-sleep",
        "0",
        "--ckpt-every",
        "5",
        "--log-every",
        "5",
        *args,
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun forwards SIGTERM to its workers (each in its own session)
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"torchrun timed out after {timeout}s:\n{out[-4000:]}")
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}:\n{out[-4000:]}"
    return out


def test_trains_then_resumes_with_another_world_size(tmp_path: Path) -> None:
    """Two workers train 20 steps and checkpoint; one worker then resumes from step 20 and finishes."""
    ckpt_dir = tmp_path / "ckpt"
    out = run_torchrun(2, ckpt_dir, "--steps", "20")
    lines = out.splitlines()
    assert "started rank 0/2 local_rank 0 restart_count 0 resumed_from_step 0" in lines
    assert "started rank 1/2 local_rank 1 restart_count 0 resumed_from_step 0" in lines
    assert any(ln.startswith("step 20 loss ") and ln.endswith("world_size 2 rank 0 restart 0") for ln in lines)
    assert "done step 20" in lines
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["checkpoint.pt"]

    out = run_torchrun(1, ckpt_dir, "--steps", "30")
    lines = out.splitlines()
    started = [ln for ln in lines if ln.startswith("started ")]
    assert started == ["started rank 0/1 local_rank 0 restart_count 0 resumed_from_step 20"]
    assert not any(ln.startswith("step 5 ") for ln in lines)
    assert any(ln.startswith("step 30 loss ") and "world_size 1" in ln for ln in lines)
    assert "done step 30" in lines
