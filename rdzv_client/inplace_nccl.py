"""NCCL for in-place re-formation (design.md "In-place re-formation", "NCCL").

``inplace.process_group(world, backend="nccl")`` makes a round's group with
two backends, as ``init_process_group("cpu:gloo,cuda:nccl")`` would: gloo for
CPU tensors (:func:`inplace.sync_state`'s state transfer) and NCCL for CUDA
tensors (DDP's gradients), NCCL the default. The NCCL communicator is made
here (:func:`make_backend`): nonblocking (``config.blocking = 0``: no NCCL call
blocks the calling thread, so a dead peer cannot hold ``abort``) and eagerly
connected on ``cuda:LOCAL_RANK`` (the group's first collective pays no init).

When the agent says the round is over (:func:`rdzv_client.worker.on_round_over`)
every NCCL communicator of the rounds of this process is ABORTED, never
abandoned: an abandoned NCCL communicator keeps its GPU memory, its proxy
thread and, with a kernel still waiting on a dead peer, the GPU's stream (the
next round's kernels queue behind it: a deadlock). Then the device is checked
(``torch.cuda.synchronize()`` in a thread, with a deadline). The order, done in
a thread of its own (:func:`recover`), then the verdict:

* abort -> synchronize -> the worker goes on (parks, takes the next round);
* an abort that raises or outlives :data:`ABORT_TIMEOUT_S`, a synchronize that
  outlives :data:`SYNC_TIMEOUT_S`, or a CUDA error from it (a sticky error,
  such as an illegal address, poisons the CUDA context for the process's
  life): the worker asks for a process restart. It writes one line on stderr
  and exits with :data:`WORKER_EXIT_RESTART` before it parks; its agent then restarts
  this node's workers for the round, uncharged (an escalation, as past
  ``--in-place-timeout``), whether the exit comes before or after the assignment.

The worker parks only once the verdict is in (:func:`rdzv_client.worker.before_park`),
so a process about to exit is never assigned the next round in place.

Not run on a GPU yet: tests/unit/test_inplace_nccl.py checks the order with a
fake backend on CPU; ``scripts/gpu-check`` has the drill for a GPU machine.

torch is imported lazily: this module imports on a CPU-only machine.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

from . import worker
from .launch import WORKER_EXIT_RESTART  # 75, EX_TEMPFAIL: the agent knows it

__all__ = ["make_backend", "recover", "Verdict", "WORKER_EXIT_RESTART", "ABORT_TIMEOUT_S", "SYNC_TIMEOUT_S"]

# how long an abort, and then the device check, may take before the process is restarted
ABORT_TIMEOUT_S = 10.0
SYNC_TIMEOUT_S = 10.0


def make_backend(store: Any, rank: int, size: int, timeout: timedelta, device: Any, group_name: str) -> Any:
    """A ``ProcessGroupNCCL`` for one round: nonblocking communicator, eager
    init on ``device`` (``cuda:LOCAL_RANK``); normal-priority streams as
    ``init_process_group`` makes them. Tracked (:func:`track`) before it
    connects: the agent's word aborts a communicator still forming (a peer
    lost meanwhile), and the connect then raises ``MembershipChanged``."""
    import torch.distributed as dist

    if not dist.is_nccl_available():
        raise RuntimeError("inplace.process_group(backend='nccl'): this torch has no NCCL (a CPU build?)")
    nccl = dist.ProcessGroupNCCL
    opts = nccl.Options(is_high_priority_stream=False)
    opts.config.blocking = 0  # nonblocking: abort never waits behind a hung NCCL call
    opts._timeout = timeout
    opts.global_ranks_in_group = list(range(size))
    opts.group_name = cast(Any, group_name)  # torch's GroupName is a str
    backend = nccl(store, rank, size, opts)
    backend._set_sequence_number_for_group()
    track(backend, device)
    try:
        backend.eager_connect_single_device(device)  # as init_process_group(device_id=...) does
    except RuntimeError as e:
        if worker.round_over():
            raise worker.MembershipChanged(f"the round ended while NCCL connected: {_first_line(e)}") from e
        raise
    return backend


# ------------------------------------------------------------------ the verdict


@dataclass(frozen=True)
class Verdict:
    """How the abort and the device check went: ``restart`` None: go on."""

    restart: str | None
    abort_s: float
    sync_s: float


def _timed(fn: Callable[[], None], timeout_s: float, name: str) -> tuple[BaseException | None, bool, float]:
    """Run ``fn`` in a daemon thread for at most ``timeout_s``: (its error, timed out, seconds)."""
    box: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # the verdict carries it
            box.append(e)
        else:
            box.append(None)

    started = time.monotonic()
    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    t.join(timeout_s)
    took = time.monotonic() - started
    if not box:
        return None, True, took
    return box[0], False, took


def recover(
    backends: list[Any],
    synchronize: Callable[[], None],
    abort_timeout_s: float = ABORT_TIMEOUT_S,
    sync_timeout_s: float = SYNC_TIMEOUT_S,
) -> Verdict:
    """Abort every backend in ``backends`` (each once, in order), then check
    the device with ``synchronize``; the verdict says whether this process
    must be restarted. Never raises; every step has a deadline."""

    def abort_all() -> None:
        for b in backends:
            b.abort()

    err, late, abort_s = _timed(abort_all, abort_timeout_s, "rdzv-nccl-abort")
    if late:
        return Verdict(f"NCCL abort still running after {abort_timeout_s:g}s", abort_s, 0.0)
    if err is not None:
        return Verdict(f"NCCL abort failed: {_first_line(err)}", abort_s, 0.0)
    err, late, sync_s = _timed(synchronize, sync_timeout_s, "rdzv-cuda-sync")
    if late:
        return Verdict(f"torch.cuda.synchronize() still running after {sync_timeout_s:g}s", abort_s, sync_s)
    if err is not None:
        return Verdict(f"CUDA error after the abort: {_first_line(err)}", abort_s, sync_s)
    return Verdict(None, abort_s, sync_s)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:200]


# ------------------------------------------------------------------ the process's rounds


_device: Any = None  # the device of this process's NCCL groups (track())


def _cuda_synchronize() -> None:
    """Wait for every stream of this process's GPU. Its device by name: the
    current device is per thread, and this runs in a thread of its own."""
    import torch

    torch.cuda.synchronize(_device)


def _escalate(reason: str) -> None:
    """Ask the agent for a process restart: one line on stderr, exit :data:`WORKER_EXIT_RESTART`
    (no interpreter teardown: a communicator's destructor could block)."""
    sys.stderr.write(
        f"rdzv: local rank {os.environ.get('RDZV_LOCAL_RANK', '?')}: {reason}; "
        f"exiting {WORKER_EXIT_RESTART} for a process restart\n"
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(WORKER_EXIT_RESTART)


class Rounds:
    """The NCCL backends of this process not aborted yet, and the recovery
    under way. ``synchronize`` and ``escalate`` are parameters so that a test
    drives the order with fakes."""

    def __init__(
        self,
        synchronize: Callable[[], None] = _cuda_synchronize,
        escalate: Callable[[str], None] = _escalate,
        abort_timeout_s: float = ABORT_TIMEOUT_S,
        sync_timeout_s: float = SYNC_TIMEOUT_S,
    ) -> None:
        self.synchronize = synchronize
        self.escalate = escalate
        self.abort_timeout_s = abort_timeout_s
        self.sync_timeout_s = sync_timeout_s
        self.lock = threading.Lock()
        self.live: list[Any] = []  # backends of rounds not over yet
        self.aborted: list[Any] = []  # kept referenced: no destructor runs mid-training
        self.thread: threading.Thread | None = None
        self.last: Verdict | None = None
        self.hooked = False

    def add(self, backend: Any) -> None:
        """A new round's NCCL backend; the first one hooks the worker channel."""
        with self.lock:
            self.live.append(backend)
            hook = not self.hooked
            self.hooked = True
        if hook:
            worker.on_round_over(self.round_over)
            worker.before_park(self.settle)
        if worker.round_over():  # the round ended while the group formed
            self.round_over("the round is over")

    def round_over(self, reason: str) -> None:
        """The worker channel's callback: start the recovery (it must not block)."""
        with self.lock:
            if not self.live or (self.thread is not None and self.thread.is_alive()):
                return  # nothing to abort, or under way (settle() picks up what came meanwhile)
            self.thread = threading.Thread(target=self._recover, name="rdzv-nccl-recover", daemon=True)
            self.thread.start()

    def _recover(self) -> None:
        while True:
            with self.lock:
                backends, self.live = self.live, []
                self.aborted.extend(backends)
            if not backends:
                return
            verdict = recover(backends, self.synchronize, self.abort_timeout_s, self.sync_timeout_s)
            self.last = verdict
            if verdict.restart is not None:
                self.escalate(verdict.restart)
                return
            sys.stderr.write(
                f"rdzv: NCCL: {len(backends)} communicator(s) aborted in {verdict.abort_s:.3f}s, "
                f"GPU checked in {verdict.sync_s:.3f}s\n"
            )

    def settle(self) -> None:
        """Before the worker parks: wait for the recovery's verdict (its own
        deadlines bound the wait); a backend still live is recovered now."""
        with self.lock:
            t = self.thread
        if t is not None:
            t.join(self.abort_timeout_s + self.sync_timeout_s + 5.0)
            if t.is_alive():  # cannot be (every step has a deadline): never park undecided
                self.escalate("the NCCL recovery did not finish")
                return
        with self.lock:
            pending = bool(self.live)
        if pending:
            self._recover()


_rounds = Rounds()


def track(backend: Any, device: Any = None) -> None:
    """Abort ``backend`` (NCCL on ``device``) when the agent says its round is
    over (see the module's docstring)."""
    global _device
    if device is not None:
        _device = device
    _rounds.add(backend)
