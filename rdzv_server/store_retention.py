"""The store's retention side: finished jobs are removed after
``--retain-finished`` (a few hundred per tick, one transaction each) or on
request (``DELETE /v1/jobs/{job_id}``), from the database first, then memory,
the listing order and the metric series.

:class:`StoreRetention` is a collaborator of :class:`rdzv_server.store.Store`
(``store.retention``), split out to keep one module readable; it owns the queue
of finished jobs by end time and uses the store's jobs, listing order, storage
backend and metrics.
"""

from __future__ import annotations

import bisect
import heapq
import logging
from typing import TYPE_CHECKING

from rdzv_common.protocol import ErrorCode, JobNotFinishedError, UnavailableError

from .storage import WriteError

if TYPE_CHECKING:
    from .rounds import Job
    from .store import Store

log = logging.getLogger("rdzv_server.store")  # the store's log, as before the split

MAX_REMOVALS_PER_TICK = 500  # finished jobs past retention, removed in one transaction per tick


class StoreRetention:
    """Removal of finished jobs from a :class:`~rdzv_server.store.Store` (event loop only).
    The store's tables are read through it each time: a step-down replaces them."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._ended: list[tuple[float, str]] = []  # finished jobs by end time (or when due again)

    def queue(self, at: float, job_id: str) -> None:
        """``job_id`` ended at ``at`` (or is due for removal again as if it had)."""
        heapq.heappush(self._ended, (at, job_id))

    def clear(self) -> None:
        self._ended = []

    def expire(self, now: float) -> None:
        """Remove finished jobs that ended more than --retain-finished ago."""
        store = self._store
        limit = now - store.settings.retain_finished_s
        expired: list[Job] = []
        while self._ended and self._ended[0][0] <= limit and len(expired) < MAX_REMOVALS_PER_TICK:
            _, job_id = heapq.heappop(self._ended)
            job = store.jobs.get(job_id)
            if job is not None and job.finished and (job.ended_at or job.created_at) <= limit:
                expired.append(job)
        if not expired:
            return
        try:
            self._remove(expired)
        except WriteError as e:
            log.error(
                "cannot remove %d finished job(s) from %s: %s; trying again in a minute",
                len(expired),
                store.backend.where,
                e,
            )
            for job in expired:  # due again in 60 s
                heapq.heappush(self._ended, (limit + 60.0, job.job_id))
            return
        shown = ", ".join(j.job_id for j in expired[:8]) + (" ..." if len(expired) > 8 else "")
        log.info(
            "removed %d finished job(s) older than --retain-finished %gs: %s",
            len(expired),
            store.settings.retain_finished_s,
            shown,
        )

    def _remove(self, jobs: list[Job]) -> None:
        """Forget finished jobs: storage first (raises WriteError when that fails
        at once; etcd: queued behind the jobs' writes), then memory and metric series."""
        store = self._store
        store.backend.remove_jobs([j.job_id for j in jobs])
        for job in jobs:
            store.jobs.pop(job.job_id, None)
            self.unlist(job)
            if store.metrics:
                store.metrics.forget(job.job_id)

    def unlist(self, job: Job) -> None:
        """Take the job out of the store's listing order (O(log n) to find it)."""
        order = self._store.order
        key = (job.created_at, job.job_id)
        i = bisect.bisect_left(order, key)
        if i < len(order) and order[i] == key:
            del order[i]

    def delete_job(self, job_id: str) -> Job:
        """Forget a finished job (its view, its row, its metric series)."""
        job = self._store.reads.job(job_id)
        if not job.finished:
            raise JobNotFinishedError(
                f"job {job_id!r} is {job.state.value}; close it first (rdzv close {job_id}, "
                f"or POST /v1/jobs/{job_id}/close), then delete it"
            )
        try:
            self._remove([job])
        except WriteError as e:
            raise UnavailableError(
                f"the server cannot delete job {job_id!r} from its database ({e}); retry later", ErrorCode.UNAVAILABLE
            ) from e
        log.info("job %s deleted by request (it had %s)", job_id, job.state.value, extra={"rdzv": {"job": job_id}})
        return job
