"""What ``rdzv status JOB`` says beyond the node table: why the job last
failed in one place (the culprit node and rank, its last stderr lines as its
agent sent them) and which nodes left, when and why. The server made the text
printable and bounded (rdzv_server.rounds.culprit, .departed); it is escaped
again here, as everything a server sends."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING

from rdzv_common.protocol import printable

if TYPE_CHECKING:
    from rdzv_common.protocol import JobView


def clock(ts: float) -> str:
    """A unix time as this machine's local clock time (the date too when not today)."""
    t = dt.datetime.fromtimestamp(ts)
    return t.strftime("%H:%M:%S" if t.date() == dt.date.today() else "%Y-%m-%d %H:%M:%S")


def culprit_lines(job: JobView) -> list[str]:
    """The culprit: node, host, round, rank and cause, then its last stderr lines, indented."""
    c = job.culprit
    if c is None:
        return []
    out = [
        f"last failure: node {printable(c.node_id)} ({printable(c.host)}), rank {c.rank} (local rank "
        f"{c.local_rank}), round {c.round}: {printable(c.cause)}"
    ]
    if c.stderr:
        out.append(f"last stderr lines of rank {c.rank}:")
        out += [f"  | {printable(line)}" for line in c.stderr]
    return out


def departed_lines(job: JobView) -> list[str]:
    """Nodes that left the job, oldest first: when, in which round, why."""
    if not job.departed:
        return []
    out = ["", "nodes that left:"]
    for d in job.departed:
        out.append(
            f"  {printable(d.node_id)} ({printable(d.host)}) left at {clock(d.left_at)} in round {d.round}: "
            f"{printable(d.reason)}"
        )
    return out
