"""The REST side's reads of the store: a job, its view, a page of summaries,
progress ages for /metrics, live nodes.

:class:`ReadsMixin` is a part of :class:`rdzv_server.store.Store`, split
out by responsibility like :mod:`rdzv_server.store_hosts`; it reads the
store's tables and changes nothing (except dropping finished jobs from the
set of jobs that report progress).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from rdzv_common.protocol import JobNotFoundError, JobState

from . import rounds
from .cursors import paged
from .rounds import Job

if TYPE_CHECKING:
    from rdzv_common.protocol import JobSummary, JobView


class ReadsMixin:
    """What REST and /metrics read from a :class:`~rdzv_server.store.Store`."""

    # set by Store.__init__ (and step_down / load)
    clock: Callable[[], float]
    jobs: dict[str, Job]
    active: set[str]
    progress_jobs: set[str]
    _order: list[tuple[float, str]]

    def _job(self, job_id: str) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            raise JobNotFoundError(f"no job {job_id!r} on this server")
        return job

    def view(self, job_id: str, limit: int = rounds.MAX_VIEW_NODES, offset: int = 0) -> JobView:
        return rounds.view(self._job(job_id), self.clock(), limit, offset)

    def summaries(
        self, state: JobState | None = None, limit: int = 100, cursor: str | None = None, newest: bool = False
    ) -> tuple[list[JobSummary], str | None]:
        """One page of job summaries in creation order (``newest``: newest first):
        (summaries, next_cursor). ``cursor`` is a ``next_cursor`` this server
        returned (opaque to clients)."""
        page, more = paged(self._order, cursor, limit, lambda key: self._summary(self.jobs[key[1]], state), newest)
        return page, more

    @staticmethod
    def _summary(job: Job, state: JobState | None) -> JobSummary | None:
        return rounds.summary(job) if state is None or job.state == state else None

    def since_progress(self) -> dict[str, float]:
        """Per job whose agents report progress: the most seconds any running
        member's step has not advanced (for /metrics)."""
        now, out = self.clock(), {}
        for job_id in list(self.progress_jobs):
            job = self.jobs.get(job_id)
            if job is None or job.finished:
                self.progress_jobs.discard(job_id)
            else:
                out[job_id] = rounds.progress_age(job, now)
        return out

    def live_nodes(self) -> int:
        return sum(len(self.jobs[j].nodes) for j in self.active)
