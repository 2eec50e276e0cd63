"""torch helpers for in-place re-formation (design.md "In-place re-formation").

A training script keeps its process, its model and its optimizer across round
changes: per round it makes a fresh gloo process group on a fresh store
(:func:`process_group`: a ``torch.distributed.ProcessGroup``), brings every
rank to the state of the most advanced one (:func:`sync_state`), and runs its
collectives through :func:`all_reduce` (or :func:`wait`), which wait in short
slices so that a lost peer or the agent's word ends the step at once with
:class:`~rdzv_client.worker.MembershipChanged`, or through a DDP model made by
:func:`ddp`, whose gradient all-reduce returns futures that the worker
channel's thread fails the moment the agent says the round is over
(``loss.backward()`` then raises ``MembershipChanged``).

What gloo allows (torch 2.13, measured in issue 14): a synchronous collective
whose peer died blocks until the group's timeout, and so does destroying or
aborting a group with a pending collective. So collectives are issued with
``async_op`` and waited here in slices; a round's group is abandoned, never
destroyed (:data:`_abandoned` keeps it, so no destructor blocks mid-training),
and the process leaves with :func:`exit`, which skips their destructors; an
uncaught exception does the same once a group exists (``sys.excepthook``).

With ``backend="nccl"`` CUDA tensors go over NCCL, whose communicator is aborted,
not abandoned, when the round ends (:mod:`rdzv_client.inplace_nccl`). This module
imports torch; :mod:`rdzv_client.worker` does not. The round's store: :mod:`rdzv_client.inplace_store`.
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from . import worker
from .inplace_store import STORE_PORT_EXIT, StorePortTaken, port_taken
from .inplace_wait import wait, wait_all  # sliced, timed waits (inplace.wait is public)
from .worker import MembershipChanged, World

__all__ = ["process_group", "group", "all_reduce", "wait", "sync_state", "ddp", "exit", "MembershipChanged"]

# every group this process made: abandoned groups stay referenced (see the docstring)
_abandoned: list[Any] = []


def _exit_at_once(kind: type[BaseException], value: BaseException, tb: Any) -> None:
    """An uncaught exception: print it as Python does, then leave without the
    interpreter's teardown (a gloo group's destructors there take seconds: 4.3 s
    measured for a rank whose peer is alive), so the agent sees the failure now."""
    _previous_hook(kind, value, tb)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(STORE_PORT_EXIT if isinstance(value, StorePortTaken) else 1)  # the port: charged to no one


_previous_hook = sys.excepthook


def process_group(world: World, timeout_s: float = 60.0, backend: str = "gloo") -> Any:
    """A fresh gloo group for ``world`` (a ``torch.distributed.ProcessGroup``, the default group from now on):
    a new TCPStore at the round's MASTER_ADDR/MASTER_PORT (hosted by rank 0), keys under the round's prefix.
    Raises :class:`MembershipChanged` if the round ends while it forms, StorePortTaken at once if rank 0
    finds the port taken. ``backend="nccl"``: CUDA tensors go over NCCL on ``cuda:LOCAL_RANK`` (made the
    current device), CPU tensors over gloo; the NCCL communicator is aborted when the round ends."""
    global _previous_hook
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"process_group(backend={backend!r}): 'gloo' or 'nccl'")
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("process_group(backend='nccl') needs a CUDA GPU; none is visible here")
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
        except (RuntimeError, OSError, dist.DistStoreError) as e:
            if hosts and port_taken(e):  # another process holds it: retrying only stalls the round
                raise StorePortTaken(world.master_addr, world.master_port) from e
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    prefixed = dist.PrefixStore(world.store_prefix, store)  # type: ignore[attr-defined]
    _await_peers(prefixed, world, deadline, timeout_s)
    store.set_timeout(timeout)
    gloo = dist.ProcessGroupGloo(prefixed, world.rank, world.world_size, timeout)
    nccl = None
    if backend == "nccl":
        from . import inplace_nccl

        device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)
        nccl_store = dist.PrefixStore("nccl/", prefixed)  # type: ignore[attr-defined]
        # aborted (never abandoned) when the round ends, from its formation on
        nccl = inplace_nccl.make_backend(nccl_store, world.rank, world.world_size, timeout, device, _name(world))
    pg = _wrap(prefixed, gloo, world, nccl)
    _abandoned.append((store, pg))
    _start(_Round(pg, world.round))
    return pg


def _name(world: World) -> str:
    return f"rdzv-round{world.round}-rank{world.rank}"


def _await_peers(store: Any, world: World, deadline: float, timeout_s: float) -> None:
    """Until every rank of the round checked in on the store, checking the
    agent's word every 10 ms: ProcessGroupGloo's constructor waits in C++ for
    each peer's address until the group's timeout, so a peer lost while the
    round forms (a second round change) would hold this rank there past
    ``--in-place-timeout`` and cost it its process. A peer that never comes,
    or a store host that is gone, is a changed membership in in-place mode."""
    try:
        store.add("rdzv/arrived", 1)
        while (n := store.add("rdzv/arrived", 0)) < world.world_size:
            worker.check()
            if time.monotonic() > deadline:
                raise dist.DistStoreError(
                    f"the round's group did not form within {timeout_s:g}s: {n} of {world.world_size} ranks came"
                )
            time.sleep(0.01)
    except RuntimeError as e:  # DistStoreError, DistNetworkError
        _raise_membership(e)


def _wrap(store: Any, backend: Any, world: World, nccl: Any = None) -> Any:
    """A ``torch.distributed.ProcessGroup`` on ``backend``, as
    ``init_process_group`` builds it: DDP and ``dist.*(..., group=pg)`` take
    it, and it is the default group (``dist.get_rank()``, a
    ``DistributedSampler``). Registered under a name of this round in torch's
    tables; the previous rounds' entries leave (torch keeps no reference to an
    abandoned group). With ``nccl``: CUDA tensors go to it, and it is the default
    backend, as after ``init_process_group("cpu:gloo,cuda:nccl", device_id=...)``."""
    gloo = dist.ProcessGroup.BackendType.GLOO
    pg = dist.ProcessGroup(store, world.rank, world.world_size)
    pg._set_default_backend(gloo)
    pg._register_backend(torch.device("cpu"), gloo, backend)
    kind = "gloo"
    if nccl is not None:
        pg._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
        pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, nccl)
        pg.bound_device_id = torch.device("cuda", world.local_rank)
        kind = "cpu:gloo,cuda:nccl"
    name: Any = _name(world)  # torch's GroupName is a str
    pg._set_group_name(name)
    c10d = dist.distributed_c10d
    for old, n in list(c10d._world.pg_names.items()):
        if n.startswith("rdzv-round") and int(n[len("rdzv-round") :].split("-")[0]) < world.round:
            for table in (c10d._world.pg_map, c10d._world.pg_names, c10d._world.pg_group_ranks):
                table.pop(old, None)
    c10d._world.pg_map[pg] = (kind, store)
    c10d._world.pg_names[pg] = name
    c10d._world.pg_group_ranks[pg] = {r: r for r in range(world.world_size)}
    c10d._update_default_pg(pg)  # dist.get_rank(), DistributedSampler(), ... as after init_process_group
    return pg


class _Round:
    """The futures of one round's collectives that are still pending: the
    worker channel's thread fails them all when the agent says the round is
    over. A future is completed once, by whoever claims it first (its
    collective, or the end of the round): a late completion is a no-op."""

    def __init__(self, pg: Any, round_no: int) -> None:
        self.pg = pg
        self.round = round_no
        self.lock = threading.Lock()
        self.pending: set[torch.futures.Future[Any]] = set()
        self.over: str | None = None

    def track(self, fut: torch.futures.Future[Any]) -> bool:
        """Take ``fut`` in; False (and ``fut`` failed) if the round is over already."""
        with self.lock:
            if self.over is None:
                self.pending.add(fut)
                return True
        fut.set_exception(MembershipChanged(self.over))
        return False

    def settle(self, fut: torch.futures.Future[Any], value: Any, error: BaseException | None) -> None:
        with self.lock:
            if fut not in self.pending:
                return  # the round ended first: it was failed already
            self.pending.discard(fut)
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)

    def end(self, reason: str) -> None:
        with self.lock:
            if self.over is None:
                self.over = reason
            failing, self.pending = self.pending, set()
        for fut in failing:
            fut.set_exception(MembershipChanged(reason))


_live: list[_Round] = []  # rounds not over yet: the agent's word ends them all
_rounds: dict[int, _Round] = {}  # by id(pg): every group stays referenced (_abandoned)
_hooked = False


def _start(rnd: _Round) -> None:
    global _hooked
    if not _hooked:
        worker.on_round_over(_end_rounds)
        _hooked = True
    _rounds[id(rnd.pg)] = rnd
    _live.append(rnd)
    if worker.round_over():
        _end_rounds("the round is over")


def _end_rounds(reason: str) -> None:
    """The worker channel's callback: fail every pending collective of every open round."""
    while _live:
        _live.pop().end(reason)


def _wait_listening(addr: str, port: int, deadline: float) -> None:
    """Until the store's port accepts (TCPStore's client backs off up to 1 s; this polls every 5 ms)."""
    while time.monotonic() < deadline:
        worker.check()
        try:
            socket.create_connection((addr, port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.005)


def all_reduce(tensor: torch.Tensor, pg: Any, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
    """``tensor`` reduced over ``pg`` in place (and returned)."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    wait(pg.allreduce([tensor], opts), tensor.is_cuda)
    return tensor


def broadcast(tensor: torch.Tensor, pg: Any, src: int) -> None:
    """``tensor`` of rank ``src`` on every rank of ``pg``, waited in slices (:func:`wait`)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    wait(pg.broadcast([tensor], opts), tensor.is_cuda)


def broadcast_bytes(data: bytes | None, pg: Any, rank: int, src: int) -> bytes:
    """``data`` of rank ``src`` (None elsewhere) on every rank: its size, then its bytes."""
    if rank == src:
        assert data is not None
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    broadcast(size, pg, src)
    if rank != src:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    broadcast(payload, pg, src)
    return data if data is not None else payload.numpy().tobytes()


def most_advanced(pg: Any, world: World, step: int) -> tuple[int, int]:
    """(the highest ``step`` of the round's ranks, the lowest rank holding it)."""
    top = int(all_reduce(torch.tensor([step], dtype=torch.int64), pg, dist.ReduceOp.MAX).item())
    src_t = torch.tensor([world.rank if step == top else world.world_size], dtype=torch.int64)
    return top, int(all_reduce(src_t, pg, dist.ReduceOp.MIN).item())


def sync_state(pg: Any, world: World, model: torch.nn.Module, optimizer: Any, step: int) -> int:
    """Bring every rank of ``pg`` to the state of the rank with the highest
    ``step`` (the lowest such rank): model and optimizer state are broadcast
    from it, no checkpoint is read. Returns that step: it never goes back.
    ``model`` may be wrapped in DDP (its ``module`` is what is sent)."""
    if isinstance(model, DistributedDataParallel):
        model = model.module
    top, src = most_advanced(pg, world, step)
    blob = None
    if world.rank == src:
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buf)
        blob = buf.getvalue()
    data = broadcast_bytes(blob, pg, world.rank, src)
    if world.rank != src:
        state = torch.load(io.BytesIO(data), weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    return top


@contextlib.contextmanager
def group(world: World, timeout_s: float = 60.0, backend: str = "gloo") -> Iterator[Any]:
    """``with inplace.group(world) as pg:`` - :func:`process_group` for the
    block. :class:`MembershipChanged` raised in it ends the block quietly and
    the enclosing ``for world in worker.rounds():`` goes on to the next round;
    a block that ends normally ends the training (:func:`worker.done`)."""
    try:
        try:
            pg = process_group(world, timeout_s, backend)
        except MembershipChanged as e:
            pg = _Over(str(e))  # a with block cannot be skipped: its first use of pg raises
        yield pg
        worker.done()
    except MembershipChanged as e:
        sys.stdout.write(f"rdzv: round {world.round} is over: {e}\n")
        sys.stdout.flush()


class _Over:
    """The group of a round that ended while it formed: any use raises
    :class:`MembershipChanged` (inside :func:`group`'s block, which ends)."""

    def __init__(self, reason: str) -> None:
        self._reason = reason

    def __getattr__(self, name: str) -> Any:
        raise MembershipChanged(self.__dict__.get("_reason", "the round is over"))


# ------------------------------------------------------------------ DDP


def ddp(module: torch.nn.Module, pg: Any, **kwargs: Any) -> DistributedDataParallel:
    """``DistributedDataParallel(module, process_group=pg, **kwargs)`` whose
    gradient all-reduce can be interrupted: a comm hook all-reduces each bucket
    on ``pg`` and returns a future that fails the moment the agent says the
    round is over (or the collective fails), and ``loss.backward()`` then
    raises :class:`MembershipChanged` before any gradient is used: no optimizer
    step is taken on a partial all-reduce. Make one per round, on that round's
    group; the previous round's DDP on ``module`` lets go of the module's
    parameters. DDP's own blocking collectives (construction, the bucket
    rebuild after the first step, buffer broadcasts) run on
    ``inplace_backend.ddp_group(pg)``: they raise
    :class:`MembershipChanged` when a lost peer fails them or the agent says
    the round is over, in in-place mode. Construction is preceded by a
    sliced all-reduce every rank joins: a peer lost or frozen before it is
    met there, where the agent's word is taken."""
    if isinstance(pg, _Over):
        raise MembershipChanged(pg._reason)
    rnd = _rounds.get(id(pg))
    if rnd is None:
        raise ValueError("ddp(): pg must come from inplace.process_group()")
    # every rank here before DDP's construction: a peer lost or frozen
    # before it is seen (and the agent's word taken) here
    all_reduce(torch.zeros(1), pg)
    old = _ddps.pop(module, None)
    if old is not None:
        # its reducer may be mid-backward forever: it must never see a gradient again
        old._remove_autograd_hooks()  # type: ignore[no-untyped-call]
    from .inplace_backend import ddp_group  # (it imports this module)

    try:  # DDP's own collectives (construction, bucket rebuild) wait on Works the agent's word fails
        model = _DDP(module, process_group=ddp_group(pg), **kwargs)
    except RuntimeError as e:
        _raise_membership(e)
    state = _HookState(rnd)
    model.register_comm_hook(state, _allreduce_hook)
    model.register_forward_pre_hook(lambda *_: _forward(state))
    _ddps[module] = model
    return model


class _DDP(DistributedDataParallel):
    """DDP whose own blocking collectives around ``forward`` (the bucket
    rebuild after its first step, buffer broadcasts) raise
    :class:`MembershipChanged` when they fail (a peer lost; on the
    interruptible group, the agent's word) in in-place mode."""

    def _pre_forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super()._pre_forward(*args, **kwargs)  # type: ignore[no-untyped-call]
        except RuntimeError as e:
            _raise_membership(e)

    def _post_forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super()._post_forward(*args, **kwargs)  # type: ignore[no-untyped-call]
        except RuntimeError as e:
            _raise_membership(e)


# the DDP made for each module (one at a time: the previous one's hooks are removed)
_ddps: weakref.WeakKeyDictionary[torch.nn.Module, DistributedDataParallel] = weakref.WeakKeyDictionary()


def _raise_membership(e: RuntimeError) -> NoReturn:
    """A failed collective: MembershipChanged in in-place mode, else torch's own error."""
    if worker.in_place():
        raise MembershipChanged(f"a collective failed: {str(e).splitlines()[0][:200]}") from e
    raise e


class _HookState:
    """One DDP's hook state: its round, and the futures of the backward pass in flight."""

    cuda = False  # its buckets are on the GPU: the wait is timed with CUDA events

    def __init__(self, rnd: _Round) -> None:
        self.round = rnd
        self.size = rnd.pg.size()
        self.batch: list[torch.futures.Future[Any]] = []

    def finish(self) -> None:
        """The backward pass's first final callback (queued before DDP's own):
        wait for every bucket; a failed one raises here, as a Python exception
        (MembershipChanged), so DDP never reads a failed bucket."""
        batch, self.batch = self.batch, []
        error = wait_all(batch, self.cuda)  # timed as one wait (rdzv_client.steptime)
        del batch
        if error is None:
            return
        # The future keeps ``error`` and DDP's reducer keeps the future: were its
        # traceback kept, the frames of this backward (the training loop's, the
        # old DDP in them) would stay reachable through C++ forever. So the
        # stored one loses its traceback and a fresh exception is raised.
        error.__traceback__ = None
        text = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
        if isinstance(error, MembershipChanged):
            raise MembershipChanged(text)
        if worker.in_place():
            raise MembershipChanged(f"a collective failed: {text}")
        raise RuntimeError(text)


def _forward(state: _HookState) -> None:
    """Each forward of an :func:`ddp` model is a step for ``--hang-timeout``
    (:func:`worker.progress`, which raises MembershipChanged once the round is
    over); a backward that failed elsewhere never ran ``state.finish``: each
    pass starts afresh."""
    state.batch.clear()
    worker.progress()


def _allreduce_hook(state: _HookState, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """DDP's own all-reduce (average), on a future the round controls."""
    tensor = bucket.buffer()
    state.cuda = tensor.is_cuda
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    if not state.batch:
        torch.autograd.Variable._execution_engine.queue_callback(state.finish)
    state.batch.append(fut)
    rnd = state.round
    if rnd.track(fut):
        tensor.div_(state.size)
        try:
            work = rnd.pg.allreduce([tensor])
        except RuntimeError as e:  # the group is broken already
            rnd.settle(fut, None, e)
            return fut

        def done(f: torch.futures.Future[Any]) -> None:
            try:
                f.wait()
            except RuntimeError as e:
                rnd.settle(fut, None, e)
            else:
                rnd.settle(fut, tensor, None)

        work.get_future().add_done_callback(done)
    return fut


# DDP checks a hook's annotations as objects; this module's are strings (PEP 563)
_allreduce_hook.__annotations__ = {
    "state": _HookState,
    "bucket": dist.GradBucket,  # type: ignore[attr-defined]
    "return": torch.futures.Future[torch.Tensor],
}


def exit(code: int = 0) -> None:
    """End the process without running the destructors of abandoned groups
    (one with a pending collective blocks until its timeout)."""
    worker.finished()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
