"""The REST side's reads of the store: a job, its view, a page of summaries,
progress ages for /metrics, live nodes.

:class:`StoreReads` is a collaborator of :class:`rdzv_server.store.Store`
(``store.reads``), split out by responsibility like
:mod:`rdzv_server.store_hosts`; it reads the store's tables and changes
nothing (except dropping finished jobs from the set of jobs that report
progress).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rdzv_common.protocol import JobNotFoundError, JobState

from . import rounds
from .cursors import paged
from .rounds import Job

if TYPE_CHECKING:
    from rdzv_common.protocol import JobSummary, JobView

    from .store import Store


class StoreReads:
    """What REST and /metrics read from a :class:`~rdzv_server.store.Store`
    (its tables read through the store each time: a step-down replaces them)."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def job(self, job_id: str) -> Job:
        job = self._store.jobs.get(job_id)
        if job is None:
            raise JobNotFoundError(f"no job {job_id!r} on this server")
        return job

    def view(self, job_id: str, limit: int = rounds.MAX_VIEW_NODES, offset: int = 0) -> JobView:
        return rounds.view(self.job(job_id), self._store.clock(), limit, offset)

    def summaries(
        self, state: JobState | None = None, limit: int = 100, cursor: str | None = None, newest: bool = False
    ) -> tuple[list[JobSummary], str | None]:
        """One page of job summaries in creation order (``newest``: newest first):
        (summaries, next_cursor). ``cursor`` is a ``next_cursor`` this server
        returned (opaque to clients)."""
        jobs = self._store.jobs
        page, more = paged(self._store.order, cursor, limit, lambda key: self._summary(jobs[key[1]], state), newest)
        return page, more

    @staticmethod
    def _summary(job: Job, state: JobState | None) -> JobSummary | None:
        return rounds.summary(job) if state is None or job.state == state else None

    def since_progress(self) -> dict[str, float]:
        """Per job whose agents report progress: the most seconds any running
        member's step has not advanced (for /metrics)."""
        store = self._store
        now, out = store.clock(), {}
        for job_id in list(store.progress_jobs):
            job = store.jobs.get(job_id)
            if job is None or job.finished:
                store.progress_jobs.discard(job_id)
            else:
                out[job_id] = rounds.progress_age(job, now)
        return out

    def live_nodes(self) -> int:
        return sum(len(self._store.jobs[j].nodes) for j in self._store.active)
