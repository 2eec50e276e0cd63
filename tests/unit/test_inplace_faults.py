"""Faults around in-place DDP (issue 20): a rank waiting on a frozen peer is
not hung; what the worker tells its agent while it waits."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

WAITS = r"""
import time
from rdzv_client import worker
worker.waiting()  # before any progress(): never watched, nothing to say
worker.progress(5)
time.sleep(0.1)
worker.waiting()  # blocked in a collective of the library: alive, still at step 5
time.sleep(0.1)
worker.waiting()
print("ok")
"""


def _run(code: str, tmp_path: Path, mode: str) -> tuple[subprocess.CompletedProcess[str], list[bytes]]:
    agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    agent.bind(str(tmp_path / "sock"))
    agent.setblocking(False)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RDZV_", "TORCHELASTIC_"))}
    env.update(PYTHONPATH=str(ROOT), RDZV_AGENT_SOCKET=str(tmp_path / "sock"), RDZV_RESTART_MODE=mode)
    env.update(LOCAL_RANK="0", TORCHELASTIC_RESTART_COUNT="3")
    try:
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
        got = []
        while True:
            try:
                got.append(agent.recv(4096))
            except BlockingIOError:
                return res, got
    finally:
        agent.close()


@pytest.mark.parametrize("mode", ["in-place", "process"])
def test_a_rank_waiting_on_its_peers_tells_its_agent_it_is_alive_in_place_mode(tmp_path: Path, mode: str) -> None:
    """``worker.waiting()`` (what the library's waits call in slices) re-sends
    the last step in in-place mode: the agent's hang watch sees the rank alive
    while a frozen peer holds the collective, and judges only the frozen one.
    Outside in-place mode it says nothing (a collective that never completes
    is a hang there, as before)."""
    res, got = _run(WAITS, tmp_path, mode)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
    assert got == [b"3 0 5"] * (3 if mode == "in-place" else 1) + [b"3 0 end"], got  # end: finished() at exit
