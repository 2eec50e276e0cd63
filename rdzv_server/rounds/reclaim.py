"""Ending a waiting job that nobody holds, to make room for a new one (pure).

The store decides when (``rdzv_server.quotas``: the waiting-jobs cap is full
and a new job arrives); this module only says what it does to the job.
"""

from __future__ import annotations

from rdzv_common.protocol import JobState

from .machine import _end
from .model import Effects, Job


def held(job: Job) -> bool:
    """Some node of the job has a connection (a node that left is gone; one
    whose connection dropped is not connected)."""
    return any(node.connected for node in job.nodes.values())


def reclaim(job: Job, now: float, why: str) -> Effects:
    """Close a forming job that no connected node holds (see :func:`held`);
    its id's next join starts its next run. Nothing for a finished or held job."""
    if job.finished or not job.forming or held(job):
        return Effects()
    return _end(job, JobState.CLOSED, why, now)
