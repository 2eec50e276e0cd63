"""Progress on heartbeats and the straggler flag of one job: pure, no I/O, no clock.

A heartbeat's second form carries the step and steps/s its node's workers
reported; :func:`heartbeat` keeps them on the node and, at most every
``STRAGGLER_CHECK_S`` per job, :func:`check_stragglers` flags or unflags
running members by the job's ``straggler_fraction`` and ``straggler_window_s``
(log lines, nothing persisted or sent) and, under ``straggler_policy``
"replace", opens a round in which a waiting spare takes a straggler's place.
A job whose running members report at least ``slow_ranks.MIN_RANKS`` ranks'
timings is lock-stepped: there :mod:`.slow_ranks` decides by the ranks'
compute instead (every rank has the same step rate). A rank its agent sees
behind in NCCL RAS flags its node as well, either way (:mod:`.nccl_lag`). A
flag, by any rule, counts as a failure of the node's host
(rdzv_server.hosts: cool-downs).
"""

from __future__ import annotations

from collections.abc import Callable

from rdzv_common.errors import ErrorCode, RequestError
from rdzv_common.protocol import RankLag, RankTiming

from . import nccl_lag, slow_ranks
from .events import note
from .machine import _open_round
from .model import RUNNING, SPARE, Effects, Job, Node, blocked

# A running member whose steps/s stays below the job's straggler_fraction of its
# median (over members that report a rate) for straggler_window_s is a straggler
# (JobSpec); looked for at most every STRAGGLER_CHECK_S per job, on progress heartbeats.
STRAGGLER_CHECK_S = 1.0


def heartbeat(
    job: Job,
    node_id: str,
    now: float,
    step: int | None = None,
    rate: float | None = None,
    timings: tuple[RankTiming, ...] | None = None,
    lag: tuple[RankLag, ...] | None = None,
) -> Effects:
    """The fast path: a node is alive. Unknown nodes are ignored (their
    connection is told on their next real message). ``step``/``rate``: the
    progress its workers reported (the heartbeat's second form), ``timings``
    its ranks' (kept as they are, replacing the last ones; a local rank the
    node does not have is refused, and nothing changes). The effects are log
    lines (a node became, or stopped being, a straggler) and, under
    straggler_policy "replace", a new round without a straggler. ``lag``: the
    local ranks its agent sees behind in NCCL RAS (:mod:`.nccl_lag`; checked
    like ``timings``), with or without a step."""
    node = job.nodes.get(node_id)
    if node is None:
        return Effects()
    if timings and timings[-1].local_rank >= node.local_world_size:  # in local-rank order (RankTiming)
        raise RequestError(
            f"timings: local rank {timings[-1].local_rank}, but node {node_id!r} has "
            f"{node.local_world_size} local rank(s)",
            ErrorCode.VALIDATION_ERROR,
        )
    if lag and lag[-1].local_rank >= node.local_world_size:  # in local-rank order (HeartbeatMsg)
        raise RequestError(
            f"nccl_lag: local rank {lag[-1].local_rank}, but node {node_id!r} has "
            f"{node.local_world_size} local rank(s)",
            ErrorCode.VALIDATION_ERROR,
        )
    node.last_seen = now
    node.graced = False
    nccl_lag.report(node, lag, step, now)
    if step is None and lag is None:
        return Effects()
    if step is not None:
        if node.step is None or step != node.step or node.progress_at is None:
            node.progress_at = now
        node.step = step
        node.timings, node.timings_at = timings, (now if timings else None)
        if job.max_step is None or step > job.max_step:
            job.max_step = step  # restart storms: progress is a step beyond the round's start
        node.step_rate = rate
    if now - job.stragglers_at < STRAGGLER_CHECK_S:
        return Effects()
    job.stragglers_at = now
    return check_stragglers(job, now)


def check_stragglers(job: Job, now: float) -> Effects:
    """Flag running members whose rate stayed below the job's straggler
    fraction of the median for its straggler window (or, lock-step, whose rank
    computes too long; or whose agent sees a rank behind in NCCL RAS); unflag
    those back; then apply the straggler policy. O(n log n)."""
    spec = job.spec
    members = [job.nodes[n] for n in job.order if n in job.nodes and job.nodes[n].state == RUNNING]
    ranks = slow_ranks.timed(job, members, now)
    median: float | None = None  # the job's median steps/s where the step-rate rule decides
    if len(ranks) >= slow_ranks.MIN_RANKS:  # lock-step: the ranks' compute decides (slow_ranks)
        fx = slow_ranks.check(job, ranks, members, now)
    else:
        fx, median = _by_rate(job, members, now)
    fx.merge(nccl_lag.check(job, members, now))
    if spec.straggler_policy == "replace":

        def why(n: Node) -> str:
            if n.slow_rank is not None:
                return slow_ranks.why(job, n)
            return (
                f"{n.step_rate:g} steps/s, below {spec.straggler_fraction:g} x the job's "
                f"median {median:g} for {spec.straggler_window_s:g}s"
            )

        out = [n for n in members if n.straggler and (n.slow_rank is not None or n.step_rate is not None)]
        fx.merge(_replace(job, [n for n in out if n.slow_rank is not None or median is not None], why, now))
    return fx


def _by_rate(job: Job, members: list[Node], now: float) -> tuple[Effects, float | None]:
    """The step-rate rule (not lock-stepped): its effects and the job's median
    steps/s (None: fewer than 2 members report a rate, nothing decided)."""
    fx = Effects()
    spec = job.spec
    rated = [n for n in members if n.step_rate is not None]
    if len(rated) < 2:
        return fx, None
    rates = sorted(n.step_rate for n in rated if n.step_rate is not None)
    mid = len(rates) // 2
    median = rates[mid] if len(rates) % 2 else (rates[mid - 1] + rates[mid]) / 2
    for n in rated:
        assert n.step_rate is not None
        if nccl_lag.owns(n):
            continue  # its flag is the NCCL rule's to lift
        if median > 0 and n.step_rate < spec.straggler_fraction * median:
            n.slow_since = now if n.slow_since is None else n.slow_since
            if not n.straggler and now - n.slow_since >= spec.straggler_window_s:
                n.straggler = True
                text = (
                    f"job {job.job_id}: node {n.node_id} ({n.host}) is a straggler: {n.step_rate:g} "
                    f"steps/s for {now - n.slow_since:.0f}s, job median {median:g} "
                    f"(straggler policy {spec.straggler_policy})"
                )
                fx.logs.append(note(job, text, n.node_id, host=n.host))
                fx.host_failures.append((n.host, f"straggler: {text}"))
        else:
            n.slow_since = None
            n.straggler_note = None
            if n.straggler:
                n.straggler, n.slow_rank = False, None
                text = (
                    f"job {job.job_id}: node {n.node_id} ({n.host}) is no longer a straggler: "
                    f"{n.step_rate:g} steps/s, job median {median:g}"
                )
                fx.logs.append(note(job, text, n.node_id, host=n.host))
    return fx, median


def _replace(job: Job, stragglers: list[Node], why: Callable[[Node], str], now: float) -> Effects:
    """straggler_policy "replace": as many stragglers as spares wait (connected,
    host not blocked) are replaced: a round opens at once, the spares are in it,
    and each replaced node is told why when it rejoins (it waits as a spare).
    The others are flagged only, said once: the job never shrinks to drop one."""
    fx = Effects()
    if not stragglers:
        return fx
    spares = [n for n in job.nodes.values() if n.state == SPARE and n.connected and blocked(job, n, now) is None]
    out, kept = stragglers[: len(spares)], stragglers[len(spares) :]
    for n in kept:
        if n.straggler_note is None:
            n.straggler_note = "no spare waits to replace it: flagged only (straggler policy replace)"
            text = f"job {job.job_id}: straggler node {n.node_id} ({n.host}) is kept: {n.straggler_note}"
            fx.logs.append(note(job, text, n.node_id, host=n.host))
    if not out:
        return fx
    for n in out:
        n.replaced = f"replaced as a straggler: {why(n)}; waiting as a spare"
        n.straggler, n.slow_since, n.straggler_note = False, None, None
        n.slow_rank, n.rank_slow_since, n.nccl_lag, n.nccl_lag_at = None, {}, None, None
    names = ", ".join(f"{n.node_id} ({n.host})" for n in out[:8])
    return fx.merge(_open_round(job, f"straggler: node(s) {names} replaced by a spare", now))
