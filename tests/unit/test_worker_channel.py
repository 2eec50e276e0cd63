"""The worker channel: rdzv_client.worker (the worker side) and
rdzv_client.channel (the agent side), over a real Unix datagram socket."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rdzv_client.channel import FileTimerServer, WorkerChannel
from rdzv_common.protocol import AGENT_MESSAGE, HEARTBEAT_FRAME, ExitRecord, HeartbeatMsg

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("RDZV_", "TORCHELASTIC_"))}
    full["PYTHONPATH"] = str(ROOT)
    full.update(env or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=60)


def test_worker_module_imports_only_the_standard_library() -> None:
    r = _run(
        "import sys, rdzv_client.worker\n"
        "print(sorted(m for m in ('aiohttp', 'pydantic', 'torch', 'rdzv_server', 'rdzv_common') "
        "if m in sys.modules))"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_progress_without_an_agent_does_nothing() -> None:
    r = _run("from rdzv_client.worker import progress\nfor i in range(1000): progress(i)\nprogress()\nprint('ok')")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    # an agent socket that is not there: still nothing, never an error
    r = _run(
        "from rdzv_client.worker import progress\nprogress(1)\nprint('ok')", {"RDZV_AGENT_SOCKET": "/nonexistent/sock"}
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_sigusr1_dumps_every_thread_stack_to_stderr() -> None:
    r = _run(
        "import os, signal, threading, time, rdzv_client.worker\n"
        "threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\nprint('alive')"
    )
    assert r.returncode == 0 and r.stdout.strip() == "alive", r.stderr
    assert r.stderr.count("most recent call first") >= 2, r.stderr


async def _until(pred, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_agent_sees_each_ranks_last_step_from_real_workers() -> None:
    ch = WorkerChannel(nproc=2)
    await ch.start()
    try:
        assert stat.S_IMODE(os.stat(ch.dir).st_mode) == 0o700
        ch.new_round(3)
        code = (
            "import time\nfrom rdzv_client.worker import progress\n"
            "for s in range(1, 6):\n    progress(s)\n    time.sleep(0.06)\n"
        )
        env = {"RDZV_AGENT_SOCKET": ch.path, "TORCHELASTIC_RESTART_COUNT": "3"}
        procs = [
            await asyncio.create_subprocess_exec(
                sys.executable, "-c", code, env={**os.environ, "PYTHONPATH": str(ROOT), **env, "LOCAL_RANK": str(lr)}
            )
            for lr in range(2)
        ]
        for p in procs:
            assert await asyncio.wait_for(p.wait(), 60) == 0
        await _until(lambda: {lr: rp.step for lr, rp in ch.ranks.items()} == {0: 5, 1: 5})
        # a datagram from the previous round's workers, or malformed, or out of range: dropped
        before = dict((lr, rp.step) for lr, rp in ch.ranks.items())
        for bad in (b"2 0 99", b"3 2 99", b"3 0 -1", b"3 0 x", b"", b"3 0 1 2", b"9" * 200, b"2 0 end"):
            ch.received(bad, time.monotonic())
        assert {lr: rp.step for lr, rp in ch.ranks.items()} == before and ch.dropped == 8
        # the workers exited: finished() (at exit) ended the watch, so teardown is no hang
        await _until(lambda: all(rp.finished for rp in ch.ranks.values()))
        now = time.monotonic()
        ch.ranks[1].at = now - 10
        assert ch.hung(5.0, now) == []
        # a progress() call after finished() starts the watch again; silent past the timeout: hung
        ch.received(b"3 1 6", now - 10)
        assert ch.hung(5.0, now) == [1] and ch.ranks[1].step == 6
        assert ch.sample(now) is not None
    finally:
        ch.close()
    assert not ch.dir.exists()


async def test_virtual_local_rank_workers_are_told_apart_on_the_channel() -> None:
    """--virtual-local-rank gives every worker LOCAL_RANK=0: the channel still
    sees each one by RDZV_LOCAL_RANK (a hung rank is not hidden behind rank 0)."""
    ch = WorkerChannel(nproc=2)
    await ch.start()
    try:
        ch.new_round(0)
        code = "from rdzv_client.worker import progress\nprogress(7)\n"
        procs = [
            await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                code,
                env={
                    **os.environ,
                    "PYTHONPATH": str(ROOT),
                    "RDZV_AGENT_SOCKET": ch.path,
                    "TORCHELASTIC_RESTART_COUNT": "0",
                    "LOCAL_RANK": "0",
                    "RDZV_LOCAL_RANK": str(lr),
                },
            )
            for lr in range(2)
        ]
        for p in procs:
            assert await asyncio.wait_for(p.wait(), 60) == 0
        await _until(lambda: {lr: rp.step for lr, rp in ch.ranks.items()} == {0: 7, 1: 7}, timeout=15.0)
    finally:
        ch.close()


async def test_progress_sent_while_the_agent_ran_late_is_not_a_hang() -> None:
    """The agent's loop ran late (a loaded machine: it got no CPU for longer
    than the hang timeout) while its worker kept calling progress(): the
    datagrams waiting in the socket count before a hang is judged."""
    ch = WorkerChannel(nproc=1)
    await ch.start()
    try:
        ch.new_round(0)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "RDZV_AGENT_SOCKET": ch.path}
        env.update(TORCHELASTIC_RESTART_COUNT="0", LOCAL_RANK="0")
        env.pop("RDZV_LOCAL_RANK", None)
        # os._exit: no finished() at exit, the watch goes on (a worker still in its loop)
        code = "import os, sys\nfrom rdzv_client.worker import progress\nprogress(int(sys.argv[1]))\nos._exit(0)\n"
        p = await asyncio.create_subprocess_exec(sys.executable, "-c", code, "1", env=env)
        assert await asyncio.wait_for(p.wait(), 60) == 0
        await _until(lambda: 0 in ch.ranks and ch.ranks[0].step == 1)
        # the event loop does not run from here to the check: the agent is late
        assert subprocess.run([sys.executable, "-c", code, "2"], env=env, timeout=60).returncode == 0
        time.sleep(1.2)
        assert ch.hung(1.0, time.monotonic()) == [] and ch.ranks[0].step == 2
        # nothing came since: hung one timeout later
        time.sleep(1.2)
        assert ch.hung(1.0, time.monotonic()) == [0]
    finally:
        ch.close()


def test_progress_heartbeat_form_is_validated_and_the_plain_frame_unchanged() -> None:
    assert HeartbeatMsg().model_dump_json() == HEARTBEAT_FRAME
    msg = AGENT_MESSAGE.validate_json(HeartbeatMsg(step=7, rate=2.5).model_dump_json())
    assert isinstance(msg, HeartbeatMsg) and msg.step == 7 and msg.rate == 2.5
    for bad in (
        '{"op":"hb","step":-1}',
        '{"op":"hb","rate":"fast"}',
        '{"op":"hb","step":1,"x":1}',
        '{"op":"hb","rate":1e400}',
    ):
        with pytest.raises(ValueError):
            AGENT_MESSAGE.validate_json(bad)


def test_hang_record_says_hung_after_step() -> None:
    rec = ExitRecord(local_rank=0, rank=3, pid=10, message="no progress() for 5.1s", reason="hang", last_step=42)
    assert rec.describe() == "rank 3 (local rank 0, pid 10) hung after step 42: no progress() for 5.1s"


async def test_file_timer_pipe_reads_torch_requests_and_kills_only_our_workers(tmp_path: Path) -> None:
    killed: list[tuple[int, str]] = []
    victim = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(60)")
    bystander = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(60)")
    srv = FileTimerServer(
        str(tmp_path / "timer"), allowed=lambda: [victim.pid], on_expired=lambda pid, scope: killed.append((pid, scope))
    )
    srv.start()
    try:
        assert stat.S_IMODE(os.stat(srv.path).st_mode) == 0o600
        fd = os.open(srv.path, os.O_WRONLY | os.O_NONBLOCK)
        past = time.time() - 1
        lines = [
            {"version": 1, "pid": victim.pid, "scope_id": "a", "expiration_time": past, "signal": 9},
            {"version": 1, "pid": bystander.pid, "scope_id": "b", "expiration_time": past, "signal": 9},
            {"version": 1, "pid": victim.pid, "scope_id": "c", "expiration_time": time.time() + 600, "signal": 9},
        ]
        os.write(fd, b"".join(json.dumps(x).encode() + b"\n" for x in lines) + b"not json\n")
        os.close(fd)
        await _until(lambda: len(srv.timers) == 3 and srv.dropped == 1)
        srv.check()
        assert killed == [(victim.pid, "a")]
        assert await asyncio.wait_for(victim.wait(), 30) == -9
        assert bystander.returncode is None and list(srv.timers) == [(victim.pid, "c")]
    finally:
        srv.close()
        for p in (victim, bystander):
            if p.returncode is None:
                p.kill()
                await p.wait()
    assert not os.path.exists(srv.path)
