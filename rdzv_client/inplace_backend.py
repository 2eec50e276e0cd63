"""A round's process group whose collectives the agent can interrupt, for
code that calls ``torch.distributed`` itself (FSDP2, DTensor, DCP).

:func:`interruptible` wraps the round's group (from
:func:`rdzv_client.inplace.process_group`) in a Python
``torch.distributed.ProcessGroup`` subclass, as torchft's
``torchft/process_group.py`` does: every collective goes to the round's gloo
group, and the ``Work`` it returns is rdzv's. Its ``wait()`` (what
``dist.all_gather_single(..., async_op=False)``, FSDP2's all-gather and
reduce-scatter, funcol's ``wait_tensor`` and DCP's object collectives call)
returns when the collective completes, and raises
:class:`~rdzv_client.worker.MembershipChanged` the moment the agent says the
round is over (the worker channel's thread fails its future: the round's
:class:`~rdzv_client.inplace._Round`, the one that fails ``inplace.ddp``'s
futures) or when gloo fails it (a lost peer), in in-place mode. A Work that
completed before the word stays completed.

Why a ProcessGroup subclass and not a ``Backend`` one: torch 2.13 gives
``torch._C._distributed_c10d.Backend`` no Python constructor (``No
constructor defined!``); a ProcessGroup subclass is what
``init_process_group`` accepts from a Python backend plugin, and C++ callers
(functional collectives, DTensor) reach its methods through pybind's
trampoline. Measured on torch 2.13 CPU: FSDP2 issues ``all_gather_single``
(forward, backward) and ``reduce_scatter_single`` (backward), both with
``async_op=False`` (``dist`` then calls ``wait()``); ``full_tensor()`` issues
``all_gather_single_coalesced``; everything on the calling thread (no side
stream on CPU).

This module imports torch; :mod:`rdzv_client.worker` does not.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import inplace, steptime, worker
from .inplace_wait import _SLICE
from .worker import MembershipChanged

__all__ = ["interruptible", "ddp_group", "InterruptibleGroup"]

# the ProcessGroup methods that start a collective (torch 2.13's names): each is
# sent to the round's group and its Work wrapped
COLLECTIVES = (
    "allreduce",
    "allreduce_coalesced",
    "allgather",
    "allgather_coalesced",
    "allgather_into_tensor_coalesced",
    "_allgather_base",
    "all_gather_single",
    "all_gather_single_coalesced",
    "reduce_scatter",
    "_reduce_scatter_base",
    "reduce_scatter_single",
    "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "alltoall",
    "alltoall_base",
    "all_to_all_single",
    "barrier",
    "send",
    "recv",
    "recv_anysource",
)


class _Work(dist.Work):
    """One collective's Work, completed by gloo or failed by the round's end,
    whichever comes first (:class:`~rdzv_client.inplace._Round`): its future
    is the round's. A gloo Work without a future is waited by a thread of its own: torch
    2.13's gloo reduce-scatter (``wait(timeout)`` ignores its timeout there:
    8 s measured on a peer gone 8 s later), send and recv. A silent peer
    holds that thread until the group's timeout (its collective is
    abandoned, as its group is)."""

    def __init__(self, rnd: Any, inner: Any) -> None:
        super().__init__()
        self._inner = inner
        fut: torch.futures.Future[Any] = torch.futures.Future()
        self._fut = fut
        if not rnd.track(fut):
            return  # the round is over already: failed at once

        try:
            inner_fut = inner.get_future()
        except RuntimeError:  # "Work::getFuture not implemented"
            threading.Thread(target=_wait_inner, args=(rnd, fut, inner), name="rdzv-work", daemon=True).start()
            return

        def done(f: torch.futures.Future[Any]) -> None:
            try:
                value = f.wait()
            except RuntimeError as e:
                rnd.settle(fut, None, e)
            else:
                rnd.settle(fut, value, None)

        inner_fut.add_done_callback(done)

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Until the collective completed (True); :class:`MembershipChanged`
        once the round is over or the collective failed (in-place mode),
        telling the agent every slice that this rank waits on its peers."""
        deadline = None if timeout is None or timeout <= timedelta(0) else time.monotonic() + timeout.total_seconds()
        fut = self._fut
        if not fut.done():
            started = steptime.wait_begin()  # FSDP2's and DTensor's waits count as waits in the rank's timings
            try:
                ready = threading.Event()
                fut.add_done_callback(lambda _: ready.set())
                while not ready.wait(_SLICE.total_seconds()):
                    worker.waiting()
                    if deadline is not None and time.monotonic() > deadline:
                        raise RuntimeError(f"a collective did not complete within {timeout}")
            finally:
                steptime.wait_end(started)
        try:
            fut.wait()
        except Exception as e:
            _fail(e)
        return True

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        if not self._fut.done():
            return False
        try:
            self._fut.value()
        except Exception:
            return False
        return True

    def exception(self) -> Any:
        return None if not self._fut.done() or self.is_success() else RuntimeError("the collective failed")

    def get_future(self) -> torch.futures.Future[Any]:
        """The future the round controls (failed on the agent's word)."""
        return self._fut

    def synchronize(self) -> None:
        self.wait()


def _wait_inner(rnd: Any, fut: torch.futures.Future[Any], inner: Any) -> None:
    """A future-less gloo Work's waiter thread (``wait()`` releases the GIL)."""
    try:
        inner.wait()
    except RuntimeError as e:
        rnd.settle(fut, None, e)
    else:
        rnd.settle(fut, None, None)


def _fail(error: BaseException) -> None:
    """Raise a fresh exception for a failed collective (the future keeps the
    stored one: a traceback there would keep the waiting frames alive)."""
    error.__traceback__ = None
    text = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
    if isinstance(error, MembershipChanged):
        raise MembershipChanged(text)
    if worker.in_place():
        raise MembershipChanged(f"a collective failed: {text}")
    raise RuntimeError(text)


class InterruptibleGroup(dist.ProcessGroup):
    """The round's group, every collective's Work rdzv's (:class:`_Work`).
    Made by :func:`interruptible`; ``inner`` is the round's own group."""

    def __init__(self, inner: Any, rnd: Any, name: str) -> None:
        super().__init__(inner.rank(), inner.size())  # type: ignore[call-arg]  # (rank, size): a Python group
        self.inner = inner
        self.round = rnd
        self._name = name

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._name

    @property
    def group_desc(self) -> str:
        return self._name

    def getBackendName(self) -> str:
        return "rdzv-interruptible"

    def __repr__(self) -> str:
        return f"InterruptibleGroup({self._name}, rank={self.rank()}, size={self.size()})"


def _collective(name: str) -> Any:
    def call(self: InterruptibleGroup, *args: Any, **kwargs: Any) -> _Work:
        if self.round.over is not None:
            raise MembershipChanged(self.round.over)  # no collective is started on a finished round
        try:
            work = getattr(self.inner, name)(*args, **kwargs)
        except RuntimeError as e:  # the group is broken already
            _fail(e)
        return _Work(self.round, work)

    call.__name__ = call.__qualname__ = name
    return call


for _name in COLLECTIVES:
    setattr(InterruptibleGroup, _name, _collective(_name))


def interruptible(pg: Any) -> InterruptibleGroup:
    """The round's group ``pg`` (from :func:`rdzv_client.inplace.process_group`)
    with every collective interruptible by the agent's word, made the default
    group (``dist.*`` without ``group=``, DCP, ``dist.get_rank()``) and
    registered by name for functional collectives (DTensor). One per round
    (the same object for the same ``pg``); the previous round's leaves
    torch's registry."""
    made = _made.get(id(pg))
    if made is not None:
        return made
    if isinstance(pg, inplace._Over):
        raise MembershipChanged(pg._reason)
    rnd = inplace._rounds.get(id(pg))
    if rnd is None:
        raise ValueError("interruptible(): pg must come from inplace.process_group()")
    c10d: Any = dist.distributed_c10d
    name = f"{pg.group_name}-interruptible"
    group = InterruptibleGroup(pg, rnd, name)
    for old, n in list(_registered.items()):  # the previous rounds' (ranks as threads share this table)
        if n < rnd.round:
            c10d._unregister_process_group(old)
            del _registered[old]
    for key, made in list(_made.items()):
        if made.round.round < rnd.round:
            del _made[key]
    c10d._register_process_group(name, group)
    _registered[name] = rnd.round
    c10d._world.pg_map[group] = c10d._world.pg_map[pg]
    c10d._world.pg_names[group] = name  # under the round's prefix: inplace._wrap drops it next round
    c10d._world.pg_group_ranks[group] = dict(c10d._world.pg_group_ranks[pg])
    c10d._update_default_pg(group)
    _made[id(pg)] = group
    _keep.append(group)
    return group


_made: dict[int, InterruptibleGroup] = {}  # by id(pg), this round's
_registered: dict[str, int] = {}  # names in torch's registry (functional collectives) -> their round
_keep: list[InterruptibleGroup] = []  # never destroyed, as the rounds' groups (inplace._abandoned)


def ddp_group(pg: Any) -> Any:
    """The group :func:`rdzv_client.inplace.ddp` builds DDP on: a gloo
    round's :func:`interruptible` group (DDP's own construction, bucket
    rebuild and buffer broadcasts then end on the agent's word); a round
    with NCCL keeps its own group (its communicator is aborted on the word;
    rdzv's Work would wait for CUDA work on the CPU, untested on a GPU)."""
    kind = dist.distributed_c10d._world.pg_map.get(pg, ("",))[0]
    return interruptible(pg) if kind == "gloo" else pg
