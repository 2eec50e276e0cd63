"""Worker-channel datagrams from the right peer only (issue 19 item 9): a
same-user process could forge progress for a hung worker and ``assign`` to
an in-place worker (its MASTER_ADDR). Real processes over the real sockets;
the sender is what the kernel says (SO_PASSCRED), never what a datagram says."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rdzv_client import peercred
from rdzv_client.channel import WorkerChannel

ROOT = Path(__file__).resolve().parents[2]
T = 30.0

pytestmark = pytest.mark.skipif(not hasattr(__import__("socket"), "SO_PASSCRED"), reason="Linux SO_PASSCRED")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RDZV_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


async def _until(pred, timeout: float = T) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


FORGER = (
    "import socket, sys\n"
    "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
    "s.sendto(sys.argv[2].encode(), sys.argv[1])\n"
)

# a worker: reports step 1; on "go" a child of it reports step 2 (a descendant), then it exits
WORKER = r"""
import subprocess, sys
from rdzv_client.worker import progress
progress(1)
print("sent", flush=True)
sys.stdin.readline()
code = "from rdzv_client.worker import progress; progress(2)"
subprocess.run([sys.executable, "-c", code], check=True)
print("child sent", flush=True)
sys.stdin.readline()
"""


async def test_agent_takes_datagrams_from_its_workers_only(caplog: pytest.LogCaptureFixture) -> None:
    workers: list[int] = []
    ch = WorkerChannel(nproc=1, workers=lambda: workers)
    await ch.start()
    try:
        assert ch.checked
        ch.new_round(0)
        env = _env(RDZV_AGENT_SOCKET=ch.path, TORCHELASTIC_RESTART_COUNT="0", LOCAL_RANK="0")
        w = await asyncio.create_subprocess_exec(
            sys.executable, "-c", WORKER, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        workers.append(w.pid)
        assert w.stdout is not None and w.stdin is not None
        assert await asyncio.wait_for(w.stdout.readline(), T) == b"sent\n"
        await _until(lambda: 0 in ch.ranks and ch.ranks[0].step == 1)
        # another process of this user writes to the socket: forged steps for rank 0, many times
        with caplog.at_level(logging.WARNING):
            for step in (999, 1000, 1001):
                forger = await asyncio.create_subprocess_exec(
                    sys.executable, "-c", FORGER, ch.path, f"0 0 {step}", env=_env()
                )
                assert await asyncio.wait_for(forger.wait(), T) == 0
            await _until(lambda: ch.forged == 3)
        assert ch.ranks[0].step == 1  # ignored
        said = [r.getMessage() for r in caplog.records if "not one of this agent's workers" in r.getMessage()]
        assert len(said) == 1, said  # logged, rate-limited
        # the worker's child (a descendant in its process group) is the worker's
        w.stdin.write(b"go\n")
        await w.stdin.drain()
        assert await asyncio.wait_for(w.stdout.readline(), T) == b"child sent\n"
        await _until(lambda: ch.ranks[0].step == 2)
        w.stdin.write(b"end\n")
        await w.stdin.drain()
        assert await asyncio.wait_for(w.wait(), T) == 0
        assert ch.forged == 3
    finally:
        ch.close()


def test_from_workers_follows_process_groups_and_parents() -> None:
    me = os.getpid()
    assert peercred.from_workers(me, {me})
    assert peercred.from_workers(me, {os.getppid()})  # a child of a worker
    assert not peercred.from_workers(me, {2**22 + 7})
    assert not peercred.from_workers(0, {1})


# an in-place worker: its first round, then whatever the agent assigns next
INPLACE_WORKER = r"""
import os, sys
from rdzv_client import worker
gen = worker.rounds()
next(gen)
print("bound", flush=True)
sys.stdin.readline()  # the forger wrote, then the agent
while True:
    try:
        worker.progress()
    except worker.MembershipChanged:
        break
second = next(gen)
print("world", second.round, second.master_addr, second.master_port, flush=True)
"""


async def test_in_place_worker_takes_assign_from_its_agent_only() -> None:
    """A forged ``assign`` (MASTER_ADDR 10.66.66.66) from another process is
    ignored and said on the worker's stderr; the agent's own is taken."""
    ch = WorkerChannel(nproc=1)
    await ch.start()
    try:
        ch.new_round(0)
        env = _env(
            RDZV_AGENT_SOCKET=ch.path,
            RDZV_RESTART_MODE="in-place",
            RDZV_AGENT_PID=str(os.getpid()),  # this test process is the agent
            TORCHELASTIC_RESTART_COUNT="0",
            LOCAL_RANK="0",
            RANK="0",
        )
        w = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            INPLACE_WORKER,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert w.stdout is not None and w.stdin is not None and w.stderr is not None
        assert await asyncio.wait_for(w.stdout.readline(), T) == b"bound\n"
        inbox = str(ch.dir / "w0")
        for msg in ("stop 1", "assign 1 RANK=0 WORLD_SIZE=1 MASTER_ADDR=10.66.66.66 MASTER_PORT=4444"):
            forger = await asyncio.create_subprocess_exec(sys.executable, "-c", FORGER, inbox, msg, env=_env())
            assert await asyncio.wait_for(forger.wait(), T) == 0
        assert ch.tell(0, "stop 1")
        assert ch.tell(0, "assign 1 RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.9 MASTER_PORT=5555")
        w.stdin.write(b"go\n")
        await w.stdin.drain()
        out = await asyncio.wait_for(w.stdout.readline(), T)
        err = await asyncio.wait_for(w.stderr.read(), T)
        assert await asyncio.wait_for(w.wait(), T) == 0, err
        assert out == b"world 1 127.0.0.9 5555\n", (out, err)
        assert b"ignored" in err and b"not this worker's agent" in err and err.count(b"ignored") == 1, err
    finally:
        ch.close()
