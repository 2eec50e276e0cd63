"""Active jobs by the next time a tick could change them: the store's heap of
deadlines (:func:`rdzv_server.rounds.next_due`), so that a tick visits only the
jobs whose deadline passed and its cost does not grow with idle jobs."""

from __future__ import annotations

import asyncio
import heapq

from . import rounds
from .rounds import Job

DUE_MIN_S = 0.01
DUE_SLACK_S = 0.001


class Due:
    """Entries ``(due, seq, job_id)``; one is stale when :attr:`at` says otherwise
    (the heap is rebuilt when stale entries outnumber live ones)."""

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, str]] = []
        self.at: dict[str, float] = {}  # each queued job's live entry
        self._seq = 0
        self._wake_at = float("inf")  # while the tick loop sleeps (sleep): when it wakes, on the heap's clock
        self._woken: asyncio.Future[None] | None = None

    def __contains__(self, job_id: str) -> bool:
        return job_id in self.at

    def discard(self, job_id: str) -> None:
        self.at.pop(job_id, None)

    def schedule(self, job: Job, also: float | None = None) -> None:
        """Queue the job for the tick at rounds.next_due. An entry already
        queued is at or before every node's deadline (those only move later,
        but for ``also``: a dropped connection's, or a join's after a failover's
        longer grace), so then only the job's own deadlines are looked at: O(1)
        per join or report, not O(nodes)."""
        queued = self.at.get(job.job_id)
        if queued is None:
            at = rounds.next_due(job)
        else:
            at = rounds.next_due(job, nodes=False)
            if at is not None and also is not None:
                at = min(at, also)
        if at is None:
            self.at.pop(job.job_id, None)
            return
        if at == float("inf") or (queued is not None and queued <= at):
            return
        self._seq += 1
        self.at[job.job_id] = at
        heapq.heappush(self.heap, (at, self._seq, job.job_id))
        woken = self._woken
        if woken is not None and at + DUE_SLACK_S < self._wake_at and not woken.done():
            woken.set_result(None)  # queued while the tick loop sleeps, and due before it wakes

    def wait_s(self, full_in: float, now: float) -> float:
        """Seconds to sleep before the store's next tick: ``full_in`` (its next full one), or
        until the earliest deadline queued when that comes first, so that a lost node's grace, a
        last call or a scale-up window ends on time, not up to a tick late. Never under
        DUE_MIN_S (deadlines a few ms apart are not a tick each), and DUE_SLACK_S past the
        deadline (a clock read as the tick wakes is past it). An entry already past is the full
        tick's (one that stays past, or a stale one's, never makes the ticks come faster); the
        earliest entry may be a stale one, earlier than its job's live deadline: a tick early."""
        if self.heap and (at := self.heap[0][0]) > now:
            full_in = min(full_in, max(DUE_MIN_S, at - now + DUE_SLACK_S))
        return max(0.0, full_in)

    async def sleep(self, full_in: float, now: float) -> None:
        """The tick loop's sleep (:meth:`wait_s`), cut short when a deadline queued meanwhile
        comes before its end (a lost node's grace shorter than a tick, a scale-up window)."""
        loop = asyncio.get_running_loop()
        wait = self.wait_s(full_in, now)
        woken = self._woken = loop.create_future()
        self._wake_at = now + wait
        timer = loop.call_later(wait, _wake, woken)
        try:
            await woken
        finally:
            timer.cancel()
            self._woken, self._wake_at = None, float("inf")

    def pop(self, now: float) -> list[str]:
        """The jobs whose deadline passed by ``now`` (taken out: schedule them again)."""
        due: list[str] = []
        while self.heap and self.heap[0][0] <= now:
            at, _, job_id = heapq.heappop(self.heap)
            if self.at.get(job_id) == at:
                del self.at[job_id]
                due.append(job_id)
        if len(self.heap) > 2 * len(self.at) + 1024:  # stale entries: rebuild
            self.heap = [(at, i, j) for i, (j, at) in enumerate(self.at.items())]
            heapq.heapify(self.heap)
        return due


def _wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)
