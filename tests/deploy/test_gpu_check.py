"""scripts/gpu-check: without a GPU it says so in one line; it drives the real
programs on loopback; its flow rehearsed on CPU."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from tests.deploy.deploy_files import (
    REPO,
    help_text,
    run,
)

GPU_CHECK = REPO / "scripts" / "gpu-check"


def test_gpu_check_without_a_gpu_says_so_in_one_line():
    """On a machine without a visible CUDA GPU (here: none, or hidden with CUDA_VISIBLE_DEVICES=""),
    gpu-check starts nothing, prints one clear line and exits 2."""
    help_text("rdzv_client.agent")  # skips while the agent cannot be imported
    result = run([sys.executable, str(GPU_CHECK)], env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert result.returncode == 2, result
    assert result.stdout == "" and len(result.stderr.strip().splitlines()) == 1, result
    assert result.stderr.startswith("gpu-check: no CUDA GPU visible here") and "NVIDIA" in result.stderr
    assert os.access(GPU_CHECK, os.X_OK)


def test_gpu_check_uses_the_real_programs_on_loopback_only():
    """gpu-check starts the project's real server and agent, binds 127.0.0.1 only (NCCL/gloo too),
    and its NCCL worker all_reduces on cuda with backend nccl."""
    text = GPU_CHECK.read_text()
    assert '"-m", "rdzv_client.agent"' in text and '"-m", "rdzv_server"' in text
    assert '"--host", "127.0.0.1"' in text and "0.0.0.0" not in text
    assert 'setdefault("NCCL_SOCKET_IFNAME", "lo")' in text and 'setdefault("GLOO_SOCKET_IFNAME", "lo")' in text
    assert "pkill" not in text and "killall" not in text
    worker = (REPO / "scripts" / "gpu_worker.py").read_text()
    assert (
        'default="nccl"' in worker and "dist.all_reduce(t)" in worker and 'torch.device("cuda", local_rank)' in worker
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpu_check_rehearsal_on_cpu(tmp_path):
    """The first five checks on CPU with gloo (--rehearse-on-cpu 2): real server, real agents, the split,
    the node-loss drill re-forming after one agent and its workers were SIGKILLed, and the in-place
    drill (the survivor's worker keeps its pid); every worker process gone afterwards."""
    help_text("rdzv_client.agent")
    workdir = tmp_path / "gpu-check"
    result = run(
        [sys.executable, str(GPU_CHECK), "--rehearse-on-cpu", "2", "--drill-seconds", "4", "--workdir", str(workdir)],
        timeout=290,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    table = result.stdout[result.stdout.index("\ncheck") :].strip().splitlines()
    assert re.fullmatch(r"check\s+\| result\s+\| seconds", table[0]), table
    rows = [line.split(" | ") for line in table[2:]]
    assert [row[0].strip() for row in rows] == [
        "--nproc-per-node 2 detection",
        "standalone gloo job on all 2",
        "2 agents split CUDA_VISIBLE_DEVICES",
        "node-loss drill (gloo)",
        "in-place drill (gloo)",
        "NCCL RAS names a lock-step straggler",
    ], rows
    assert all(row[1].startswith("ok") and float(row[2]) >= 0 for row in rows[:5]), rows
    assert rows[5][1].strip() == "skipped: NCCL RAS needs NCCL", rows  # (check 6 runs on GPUs only)
    assert "re-formed as world 1" in rows[3][1]
    # the survivor's worker kept its pid and ran an all_reduce in the new world (the seconds: a report)
    assert re.search(r"1 kept pid\(s\), first gloo all_reduce in world 1 [0-9.]+s after the kill", rows[4][1])
    pids = {json.loads(p.read_text())["pid"] for p in workdir.rglob("*.json")}
    assert len(pids) >= 6, pids
    for pid in pids:  # gone (or the pid already reused by something that is not our worker)
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        assert b"gpu_worker.py" not in cmdline, f"worker {pid} still running"
