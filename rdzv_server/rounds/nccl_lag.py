"""Stragglers NCCL RAS names (issue 22 item 4, the zero-code fallback): pure,
no I/O, no clock.

An agent reads its host's NCCL RAS (``rdzv_client.nccl_trace.RasWatch``) and
judges its own workers there: a local rank behind its communicator in
collective count in enough of the readings over its straggler window. With
every heartbeat it sends while one lags it names them (``HeartbeatMsg.nccl_lag``,
``protocol.RankLag``), and once with ``[]`` when none does any more. The
window was the agent's: the server flags the node at the first straggler
check that sees a current report, its worst rank named (largest share, then
most behind), rule ``nccl_lag``. It is the compute rule's flag
(:mod:`.slow_ranks`) in every other way: ``NodeView.slow_rank``, the event
``straggler_flagged`` and its log line, the metric, a failure on the host's
record, and ``straggler_policy`` replace.

A report is current until its agent replaces it (``[]``, or a progress
heartbeat without it: that agent says none lags) or it grows older than the
straggler window plus two heartbeat intervals (an agent whose workers call
nothing sends no other heartbeat with content). A node flagged by another
rule keeps that flag: one flag per node, counted once. The other rules leave
an ``nccl_lag`` flag to this one (:func:`owns`).
"""

from __future__ import annotations

from collections.abc import Sequence

from rdzv_common.protocol import RankLag, heartbeat_interval

from .events import note, straggler_flagged
from .model import Effects, Job, Node, SlowRank


def report(node: Node, lag: Sequence[RankLag] | None, step: int | None, now: float) -> None:
    """A heartbeat's word on the node's lagging ranks (validated: its local ranks exist)."""
    if lag is not None:
        node.nccl_lag, node.nccl_lag_at = (tuple(lag) or None), now
    elif step is not None:  # a progress heartbeat without it: its agent sees none lagging
        node.nccl_lag, node.nccl_lag_at = None, None


def current(job: Job, node: Node, now: float) -> RankLag | None:
    """The node's worst lagging rank, if its report is current."""
    if not node.nccl_lag or node.nccl_lag_at is None:
        return None
    if now - node.nccl_lag_at > job.spec.straggler_window_s + 2 * heartbeat_interval(job.spec):
        return None
    worst: RankLag = max(node.nccl_lag, key=lambda r: (r.share, r.behind, -r.local_rank))
    return worst


def owns(node: Node) -> bool:
    """Whether ``node``'s straggler flag is this rule's (only :func:`check` lifts it)."""
    return node.straggler and node.slow_rank is not None and node.slow_rank.rule == "nccl_lag"


def check(job: Job, members: list[Node], now: float) -> Effects:
    """Flag the members with a current report (an event, a failure counted
    against the host) unless another rule flagged them; unflag those whose
    flag is this rule's and whose report is not current (a log line). O(n)."""
    fx = Effects()
    for n in members:
        lag, own = current(job, n, now), owns(n)
        if lag is not None:
            if n.straggler and not own:
                continue  # flagged by another rule: that flag stands
            old = n.slow_rank if own else None
            since = old.since if old is not None and old.local_rank == lag.local_rank else now - lag.window_s
            flagged = SlowRank(lag.local_rank, lag.share, 0.0, lag.share, since, "nccl_lag", lag.behind, lag.readings)
            if not own:
                ev = straggler_flagged(job, n, flagged, now)
                fx.event(ev)
                fx.host_failures.append((n.host, f"straggler: {ev.text}"))
            n.slow_rank, n.straggler = flagged, True
        elif own:
            n.slow_rank, n.straggler, n.straggler_note = None, False, None
            text = (
                f"job {job.job_id}: node {n.node_id} ({n.host}) is no longer a straggler: its agent no longer "
                "sees a rank of it behind in NCCL RAS"
            )
            fx.logs.append(note(job, text, n.node_id, host=n.host))
    return fx


def why(job: Job, n: Node) -> str:
    """Why ``n`` was replaced, in words (straggler_policy replace)."""
    s = n.slow_rank
    assert s is not None
    return (
        f"rank {n.rank_offset + s.local_rank} was behind its NCCL communicator in {s.ratio:.0%} of "
        f"{s.readings} RAS readings (by up to {s.behind} collectives)"
    )
