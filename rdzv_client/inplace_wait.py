"""The waits of the library's group (:mod:`rdzv_client.inplace`): sliced, so
that the agent's word ends them, and timed (:mod:`rdzv_client.steptime`:
this rank's wait inside collectives and its compute between them).

Host times on CPU: a clock read before and after each wait. On a GPU the
host's times say nothing (a NCCL wait only makes the current stream wait), so
a wait on CUDA tensors records two CUDA events on the current stream, before
and after: their distance is the time the stream stalled on the collective,
and the distance from the previous wait's end event is its compute. Events
are read later, without blocking (``query``), at the next timed wait; at most
:data:`MAX_PENDING` pairs wait to be read (older ones are dropped), and read
events are reused.
"""

from __future__ import annotations

import threading
from collections import deque
from datetime import timedelta
from typing import Any

import torch

from . import steptime, worker
from .worker import MembershipChanged

__all__ = ["wait", "wait_all", "MAX_PENDING"]

# the slices a pending collective is waited in: the agent's word is checked between them
_SLICE = timedelta(milliseconds=20)
MAX_PENDING = 256  # CUDA event pairs not read yet
_FREE = 64  # read events kept for reuse


def wait(work: Any, cuda: bool = False) -> None:
    """Wait for an ``async_op`` collective in slices of :data:`_SLICE`
    (``Work.wait(timeout)``: it wakes the moment the work is done). A failed
    collective (a peer died) or the agent's word raises
    :class:`MembershipChanged` in in-place mode; outside it, a failure raises
    as torch raised it. ``cuda``: its tensors are on the GPU (timed with
    CUDA events)."""
    started = _begin(cuda)
    try:
        _wait(work)
    finally:
        _end(cuda, started)


def _wait(work: Any) -> None:
    while True:
        try:
            work.wait(_SLICE)
            return
        except RuntimeError as e:
            if not work.is_completed():  # the slice ran out: a slow or stuck peer
                if worker.in_place():
                    worker.check()
                    worker.waiting()  # not hung: waiting on a peer (which may be)
                continue
            try:
                work.wait()  # it completed meanwhile, or failed: which one
                return
            except RuntimeError:
                if worker.in_place():
                    raise MembershipChanged(f"a collective failed: {str(e).splitlines()[0][:200]}") from e
                raise


def wait_all(futures: list[torch.futures.Future[Any]], cuda: bool = False) -> BaseException | None:
    """Wait for every future (a DDP backward's buckets), timed as one wait;
    the first failure is returned (not raised), the rest not waited for."""
    started = _begin(cuda)
    try:
        for fut in futures:
            try:
                _wait_future(fut)
            except Exception as e:
                return e
        return None
    finally:
        _end(cuda, started)


def _wait_future(fut: torch.futures.Future[Any]) -> None:
    """``fut.wait()`` (it releases the GIL: the channel's thread can fail it),
    telling the agent every :data:`_SLICE` that this rank waits on its peers."""
    if not fut.done():
        ready = threading.Event()
        fut.add_done_callback(lambda _: ready.set())
        while not ready.wait(_SLICE.total_seconds()):
            worker.waiting()
    fut.wait()


def _begin(cuda: bool) -> Any:
    return _device.begin() if cuda else steptime.wait_begin()


def _end(cuda: bool, started: Any) -> None:
    if cuda:
        _device.end(started)
    else:
        steptime.wait_end(started)


class DeviceTimer:
    """Waits timed on the GPU: a pair of CUDA events per wait, read when done."""

    def __init__(self, event: Any = None) -> None:
        self._event = event if event is not None else (lambda: torch.cuda.Event(enable_timing=True))  # type: ignore[no-untyped-call]
        self.pending: deque[tuple[Any, Any, int]] = deque()  # (start, end, steptime window)
        self.free: list[Any] = []
        self.dropped = 0  # pairs dropped unread (more than MAX_PENDING pending)
        self._last: tuple[Any, int] | None = None  # the last read pair's end event and window

    def _new(self) -> Any:
        return self.free.pop() if self.free else self._event()

    def begin(self) -> Any:
        self.read()
        ev = self._new()
        ev.record()
        return ev

    def end(self, start: Any) -> None:
        ev = self._new()
        ev.record()
        if len(self.pending) >= MAX_PENDING:
            self.pending.popleft()
            self.dropped += 1
            self._last = None  # the gap to the next one is unknown
        self.pending.append((start, ev, steptime.window))

    def read(self) -> None:
        """Account every pair whose end event the device passed (never blocks)."""
        try:
            while self.pending and self.pending[0][1].query():
                start, end, window = self.pending.popleft()
                wait_s = start.elapsed_time(end) / 1e3
                last = self._last
                compute_s = last[0].elapsed_time(start) / 1e3 if last is not None and last[1] == window else 0.0
                steptime.add(compute_s, wait_s)
                if last is not None and len(self.free) < _FREE:
                    self.free.append(last[0])
                if len(self.free) < _FREE:
                    self.free.append(start)
                self._last = (end, window)
        except RuntimeError:  # a broken context (a sticky CUDA error): nothing more to read
            self.pending.clear()
            self._last = None


_device = DeviceTimer()
