"""The job's last failure in one place (issue 25, "a failed job explained in
one place"): which node and rank failed first, in which round, and that rank's
last stderr lines as its agent sent them (``ExitRecord.stderr``). The job view
(``rdzv status JOB``, /ui) shows it; SQLite keeps it with the job.

Client text, so bounded and made printable here, whatever the agent sent: each
line escaped and clipped, the lines kept newest last within
:data:`rdzv_common.sizes.MAX_TAIL_BYTES` as JSON (:func:`rdzv_common.sizes.tail_lines`,
the agent's rule too). Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rdzv_common.protocol import ExitRecord, printable
from rdzv_common.sizes import MAX_CAUSE_BYTES, clip, tail_lines


@dataclass
class Culprit:
    """The first failure of the job's latest failure report that was the training's
    own (not an echo of a lost peer): its node, host, round, rank and last stderr lines."""

    node_id: str
    host: str
    round: int
    rank: int
    local_rank: int
    cause: str  # the failure in one line (as the round's reason names it)
    stderr: list[str] = field(default_factory=list)  # oldest first, at most MAX_TAIL_BYTES as JSON


def culprit(job_round: int, node_id: str, host: str, first: ExitRecord, cause: str) -> Culprit:
    """The culprit of a failure report whose first failure is ``first``."""
    return Culprit(
        node_id=node_id,
        host=host,
        round=job_round,
        rank=first.rank,
        local_rank=first.local_rank,
        cause=clip(printable(cause), MAX_CAUSE_BYTES),
        stderr=tail_lines(first.stderr),
    )


def to_record(c: Culprit | None) -> dict[str, Any] | None:
    return None if c is None else dict(vars(c))


def from_record(d: dict[str, Any] | None) -> Culprit | None:
    """A saved culprit back; its text bounded again (a record is read as client text was)."""
    if not isinstance(d, dict):
        return None
    c = Culprit(**d)
    c.stderr = tail_lines(list(c.stderr))
    return c
