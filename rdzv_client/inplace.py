"""torch helpers for in-place re-formation (design.md "In-place re-formation").

A training script keeps its process, its model and its optimizer across round
changes: per round it makes a fresh gloo process group on a fresh store
(:func:`process_group`), brings every rank to the state of the most advanced
one (:func:`sync_state`), and runs its collectives through :func:`all_reduce`
(or :func:`wait`), which wait in short slices so that a lost peer or the
agent's word ends the step at once with
:class:`~rdzv_client.worker.MembershipChanged`.

What gloo allows (torch 2.13, measured in issue 14): a synchronous collective
whose peer died blocks until the group's timeout, and so does destroying or
aborting a group with a pending collective. So collectives are issued with
``async_op`` and waited here in slices; a round's group is abandoned, never
destroyed (:data:`_abandoned` keeps it, so no destructor blocks mid-training),
and the process leaves with :func:`exit`, which skips their destructors; an
uncaught exception does the same once a group exists (``sys.excepthook``).

This module imports torch; :mod:`rdzv_client.worker` does not.
"""

from __future__ import annotations

import io
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import worker
from .worker import MembershipChanged, World

__all__ = ["process_group", "all_reduce", "wait", "sync_state", "exit", "MembershipChanged"]

# the slices a pending collective is waited in: the agent's word is checked between them
_SLICE = timedelta(milliseconds=20)
# every group this process made: abandoned groups stay referenced (see the docstring)
_abandoned: list[Any] = []


def _exit_at_once(kind: type[BaseException], value: BaseException, tb: Any) -> None:
    """An uncaught exception: print it as Python does, then leave without the
    interpreter's teardown (a gloo group's destructors there take seconds: 4.3 s
    measured for a rank whose peer is alive), so the agent sees the failure now."""
    _previous_hook(kind, value, tb)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


_previous_hook = sys.excepthook


def process_group(world: World, timeout_s: float = 60.0) -> Any:
    """A fresh ``ProcessGroupGloo`` for ``world``: a new TCPStore at the round's
    MASTER_ADDR/MASTER_PORT (hosted by rank 0), keys under the round's prefix.
    Raises :class:`MembershipChanged` if the round ends while it forms."""
    global _previous_hook
    if sys.excepthook is not _exit_at_once:
        _previous_hook, sys.excepthook = sys.excepthook, _exit_at_once
    timeout = timedelta(seconds=timeout_s)
    deadline = time.monotonic() + timeout_s
    # torchrun's c10d agents host the store themselves; rdzv: rank 0's worker does
    hosts = world.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    if not hosts:
        _wait_listening(world.master_addr, world.master_port, deadline)
    while True:
        worker.check()
        try:
            store = dist.TCPStore(  # type: ignore[attr-defined]
                world.master_addr,
                world.master_port,
                world.world_size,
                is_master=hosts,
                timeout=timedelta(seconds=min(5.0, timeout_s)),
                wait_for_workers=False,
                use_libuv=True,
            )
            break
        except (RuntimeError, OSError, dist.DistStoreError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    store.set_timeout(timeout)
    prefixed = dist.PrefixStore(world.store_prefix, store)  # type: ignore[attr-defined]
    pg = dist.ProcessGroupGloo(prefixed, world.rank, world.world_size, timeout)
    _abandoned.append((store, pg))
    return pg


def _wait_listening(addr: str, port: int, deadline: float) -> None:
    """Until the store's port accepts: TCPStore's own client retries with a
    back-off of up to a second, this polls every few milliseconds."""
    while time.monotonic() < deadline:
        worker.check()
        try:
            socket.create_connection((addr, port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.005)


def wait(work: Any) -> None:
    """Wait for an ``async_op`` collective in slices of :data:`_SLICE`
    (``Work.wait(timeout)``: it wakes the moment the work is done). A failed
    collective (a peer died) or the agent's word raises
    :class:`MembershipChanged` in in-place mode; outside it, a failure raises
    as torch raised it."""
    while True:
        try:
            work.wait(_SLICE)
            return
        except RuntimeError as e:
            if not work.is_completed():  # the slice ran out: a slow or stuck peer
                if worker.in_place():
                    worker.check()
                continue
            try:
                work.wait()  # it completed meanwhile, or failed: which one
                return
            except RuntimeError:
                if worker.in_place():
                    raise MembershipChanged(f"a collective failed: {str(e).splitlines()[0][:200]}") from e
                raise


def all_reduce(tensor: torch.Tensor, pg: Any, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
    """``tensor`` reduced over ``pg`` in place (and returned)."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    wait(pg.allreduce([tensor], opts))
    return tensor


def _broadcast(tensor: torch.Tensor, pg: Any, src: int) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    wait(pg.broadcast([tensor], opts))


def sync_state(pg: Any, world: World, model: torch.nn.Module, optimizer: Any, step: int) -> int:
    """Bring every rank of ``pg`` to the state of the rank with the highest
    ``step`` (the lowest such rank): model and optimizer state are broadcast
    from it, no checkpoint is read. Returns that step: it never goes back."""
    mine = torch.tensor([step], dtype=torch.int64)
    top = int(all_reduce(mine.clone(), pg, dist.ReduceOp.MAX).item())
    src_t = torch.tensor([world.rank if step == top else world.world_size], dtype=torch.int64)
    src = int(all_reduce(src_t, pg, dist.ReduceOp.MIN).item())
    if world.rank == src:
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buf)
        payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    _broadcast(size, pg, src)
    if world.rank != src:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    _broadcast(payload, pg, src)
    if world.rank != src:
        state = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    return top


def exit(code: int = 0) -> None:
    """End the process without running the destructors of abandoned groups
    (one with a pending collective blocks until its timeout)."""
    worker.finished()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
