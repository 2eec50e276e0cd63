"""Progress on heartbeats and the straggler flag of one job: pure, no I/O, no clock.

A heartbeat's second form carries the step and steps/s its node's workers
reported; :func:`heartbeat` keeps them on the node and, at most every
``STRAGGLER_CHECK_S`` per job, :func:`check_stragglers` flags or unflags
running members (it returns log lines; nothing is persisted or sent).
"""

from __future__ import annotations

from .model import RUNNING, Job

# A running member whose steps/s stays below STRAGGLER_FRACTION of the job's
# median (over members that report a rate) for STRAGGLER_WINDOW_S is a
# straggler; looked for at most every STRAGGLER_CHECK_S per job, on progress heartbeats.
STRAGGLER_FRACTION = 0.5
STRAGGLER_WINDOW_S = 30.0
STRAGGLER_CHECK_S = 1.0


def heartbeat(job: Job, node_id: str, now: float, step: int | None = None, rate: float | None = None) -> list[str]:
    """The fast path: a node is alive. Unknown nodes are ignored (their
    connection is told on their next real message). ``step``/``rate``: the
    progress its workers reported (the heartbeat's second form). Returns log
    lines (a node became, or stopped being, a straggler)."""
    node = job.nodes.get(node_id)
    if node is None:
        return []
    node.last_seen = now
    node.graced = False
    if step is None:
        return []
    if node.step is None or step != node.step or node.progress_at is None:
        node.progress_at = now
    node.step = step
    if job.max_step is None or step > job.max_step:
        job.max_step = step  # restart storms: progress is a step beyond the round's start
    node.step_rate = rate
    if now - job.stragglers_at < STRAGGLER_CHECK_S:
        return []
    job.stragglers_at = now
    return check_stragglers(job, now)


def check_stragglers(job: Job, now: float) -> list[str]:
    """Flag running members whose rate stayed below STRAGGLER_FRACTION of the
    median for STRAGGLER_WINDOW_S; unflag those back above it. O(n log n)."""
    members = [job.nodes[n] for n in job.order if n in job.nodes and job.nodes[n].state == RUNNING]
    rated = [n for n in members if n.step_rate is not None]
    if len(rated) < 2:
        return []
    rates = sorted(n.step_rate for n in rated if n.step_rate is not None)
    mid = len(rates) // 2
    median = rates[mid] if len(rates) % 2 else (rates[mid - 1] + rates[mid]) / 2
    lines = []
    for n in rated:
        assert n.step_rate is not None
        if median > 0 and n.step_rate < STRAGGLER_FRACTION * median:
            n.slow_since = now if n.slow_since is None else n.slow_since
            if not n.straggler and now - n.slow_since >= STRAGGLER_WINDOW_S:
                n.straggler = True
                lines.append(
                    f"job {job.job_id}: node {n.node_id} ({n.host}) is a straggler: {n.step_rate:g} "
                    f"steps/s for {now - n.slow_since:.0f}s, job median {median:g}"
                )
        else:
            n.slow_since = None
            if n.straggler:
                n.straggler = False
                lines.append(
                    f"job {job.job_id}: node {n.node_id} ({n.host}) is no longer a straggler: "
                    f"{n.step_rate:g} steps/s, job median {median:g}"
                )
    return lines
