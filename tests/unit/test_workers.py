"""The worker supervisor, driven with real tiny child processes."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import sys
import textwrap
import time
from pathlib import Path
from typing import TextIO

import pytest

from rdzv_client import workers
from rdzv_client.workers import (
    ExitInfo,
    LaunchConfig,
    Std,
    WorkerGroup,
    describe,
    error_file_path,
    parse_std,
    worker_env,
)
from rdzv_common.protocol import Assignment

WAIT_S = 15.0


def assignment(local_world_size: int = 2, **kw: object) -> Assignment:
    fields: dict[str, object] = dict(
        job_id="job1",
        round=4,
        group_rank=1,
        group_world_size=3,
        local_world_size=local_world_size,
        rank_offset=8,
        world_size=20,
        master_addr="10.0.0.7",
        master_port=29555,
        max_restarts=5,
        restarts=2,
    )
    fields.update(kw)
    return Assignment(**fields)  # type: ignore[arg-type]


class Console(io.StringIO):
    """A console that records writes and lets tests await a substring."""

    def __init__(self) -> None:
        super().__init__()
        self._waiters: list[tuple[str, asyncio.Event]] = []

    def write(self, s: str) -> int:
        n = super().write(s)
        text = self.getvalue() if self._waiters else ""
        for needle, event in self._waiters:
            if needle in text:
                event.set()
        return n

    async def wait_for(self, needle: str, timeout: float = WAIT_S) -> None:
        event = asyncio.Event()
        self._waiters.append((needle, event))
        if needle in self.getvalue():
            event.set()
        await asyncio.wait_for(event.wait(), timeout)

    def lines(self) -> list[str]:
        return self.getvalue().splitlines()


def make_group(
    codes: list[str] | str,
    tmp_path: Path,
    *,
    attempt: int = 0,
    console: TextIO | None = None,
    log_dir: Path | None = None,
    stderr: TextIO | None = None,
    **config_kw: object,
) -> WorkerGroup:
    """A group whose local rank i runs ``python -c codes[i]``, with torchrun's env."""
    if isinstance(codes, str):
        codes = [codes]
    n = len(codes)
    a = assignment(local_world_size=n, round=attempt)
    err_root = log_dir or tmp_path / "errors"
    envs = []
    for i, code in enumerate(codes):
        env = worker_env(os.environ, a, i, "job1", str(error_file_path(err_root, attempt, i)))
        env["CODE"] = textwrap.dedent(code)
        envs.append(env)
    config = LaunchConfig(
        cmd=[sys.executable, "-c", "import os; exec(os.environ['CODE'])"],
        local_world_size=n,
        log_dir=log_dir,
        **config_kw,  # type: ignore[arg-type]
    )
    return WorkerGroup(config, envs, attempt=attempt, console=console, stderr=stderr)


def is_gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (absent, or a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as fp:
            return fp.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


async def wait_gone(pid: int, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not is_gone(pid):
        assert time.monotonic() < deadline, f"pid {pid} still alive"
        await asyncio.sleep(0.01)


# ---------------------------------------------------------------- environment


def test_worker_env_is_exactly_torchruns_table() -> None:
    """worker_env adds exactly the table of docs/design.md ("The worker environment") to the agent's environment."""
    base = {"PATH": "/bin", "HOME": "/root"}
    env = worker_env(base, assignment(local_world_size=2), 1, "job1", "/logs/err.json")
    assert env == {
        "PATH": "/bin",
        "HOME": "/root",
        "RANK": "9",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "20",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "3",
        "ROLE_RANK": "9",
        "ROLE_WORLD_SIZE": "20",
        "ROLE_NAME": "default",
        "MASTER_ADDR": "10.0.0.7",
        "MASTER_PORT": "29555",
        "TORCHELASTIC_RESTART_COUNT": "4",
        "TORCHELASTIC_MAX_RESTARTS": "5",
        "TORCHELASTIC_RUN_ID": "job1",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCHELASTIC_ERROR_FILE": "/logs/err.json",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "OMP_NUM_THREADS": "1",
        "RDZV_LOCAL_RANK": "1",
    }
    assert base == {"PATH": "/bin", "HOME": "/root"}


def test_worker_env_role_and_signals_as_torchrun_gives_them() -> None:
    """--role trainer: ROLE_NAME=trainer; --signals-to-handle as given."""
    env = worker_env({}, assignment(), 0, "j", "e", role="trainer", signals_to_handle="SIGTERM,SIGUSR1")
    assert (env["ROLE_NAME"], env["TORCHELASTIC_SIGNALS_TO_HANDLE"]) == ("trainer", "SIGTERM,SIGUSR1")


def test_worker_env_virtual_local_rank() -> None:
    """torchrun's --virtual-local-rank: LOCAL_RANK 0 for all, each worker's own GPU
    (through the agent's CUDA_VISIBLE_DEVICES when it has one); RANK unchanged."""
    a = assignment(local_world_size=2)
    plain = [worker_env({}, a, i, "j", "e", virtual_local_rank=True) for i in range(2)]
    assert [(e["LOCAL_RANK"], e["CUDA_VISIBLE_DEVICES"], e["RANK"]) for e in plain] == [
        ("0", "0", "8"),
        ("0", "1", "9"),
    ]
    mapped = [worker_env({"CUDA_VISIBLE_DEVICES": "4, 6"}, a, i, "j", "e", virtual_local_rank=True) for i in range(2)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in mapped] == ["4", "6"]
    with pytest.raises(ValueError, match="exceeds the GPUs in CUDA_VISIBLE_DEVICES=3"):
        worker_env({"CUDA_VISIBLE_DEVICES": "3"}, a, 1, "j", "e", virtual_local_rank=True)
    assert (
        "CUDA_VISIBLE_DEVICES" not in worker_env({}, a, 1, "j", "e")
        and worker_env({}, a, 1, "j", "e")["LOCAL_RANK"] == "1"
    )


def test_worker_env_keeps_agent_values() -> None:
    """The agent's OMP_NUM_THREADS and TORCH_NCCL_ASYNC_ERROR_HANDLING win over the defaults."""
    base = {"OMP_NUM_THREADS": "7", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    env = worker_env(base, assignment(local_world_size=4), 0, "j", "e")
    assert env["OMP_NUM_THREADS"] == "7"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"


def test_worker_env_single_worker_leaves_omp_unset() -> None:
    """With one worker per node OMP_NUM_THREADS is not forced, as torchrun does."""
    env = worker_env({}, assignment(local_world_size=1), 0, "j", "e")
    assert "OMP_NUM_THREADS" not in env
    assert env["RANK"] == "8"


def test_worker_env_rejects_bad_local_rank() -> None:
    """A local rank outside the node's world is a programming error."""
    with pytest.raises(ValueError, match="local_rank 2"):
        worker_env({}, assignment(local_world_size=2), 2, "j", "e")


async def test_workers_see_their_env(tmp_path: Path) -> None:
    """Each worker process sees its own RANK and LOCAL_RANK, and ${local_rank} in argv is substituted."""
    a = assignment(local_world_size=2)
    envs = [worker_env(os.environ, a, i, "job1", str(tmp_path / f"e{i}")) for i in range(2)]
    code = "import os, sys; print('env', os.environ['RANK'], os.environ['LOCAL_RANK'], sys.argv[1])"
    config = LaunchConfig(cmd=[sys.executable, "-c", code, "arg${local_rank}"], local_world_size=2)
    console = Console()
    group = WorkerGroup(config, envs, attempt=0, console=console)
    await group.start()
    infos = await asyncio.wait_for(group.wait(), WAIT_S)
    await group.stop()
    assert [i.ok for i in infos] == [True, True]
    assert sorted(console.lines()) == ["[8]: env 8 0 arg0", "[9]: env 9 1 arg1"]


# ------------------------------------------------------------------ outcomes


async def test_all_succeed(tmp_path: Path) -> None:
    """When every worker exits 0, wait returns one ok record per worker."""
    group = make_group(["pass"] * 3, tmp_path, console=None)
    await group.start()
    assert len(group.pids) == 3
    infos = await asyncio.wait_for(group.wait(), WAIT_S)
    assert sorted(i.local_rank for i in infos) == [0, 1, 2]
    assert all(i.ok and i.exit_code == 0 and i.signal is None and i.message == i.source == "" for i in infos)
    assert sorted(i.pid for i in infos) == sorted(group.pids)
    assert await group.stop() == infos


async def test_first_failure_returns_at_once(tmp_path: Path) -> None:
    """One failing worker ends wait at once with its exit code while the others still run."""
    group = make_group(["import time; time.sleep(60)", "raise SystemExit(3)"], tmp_path, console=None)
    await group.start()
    started = time.monotonic()
    failed = await asyncio.wait_for(group.wait(), WAIT_S)
    assert time.monotonic() - started < 5
    assert [(i.local_rank, i.exit_code, i.signal, i.ok) for i in failed] == [(1, 3, None, False)]
    infos = await group.stop(timeout=5)
    assert infos[0].signal == "SIGTERM" and infos[1].exit_code == 3
    assert "exited with code 3" in describe(failed[0], rank=9)


async def test_signal_death_is_decoded(tmp_path: Path) -> None:
    """A worker killed by a signal is recorded by signal name, and SIGKILL hints at memory."""
    group = make_group("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", tmp_path, console=None)
    await group.start()
    [info] = await asyncio.wait_for(group.wait(), WAIT_S)
    assert (info.exit_code, info.signal, info.ok) == (None, "SIGKILL", False)
    text = describe(info, rank=8)
    assert "killed by SIGKILL (out of memory?)" in text and "rank 8" in text
    await group.stop()


async def test_stop_kills_worker_that_ignores_sigterm(tmp_path: Path) -> None:
    """A worker ignoring SIGTERM is SIGKILLed at the shared deadline and reaped."""
    code = """
        import signal, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(60)
    """
    console = Console()
    group = make_group([code, "import time; time.sleep(60)"], tmp_path, console=console)
    await group.start()
    await console.wait_for("[8]: ready")
    started = time.monotonic()
    infos = await asyncio.wait_for(group.stop(timeout=0.5), WAIT_S)
    assert 0.4 < time.monotonic() - started < 5
    assert [i.signal for i in infos] == ["SIGKILL", "SIGTERM"]
    for pid in group.pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # reaped, not a zombie
    assert await group.stop() == infos  # idempotent
    group.kill_now()  # harmless once stopped


async def test_signal_reaches_grandchildren(tmp_path: Path) -> None:
    """stop() signals the whole process group, so a worker's own children get SIGTERM too."""
    code = """
        import signal, subprocess, sys
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c", '''
        import signal, sys, time
        def bye(*_):
            print("grandchild got SIGTERM", flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, bye)
        print("grandchild ready", flush=True)
        time.sleep(60)
        '''])
        print("grandchild pid", child.pid, flush=True)
        child.wait()
    """
    console = Console()
    group = make_group(code, tmp_path, console=console)
    await group.start()
    await console.wait_for("grandchild ready")
    [pid_line] = [ln for ln in console.lines() if "grandchild pid" in ln]
    grandchild = int(pid_line.split()[-1])
    infos = await asyncio.wait_for(group.stop(timeout=10), WAIT_S)
    assert "[8]: grandchild got SIGTERM" in console.lines()
    assert infos[0].exit_code == 0  # the worker ended because its child did, before any SIGKILL
    await wait_gone(grandchild)


async def test_stop_on_exited_workers_is_safe(tmp_path: Path) -> None:
    """stop() after every worker exited returns their records without error."""
    group = make_group(["pass", "pass"], tmp_path, console=None)
    await group.start()
    done = await asyncio.wait_for(group.wait(), WAIT_S)
    infos = await asyncio.gather(group.stop(), group.stop())
    assert infos[0] == infos[1] == done
    assert [i.exit_code for i in infos[0]] == [0, 0]


async def test_wait_is_cancellable(tmp_path: Path) -> None:
    """Cancelling wait leaves the workers running; a later stop ends them."""
    group = make_group("import time; time.sleep(60)", tmp_path, console=None)
    await group.start()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(group.wait(), 0.2)
    assert not is_gone(group.pids[0])
    [info] = await group.stop(timeout=5)
    assert info.signal == "SIGTERM"


async def test_kill_now_kills_everything(tmp_path: Path) -> None:
    """kill_now SIGKILLs every group at once, even workers that ignore SIGTERM."""
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    console = Console()
    group = make_group([code, code], tmp_path, console=console)
    await group.start()
    await console.wait_for("[9]: up")
    await console.wait_for("[8]: up")
    group.kill_now()
    failed = await asyncio.wait_for(group.wait(), WAIT_S)
    assert failed and all(i.signal == "SIGKILL" for i in failed)
    infos = await group.stop(timeout=5)
    assert [i.signal for i in infos] == ["SIGKILL", "SIGKILL"]


async def test_start_failure_cleans_up(tmp_path: Path) -> None:
    """A command that cannot be executed raises from start()."""
    config = LaunchConfig(cmd=[str(tmp_path / "no-such-binary")], local_world_size=1)
    group = WorkerGroup(config, [dict(os.environ)], attempt=0, console=None)
    with pytest.raises(FileNotFoundError):
        await group.start()
    assert await group.stop() == []


# --------------------------------------------------------------- parse_std


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0", {0: Std.NONE, 1: Std.NONE, 2: Std.NONE}),
        ("3", {0: Std.ALL, 1: Std.ALL, 2: Std.ALL}),
        ("0:3,1:0", {0: Std.ALL, 1: Std.NONE, 2: Std.NONE}),
        ("0:1,2:2", {0: Std.OUT, 1: Std.NONE, 2: Std.ERR}),
        ("1:1,7:3", {0: Std.NONE, 1: Std.OUT, 2: Std.NONE}),
    ],
)
def test_parse_std(value: str, expected: dict[int, Std]) -> None:
    """parse_std reads torchrun's single value and per-rank map syntax."""
    assert parse_std(value, 3) == expected


@pytest.mark.parametrize("value", ["", "4", "-1", "all", "0:4", "0:1,", "0=1", "a:1", "0:1,0:2", "1,2"])
def test_parse_std_rejects_bad_input(value: str) -> None:
    """Anything outside torchrun's syntax is a ValueError that names the value."""
    with pytest.raises(ValueError, match="stream setting"):
        parse_std(value, 2)


def test_files_need_a_log_dir() -> None:
    """Asking for redirects or tee without a log directory is refused at once."""
    with pytest.raises(ValueError, match="log_dir"):
        LaunchConfig(cmd=["x"], local_world_size=2, tee={1: Std.ERR})
    LaunchConfig(cmd=["x"], local_world_size=2, tee={5: Std.ERR})  # not a rank of this node


def test_exit_info_ok() -> None:
    """Only exit code 0 is ok."""
    assert ExitInfo(0, 1, 0, None, "", 0.0).ok
    assert not ExitInfo(0, 1, 1, None, "", 0.0).ok
    assert not ExitInfo(0, 1, None, "SIGTERM", "", 0.0).ok


@pytest.mark.skipif(workers._SETPRIV is None, reason="needs util-linux setpriv (Linux) for the parent-death signal")
def test_workers_die_with_a_sigkilled_agent(tmp_path):
    """An agent killed with SIGKILL takes its workers with it: none keeps running as a stale rank."""
    import subprocess
    import textwrap

    pid_file = tmp_path / "worker.pid"
    agent_code = textwrap.dedent(f"""
        import asyncio, sys
        from rdzv_client.workers import LaunchConfig, WorkerGroup
        async def main():
            code = "import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
            g = WorkerGroup(LaunchConfig(cmd=[sys.executable, "-c", code], local_world_size=1), [dict()], 0,
                            console=None)
            await g.start()
            await asyncio.sleep(60)
        asyncio.run(main())
    """)
    agent = subprocess.Popen([sys.executable, "-c", agent_code], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < deadline, "the worker never started"
            time.sleep(0.05)
        worker = int(pid_file.read_text())
        agent.kill()
        agent.wait(10)
        deadline = time.monotonic() + 5
        while not is_gone(worker):
            assert time.monotonic() < deadline, f"worker {worker} outlived its SIGKILLed agent"
            time.sleep(0.05)
    finally:
        agent.kill()
        agent.wait(10)
        if pid_file.exists() and pid_file.read_text():
            try:
                os.killpg(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_worker_env_gives_the_channel_the_real_local_rank() -> None:
    """--virtual-local-rank: LOCAL_RANK is 0 for all, RDZV_LOCAL_RANK (what
    rdzv_client.worker names itself by on the agent's channel) stays distinct."""
    a = assignment(local_world_size=2)
    for virtual in (False, True):
        envs = [worker_env({}, a, i, "j", "e", virtual_local_rank=virtual) for i in range(2)]
        assert [e["RDZV_LOCAL_RANK"] for e in envs] == ["0", "1"]


def test_in_place_assignment_keeps_virtual_local_rank() -> None:
    """What a kept worker is told for a new round: LOCAL_RANK stays 0 under
    --virtual-local-rank, as its first round's environment said."""
    from rdzv_client.reform import in_place_assignment

    a = assignment(local_world_size=2)
    texts = [in_place_assignment(a, i, "j", virtual_local_rank=True) for i in range(2)]
    assert all("LOCAL_RANK=0 " in t for t in texts), texts
    assert ["RANK=8" in texts[0], "RANK=9" in texts[1]] == [True, True]
    assert "LOCAL_RANK=1 " in in_place_assignment(a, 1, "j", virtual_local_rank=False)


async def test_reaped_gives_the_status_of_a_worker_that_exits_and_none_for_one_that_runs(tmp_path: Path) -> None:
    """What the agent waits on when a kept worker no longer takes its round: a
    worker exiting 75 (its GPU did not recover) closed its channel a moment
    before its exit was reaped; its status then explains the restart."""
    group = make_group(["import sys; sys.exit(75)", "import time; time.sleep(30)"], tmp_path)
    await group.start()
    assert await group.reaped(0, WAIT_S) == 75
    assert await group.reaped(1, 0.2) is None
    assert group.running(1)
    await group.stop()
