"""What the round machine shows: REST views and summaries of a job, and the
``waiting_for`` info a forming round sends its nodes. Read-only."""

from __future__ import annotations

from typing import Any

from rdzv_common.protocol import (
    MAX_NODES,
    TERMINAL_STATES,
    CulpritView,
    DepartedView,
    JobState,
    JobSummary,
    JobView,
    NodeView,
    RankTimingView,
    RoundView,
    RunView,
    SlowRankView,
    WaitingInfo,
)
from rdzv_common.sizes import clip

from ..cursors import encode_offset
from .model import REJOINING, RUNNING, SPARE, WAITING, Job, Node, count, natural_key

MAX_VIEW_NODES = 10_000  # a job view lists at most this many nodes (members first, by rank)
MAX_VIEW_HISTORY = 100  # and the latest this many rounds
MAX_SUMMARY_REASON_BYTES = 160  # a summary's reason (a page of 1,000 stays ~200 KiB)


def waiting_info(job: Job, now: float, detail: bool = True) -> WaitingInfo | None:
    """What a forming round waits for, in words and in fields. ``detail=False``
    skips naming the missing nodes (O(n)), for the per-join fast path."""
    fields = waiting_fields(job, now, detail)
    return None if fields is None else WaitingInfo(**fields)


def waiting_fields(job: Job, now: float, detail: bool = True) -> dict[str, Any] | None:
    """:func:`waiting_info`'s fields, in the model's order, each within its bounds (a
    ``joined`` of a join storm is written from them, not validated: rounds.templates)."""
    if not job.forming:
        return None
    spec = job.spec
    joined = count(job, WAITING)
    missing = [n for n in job.prev_order if n in job.nodes and job.nodes[n].state == REJOINING] if detail else []
    parts = []
    if not detail and count(job, REJOINING):
        parts.append(f"{count(job, REJOINING)} previous member(s) not back")
    if missing:
        parts.append(f"previous members not back: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))
    if joined < spec.min_nodes:
        parts.append(f"{spec.min_nodes - joined} more node(s) to reach min {spec.min_nodes}")
    if job.last_call_deadline is not None:
        parts.append(
            f"last call: {max(0.0, job.last_call_deadline - now):.1f}s left (or {spec.max_nodes - joined} more "
            f"to reach max {spec.max_nodes})"
        )
    return {  # (counts within the model's bound: a re-formed round may hold more waiting nodes than max_nodes)
        "text": "; ".join(parts) or "completing",
        "joined": min(joined, MAX_NODES),
        "min_nodes": spec.min_nodes,
        "max_nodes": spec.max_nodes,
        "spares": min(count(job, SPARE), MAX_NODES),
        "missing": missing[:64],
        "last_call_deadline": job.last_call_deadline,
    }


def _node_view(node: Node, now: float, job_state: JobState | None = None) -> NodeView:
    if job_state in TERMINAL_STATES:
        state = job_state.value  # the job ended: its nodes no longer read "running"
    else:
        assert node.state is not None  # a node in job.nodes has a state
        state = node.state.value if node.connected else "disconnected"
    return NodeView(
        node_id=node.node_id,
        host=node.host,
        addr=node.addr,
        state=state,
        group_rank=node.group_rank,
        requested_rank=node.requested_rank,
        local_world_size=node.local_world_size,
        rank_offset=node.rank_offset if node.state == RUNNING else None,
        last_seen_s=round(max(0.0, now - node.last_seen), 3),
        step=node.step,
        steps_per_s=node.step_rate,
        straggler=node.straggler,
        straggler_note=node.straggler_note if node.straggler else None,
        slow_rank=_slow_rank(node, now),
        since_progress_s=(  # running members only: a spare's last step is not the job's progress
            round(max(0.0, now - node.progress_at), 3)
            if node.progress_at is not None and node.state == RUNNING
            else None
        ),
        host_blocked=node.note if node.state == SPARE else None,
        timings=_timings(node, now),
    )


def _slow_rank(node: Node, now: float) -> SlowRankView | None:
    s = node.slow_rank
    if s is None or not node.straggler:
        return None
    rank = node.rank_offset + s.local_rank if node.state == RUNNING else None
    window = round(max(0.0, now - s.since), 3)
    if s.rule == "nccl_lag":
        return SlowRankView(
            rank=rank,
            local_rank=s.local_rank,
            rule=s.rule,
            ratio=None,
            compute_fraction=None,
            median_fraction=None,
            window_s=window,
            lag_share=round(s.ratio, 4),
            readings=s.readings,
            collectives_behind=s.behind,
        )
    return SlowRankView(
        rank=rank,
        local_rank=s.local_rank,
        ratio=round(s.ratio, 4),
        compute_fraction=round(s.fraction, 4),
        median_fraction=round(s.median, 4),
        window_s=window,
    )


def _timings(node: Node, now: float) -> list[RankTimingView] | None:
    if not node.timings or node.timings_at is None:
        return None
    age = round(max(0.0, now - node.timings_at), 3)
    running = node.state == RUNNING
    return [
        RankTimingView(
            rank=node.rank_offset + t.local_rank if running else None,
            local_rank=t.local_rank,
            window_s=t.window_s,
            steps=t.steps,
            compute_s=t.compute_s,
            wait_s=t.wait_s,
            age_s=age,
        )
        for t in node.timings
    ]


def view(job: Job, now: float, limit: int = MAX_VIEW_NODES, offset: int = 0) -> JobView:
    """The job for REST, bounded: a page of at most ``limit`` (<= MAX_VIEW_NODES)
    nodes from ``offset`` of the listing (members in rank order first, then the
    others, spares last), with every node counted by state (``node_counts``), and
    the latest MAX_VIEW_HISTORY rounds; the ``*_omitted`` fields count what was
    left out, ``next_cursor`` is set when more nodes follow."""
    members = [job.nodes[n] for n in job.order if n in job.nodes]
    in_order = set(job.order)
    others = sorted((n for n in job.nodes.values() if n.node_id not in in_order and n.state != SPARE), key=natural_key)
    spares = sorted((n for n in job.nodes.values() if n.state == SPARE), key=natural_key)
    listing = members + others + spares
    page = listing[offset : offset + min(limit, MAX_VIEW_NODES)]
    listed = [n for n in page if n.state != SPARE]
    spares_listed = [n for n in page if n.state == SPARE]
    nodes_omitted = len(listing) - len(page)
    history = job.history[-MAX_VIEW_HISTORY:]
    counts = {state.value: n for state, n in job.counts.items() if n}
    return JobView(
        job_id=job.job_id,
        state=job.state,
        round=job.round,
        min_nodes=job.spec.min_nodes,
        max_nodes=job.spec.max_nodes,
        world_size=job.world_size,
        restarts=job.restarts,
        max_restarts=job.spec.max_restarts,
        master_addr=job.master_addr,
        master_port=job.master_port,
        nodes=[_node_view(n, now, job.state) for n in listed],
        spares=[_node_view(n, now, job.state) for n in spares_listed],
        waiting_for=waiting_info(job, now),
        root_cause=job.root_cause or (job.end_reason if job.state == JobState.FAILED else None),
        history=[
            RoundView(
                round=r.round,
                reason=r.reason,
                started_at=r.started_at,
                completed_at=r.completed_at,
                world_size=r.world_size,
                nodes=r.nodes,
            )
            for r in history
        ],
        nodes_omitted=nodes_omitted,
        node_counts=counts,
        next_cursor=encode_offset(offset + len(page)) if offset + len(page) < len(listing) else None,
        history_omitted=len(job.history) - len(history),
        run=job.run,
        runs=[RunView.model_validate(vars(r)) for r in job.runs],
        culprit=CulpritView.model_validate(vars(job.culprit)) if job.culprit is not None else None,
        departed=[DepartedView.model_validate(vars(d)) for d in job.departed],
    )


def progress_age(job: Job, now: float) -> float:
    """The most seconds any running member's step has not advanced (0 with
    none reporting; a spare, such as a replaced straggler, keeps its last step)."""
    ages = [now - n.progress_at for n in job.nodes.values() if n.progress_at is not None and n.state == RUNNING]
    return round(max(0.0, *ages), 3) if ages else 0.0


def summary(job: Job) -> JobSummary:
    return JobSummary(
        job_id=job.job_id,
        state=job.state,
        round=job.round,
        min_nodes=job.spec.min_nodes,
        max_nodes=job.spec.max_nodes,
        nodes=len(job.order) if job.order else count(job, WAITING) + count(job, REJOINING),
        spares=count(job, SPARE),
        world_size=job.world_size,
        restarts=job.restarts,
        max_restarts=job.spec.max_restarts,
        created_at=job.created_at,
        run=job.run,
        reason=clip(_reason(job), MAX_SUMMARY_REASON_BYTES) or None,
    )


def _reason(job: Job) -> str:
    """A list's one line of why: how it ended, else why its round opened."""
    if job.finished:
        return job.root_cause or job.end_reason or ""
    return job.history[-1].reason if job.history else ""
