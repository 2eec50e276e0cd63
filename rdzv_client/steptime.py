"""What one rank's time goes to: compute, and waiting inside collectives
(issue 20 item 6; the lock-step straggler signal of issue 22). Standard
library only: :mod:`rdzv_client.worker` imports it.

Two running totals per process, in integer nanoseconds: :data:`compute_ns`
and :data:`wait_ns`. :func:`rdzv_client.worker.progress` sends them (in
microseconds) with its datagram, at most every ``SEND_EVERY_S``; the agent
turns two samples into a window (``HeartbeatMsg.timings``). Bookkeeping is
a clock read (``perf_counter_ns``: no system call on Linux) and an addition:
well under a microsecond, nothing is sent per collective.

Where the numbers come from, one source per kind:

* waits: the library's group times every wait it makes
  (:mod:`rdzv_client.inplace_wait`: ``inplace.all_reduce``, ``inplace.wait``
  and the waits of ``inplace.ddp``'s gradient all-reduce) with
  :func:`wait_begin` / :func:`wait_end`; a loop that uses neither says its
  own with :func:`collective_wait`.
* compute: by default the time between two timed waits (from the end of one
  to the start of the next; not across a round change: :func:`new_window`).
  Once :func:`compute` (a ``with`` block around the step's compute) or
  :func:`add` (device times: CUDA events) is used, only what they measure
  counts: the host's gaps would count twice, or the host's time where the
  device's is meant.
"""

from __future__ import annotations

import time
from types import TracebackType

__all__ = ["compute", "collective_wait", "wait_begin", "wait_end", "add", "new_window", "totals_us"]

_now = time.perf_counter_ns

compute_ns = 0  # compute time so far (this process)
wait_ns = 0  # time waiting inside collectives so far (this process)
_mark = 0  # when the last timed wait ended (0: none since the window started)
_open = 0  # when the timed wait in progress began (0: none)
_measured = False  # compute() or add() was used: the gaps between waits are not compute
_depth = 0  # nested compute() blocks: only the outermost counts
window = 0  # new_window() calls so far: device times never span two (rdzv_client.inplace_wait)


def wait_begin() -> int:
    """A collective's wait starts now: returns the time to give :func:`wait_end`.
    The gap since the previous wait's end is compute (unless measured)."""
    global compute_ns, _open
    t = _now()
    if _mark and not _measured:
        compute_ns += t - _mark
    _open = t
    return t


def wait_end(started: int) -> None:
    """The wait :func:`wait_begin` started is over (done or failed)."""
    global wait_ns, _mark, _open
    t = _now()
    wait_ns += t - started
    _mark = t
    _open = 0


def collective_wait(seconds: float) -> None:
    """Add ``seconds`` this rank spent waiting inside a collective (a loop
    that times its own collectives: neither DDP nor the library's group).
    Negative, NaN or infinite values are ignored."""
    global wait_ns
    if 0.0 <= seconds < 1e9:  # False for NaN
        wait_ns += int(seconds * 1e9)


def add(compute_s: float, wait_s: float) -> None:
    """Add device times (CUDA events, resolved after the fact): from now on
    compute is only what is measured, not the host's gaps between waits."""
    global compute_ns, wait_ns, _measured
    _measured = True
    if 0.0 <= compute_s < 1e9:
        compute_ns += int(compute_s * 1e9)
    if 0.0 <= wait_s < 1e9:
        wait_ns += int(wait_s * 1e9)


class _Compute:
    """``with compute():`` - the block's time is compute (nested blocks count once)."""

    __slots__ = ("_t",)

    def __init__(self) -> None:
        self._t = 0

    def __enter__(self) -> None:
        global _depth, _measured
        _measured = True
        _depth += 1
        if _depth == 1:
            self._t = _now()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        global _depth, compute_ns
        _depth -= 1
        if _depth == 0:
            compute_ns += _now() - self._t


_block = _Compute()  # one per process: the training thread times its step (nesting counted)


def compute() -> _Compute:
    """``with worker.compute(): ...`` around the step's compute (forward,
    backward, optimizer): its time is this rank's compute. For loops whose
    collectives are not the library's (then also :func:`collective_wait`)."""
    return _block


def new_window() -> None:
    """A round ends (or the training loop): the time until the next wait is not compute."""
    global _mark, _open, window
    _mark = _open = 0
    window += 1


def totals_us() -> tuple[int, int] | None:
    """(compute, wait) so far in microseconds, what is in progress included
    (a wait, a ``compute()`` block, the gap since the last wait), so that a
    window inside one long wait or step still says where its time went; they
    never go back. None while nothing was timed (the datagram stays as it was)."""
    if not (compute_ns or wait_ns or _open or _depth):
        return None
    compute, wait, t = compute_ns, wait_ns, _now()
    if _open:
        wait += t - _open
    elif _depth:
        compute += t - _block._t
    elif _mark and not _measured:
        compute += t - _mark
    return compute // 1000, wait // 1000
