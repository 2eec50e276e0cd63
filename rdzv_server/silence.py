"""How long an agent connection may stay silent, without a timer per frame.

The agent channel closes a connection that has not joined within the join
deadline, or, once joined, has sent nothing for the idle timeout. Reading each
frame with ``ws.receive(timeout=...)`` armed and cancelled a timer (an
``asyncio.timeout`` context and a TimerHandle) per frame: at 16,384 nodes,
heartbeating every 2 s and pinging every 5 s, that was over 11,000 timers a
second and the largest part of a heartbeat's cost (issue 24, item 5).

:class:`Silence` keeps one timer per connection instead. A frame only notes
the time it arrived (:meth:`heard`); the timer, when it fires, re-arms itself
for the last frame's time plus the limit, so it fires about once per limit,
not once per frame; a new limit that ends later (a join's idle timeout after
its join deadline) is left to that too. When the limit has really passed it cancels the reading
task; the channel catches that cancellation (:meth:`expired` says it was
this, not a server shutdown) and closes the connection saying why.
"""

from __future__ import annotations

import asyncio


class Silence:
    """One connection's read deadline: ``limit_s`` after the last frame heard
    (or after :meth:`restart` when frames are not :meth:`heard`: a fixed deadline)."""

    __slots__ = ("_loop", "_task", "_last", "_limit", "_handle", "_at", "_expired")

    def __init__(self, limit_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None  # called from the connection's handler
        self._task = task
        self._expired = False
        self._last = self._loop.time()
        self._limit = limit_s
        self._at = self._last + limit_s  # when the timer fires
        self._handle = self._loop.call_at(self._at, self._check)

    def heard(self) -> None:
        """A frame arrived: the deadline moves to now + the limit (no timer is touched)."""
        self._last = self._loop.time()

    def restart(self, limit_s: float) -> None:
        """A new limit, counted from now. The timer moves only when that is sooner than it
        fires: a later deadline (a join's idle timeout, 60 s, after its 10 s join deadline)
        is re-armed by the timer itself when it fires, not by the join (a join storm's
        16,384 joins cancelled and armed a timer each)."""
        self._limit = limit_s
        self._last = self._loop.time()
        due = self._last + limit_s
        if due < self._at:
            self._handle.cancel()
            self._at = due
            self._handle = self._loop.call_at(due, self._check)

    def caught(self) -> bool:
        """Whether a CancelledError the task caught is this one's (the limit passed), not a
        server shutdown's; if it is, the task is no longer cancelled (Python 3.11+ counts)."""
        if not self._expired:
            return False
        uncancel = getattr(self._task, "uncancel", None)
        if uncancel is not None:
            uncancel()
        return True

    def stop(self) -> None:
        self._handle.cancel()

    def _check(self) -> None:
        due = self._last + self._limit
        if self._loop.time() < due:
            self._at = due
            self._handle = self._loop.call_at(due, self._check)
            return
        self._expired = True
        self._task.cancel()
