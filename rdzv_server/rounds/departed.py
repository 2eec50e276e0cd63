"""Nodes that left the job, kept for the job view (/ui, ``rdzv status``) so that
a node does not vanish when it goes: who, on which host, when, in which round and
why (lost, left, evicted, done). Bounded: the latest :data:`MAX_DEPARTED`, each
reason clipped (it may carry a leave's client text). Pure: ``now`` is given."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rdzv_common.protocol import printable
from rdzv_common.sizes import MAX_OLD_REASON_BYTES, clip

MAX_DEPARTED = 32  # departures a job keeps, the latest
MAX_DEPARTED_REASON_BYTES = 2 * MAX_OLD_REASON_BYTES  # a departure's reason, as JSON


@dataclass
class Departure:
    node_id: str
    host: str
    round: int  # the job's round when it left
    left_at: float
    reason: str


def note(departed: list[Departure], node_id: str, host: str, round_no: int, reason: str, now: float) -> None:
    """``node_id`` left the job at ``now``: keep it, the latest MAX_DEPARTED only."""
    departed.append(Departure(node_id, host, round_no, now, clip(printable(reason), MAX_DEPARTED_REASON_BYTES)))
    del departed[:-MAX_DEPARTED]


def to_records(departed: list[Departure]) -> list[dict[str, Any]]:
    return [dict(vars(d)) for d in departed]


def from_records(items: object) -> list[Departure]:
    """Saved departures back, bounded again (a record is read as client text was)."""
    out: list[Departure] = []
    for d in items if isinstance(items, list) else []:
        note(out, d["node_id"], d["host"], d["round"], d["reason"], d["left_at"])
    return out
