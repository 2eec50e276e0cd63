"""rdzv_client.inplace_nccl on CPU (issue 20, NCCL): the order on the agent's
word (abort every communicator -> check the device -> go on, or exit for a
process restart) with a fake NCCL backend and a fake device check, the
deadlines, and the environment the agent gives in-place workers. The worker
channel is the real one: a subprocess plays its own agent."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import types
from datetime import timedelta
from pathlib import Path
from typing import ClassVar

import pytest

from rdzv_client import inplace_nccl
from rdzv_client.inplace_nccl import WORKER_EXIT_RESTART, recover
from rdzv_client.launch import IN_PLACE_WORKER_ENV, in_place_env_note, worker_env
from rdzv_client.worker import MembershipChanged
from rdzv_common.protocol import Assignment

ROOT = Path(__file__).resolve().parents[2]


class FakeBackend:
    """A ProcessGroupNCCL as recover() uses it: abort() only, recorded."""

    def __init__(
        self, name: str, calls: list[str], error: Exception | None = None, hang: threading.Event | None = None
    ):
        self.name, self.calls, self.error, self.hang = name, calls, error, hang

    def abort(self) -> None:
        self.calls.append(f"abort {self.name}")
        if self.hang is not None:
            self.hang.wait(30)
        if self.error is not None:
            raise self.error


def test_every_communicator_is_aborted_before_the_device_is_checked() -> None:
    calls: ClassVar[list[str]] = []
    backends = [FakeBackend("round0", calls), FakeBackend("round1", calls)]
    verdict = recover(backends, lambda: calls.append("synchronize"))
    assert calls == ["abort round0", "abort round1", "synchronize"]
    assert verdict.restart is None


def test_a_failed_abort_asks_for_a_restart_without_touching_the_device() -> None:
    calls: ClassVar[list[str]] = []
    backends = [FakeBackend("round0", calls, error=RuntimeError("ncclInternalError\nmore"))]
    verdict = recover(backends, lambda: calls.append("synchronize"))
    assert calls == ["abort round0"]
    assert verdict.restart == "NCCL abort failed: ncclInternalError"


def test_an_abort_past_its_deadline_asks_for_a_restart() -> None:
    calls: ClassVar[list[str]] = []
    hang = threading.Event()
    try:
        verdict = recover([FakeBackend("round0", calls, hang=hang)], lambda: calls.append("synchronize"), 0.2, 5.0)
    finally:
        hang.set()
    assert calls == ["abort round0"]
    assert verdict.restart == "NCCL abort still running after 0.2s"


def test_a_device_check_past_its_deadline_asks_for_a_restart() -> None:
    calls: ClassVar[list[str]] = []
    hang = threading.Event()
    try:
        verdict = recover(
            [FakeBackend("round0", calls)], lambda: (calls.append("synchronize"), hang.wait(30)), 5.0, 0.2
        )
    finally:
        hang.set()
    assert calls == ["abort round0", "synchronize"]
    assert verdict.restart == "torch.cuda.synchronize() still running after 0.2s"


def test_a_sticky_cuda_error_asks_for_a_restart() -> None:
    def synchronize() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors ...")

    verdict = recover([FakeBackend("round0", [])], synchronize)
    assert verdict.restart == "CUDA error after the abort: CUDA error: an illegal memory access was encountered"


# ------------------------------------------------- with the real worker channel

CHANNEL = r"""
import os, socket, sys, threading, time
agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
agent.bind(os.environ["RDZV_AGENT_SOCKET"])  # this process plays its own agent (before the import)
agent.settimeout(5.0)
os.environ["RDZV_AGENT_PID"] = str(os.getpid())
from rdzv_client import inplace_nccl, worker

calls = []
MODE = sys.argv[1]

class Backend:
    def abort(self):
        calls.append("abort")
        if MODE == "abort-hangs":
            threading.Event().wait(60)

def synchronize():
    time.sleep(0.3)  # a park that does not wait for the check comes first
    calls.append("synchronize")
    if MODE == "sticky":
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

inplace_nccl._rounds = inplace_nccl.Rounds(synchronize=synchronize, abort_timeout_s=0.5, sync_timeout_s=5.0)
gen = worker.rounds()
next(gen)
inplace_nccl.track(Backend())
inbox = os.path.join(os.path.dirname(os.environ["RDZV_AGENT_SOCKET"]), "w0")
agent.sendto(b"stop 1", inbox)
deadline = time.monotonic() + 10
while not worker.round_over() and time.monotonic() < deadline:
    time.sleep(0.01)
nxt = []
threading.Thread(target=lambda: nxt.append(next(gen)), daemon=True).start()  # parks: blocks until assigned
try:
    data = agent.recv(100)
except TimeoutError:
    print("calls", calls, "no park", flush=True)
    sys.exit(3)
calls.append(data.decode().split()[-1])
agent.sendto(b"assign 1 RANK=0 WORLD_SIZE=1", inbox)
while not nxt and time.monotonic() < deadline:
    time.sleep(0.01)
print("calls", calls, "round", nxt[0].round if nxt else None, flush=True)
"""


def _channel(mode: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RDZV_", "TORCHELASTIC_"))}
    env.update(
        PYTHONPATH=str(ROOT),
        RDZV_AGENT_SOCKET=str(tmp_path / "sock"),
        RDZV_RESTART_MODE="in-place",
        RDZV_LOCAL_RANK="0",
        LOCAL_RANK="0",
        TORCHELASTIC_RESTART_COUNT="0",
    )
    return subprocess.run([sys.executable, "-c", CHANNEL, mode], capture_output=True, text=True, env=env, timeout=60)


def test_on_the_agents_word_the_worker_aborts_checks_and_only_then_parks(tmp_path: Path) -> None:
    res = _channel("ok", tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "calls ['abort', 'synchronize', 'parked'] round 1" in res.stdout, res.stdout + res.stderr


def test_a_sticky_cuda_error_exits_for_a_process_restart_and_never_parks(tmp_path: Path) -> None:
    res = _channel("sticky", tmp_path)
    assert res.returncode == WORKER_EXIT_RESTART, res.stdout + res.stderr
    assert "parked" not in res.stdout and "no park" not in res.stdout, res.stdout
    assert (
        "rdzv: local rank 0: CUDA error after the abort: CUDA error: an illegal memory access was encountered; "
        f"exiting {WORKER_EXIT_RESTART} for a process restart"
    ) in res.stderr


def test_a_hung_abort_exits_for_a_process_restart_and_never_parks(tmp_path: Path) -> None:
    res = _channel("abort-hangs", tmp_path)
    assert res.returncode == WORKER_EXIT_RESTART, res.stdout + res.stderr
    assert "parked" not in res.stdout, res.stdout
    assert "NCCL abort still running after 0.5s; exiting 75 for a process restart" in res.stderr


# ------------------------------------------------------------------ environment

A = Assignment(
    job_id="job",
    round=2,
    world_size=2,
    rank_offset=0,
    local_world_size=2,
    group_rank=0,
    group_world_size=1,
    master_addr="127.0.0.1",
    master_port=29500,
    restarts=0,
    max_restarts=3,
)


def test_in_place_workers_get_nccl_settings_that_keep_the_process() -> None:
    env = worker_env({"PATH": "/bin"}, A, 0, "job", "/tmp/e.json", in_place=True)
    assert env["RDZV_RESTART_MODE"] == "in-place"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # abort the communicator, keep the process
    assert env["TORCH_NCCL_RETHROW_CUDA_ERRORS"] == "0"
    assert set(IN_PLACE_WORKER_ENV) <= set(env)


def test_the_users_nccl_settings_win() -> None:
    base = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_RETHROW_CUDA_ERRORS": "1"}
    env = worker_env(base, A, 1, "job", "/tmp/e.json", in_place=True)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3" and env["TORCH_NCCL_RETHROW_CUDA_ERRORS"] == "1"
    note = in_place_env_note({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})
    assert note.startswith(
        "in-place mode: workers get TORCH_NCCL_RETHROW_CUDA_ERRORS=0; "
        "kept as set here: TORCH_NCCL_ASYNC_ERROR_HANDLING=3"
    ), note


def test_process_mode_keeps_torchruns_environment() -> None:
    env = worker_env({}, A, 0, "job", "/tmp/e.json")
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"  # torchrun's: the process ends on an NCCL error
    assert "TORCH_NCCL_RETHROW_CUDA_ERRORS" not in env and "RDZV_RESTART_MODE" not in env


def test_nccl_needs_a_gpu_and_a_known_backend_is_named() -> None:
    import torch

    from rdzv_client import inplace
    from rdzv_client.worker import World

    w = World(0, 0, 1, 0, 1, 0, 1, "127.0.0.1", 1, True)
    with pytest.raises(ValueError, match="'gloo' or 'nccl'"):
        inplace.process_group(w, backend="mpi")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
            inplace.process_group(w, backend="nccl")
    assert inplace_nccl.WORKER_EXIT_RESTART == 75


# ------------------------------------------------------------------ the communicator


class FakeNCCL:
    """torch's ProcessGroupNCCL as make_backend() uses it, recording calls."""

    calls: ClassVar[list[str]] = []
    connect_error: Exception | None = None

    class Options:
        def __init__(self, is_high_priority_stream: bool = False) -> None:
            self.is_high_priority_stream = is_high_priority_stream
            self.config = types.SimpleNamespace(blocking=1)

    def __init__(self, store: object, rank: int, size: int, opts: FakeNCCL.Options) -> None:
        self.opts = opts
        FakeNCCL.calls.append(f"new rank {rank} of {size}")

    def _set_sequence_number_for_group(self) -> None:
        FakeNCCL.calls.append("sequence")

    def eager_connect_single_device(self, device: object) -> None:
        FakeNCCL.calls.append(f"connect {device}")
        if FakeNCCL.connect_error is not None:
            raise FakeNCCL.connect_error

    def abort(self) -> None:
        FakeNCCL.calls.append("abort")


def _fake_torch(monkeypatch: pytest.MonkeyPatch, round_over: bool) -> inplace_nccl.Rounds:
    import torch.distributed as dist

    FakeNCCL.calls, FakeNCCL.connect_error = [], None
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(inplace_nccl.worker, "round_over", lambda: round_over)
    rounds = inplace_nccl.Rounds(
        synchronize=lambda: FakeNCCL.calls.append("synchronize"), escalate=FakeNCCL.calls.append
    )
    rounds.hooked = True  # the worker channel of this test process stays untouched
    monkeypatch.setattr(inplace_nccl, "_rounds", rounds)
    return rounds


def test_the_communicator_is_nonblocking_and_tracked_before_it_connects(monkeypatch: pytest.MonkeyPatch) -> None:
    rounds = _fake_torch(monkeypatch, round_over=False)
    b = inplace_nccl.make_backend(object(), 1, 2, timedelta(seconds=7), "cuda:1", "rdzv-round3-rank1")
    assert b.opts.config.blocking == 0 and b.opts.is_high_priority_stream is False
    assert b.opts._timeout == timedelta(seconds=7) and b.opts.group_name == "rdzv-round3-rank1"
    assert rounds.live == [b]
    assert FakeNCCL.calls == ["new rank 1 of 2", "sequence", "connect cuda:1"]


def test_a_round_that_ends_while_nccl_connects_aborts_it_and_raises_membership_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rounds = _fake_torch(monkeypatch, round_over=True)
    FakeNCCL.connect_error = RuntimeError("NCCL error: remote process exited or there was a network error")
    with pytest.raises(MembershipChanged, match="the round ended while NCCL connected: NCCL error: remote"):
        inplace_nccl.make_backend(object(), 0, 2, timedelta(seconds=7), "cuda:0", "rdzv-round3-rank0")
    rounds.settle()  # what the worker does before it parks
    assert FakeNCCL.calls[:2] == ["new rank 0 of 2", "sequence"]
    assert FakeNCCL.calls[-2:] == ["abort", "synchronize"] and rounds.live == []
    assert rounds.last is not None and rounds.last.restart is None
