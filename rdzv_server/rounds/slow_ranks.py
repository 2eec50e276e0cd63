"""Stragglers in lock-step training, by their compute (issue 22): pure, no I/O,
no clock.

In synchronous data-parallel training every rank waits for the slowest one
inside the gradient all-reduce, so every rank has the same step rate and the
step-rate rule (:mod:`.progress`) sees nothing. The slow rank is the one that
computes longest (and waits least). Per rank that reports timings
(``protocol.RankTiming``: its agent's last progress heartbeat), its compute
fraction is ``compute_s / window_s``; its score is the median fraction over
every timed rank of the job's running members divided by its own. A rank is
slow when its score is below the job's ``straggler_score`` (default 0.75) AND
its fraction is beyond the median by more than ``MAD_K`` robust deviations
(``MAD_SCALE`` x the median absolute deviation): in a job whose ranks are
spread anyway, a rank at the edge of the spread is no outlier. One that stays
slow for ``straggler_window_s`` flags its node (the slowest such rank is
named). It needs ``MIN_RANKS`` timed ranks: with fewer, the job's median is
no baseline, and the step-rate rule decides.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import nccl_lag
from .events import note, straggler_flagged
from .model import Effects, Job, Node, SlowRank

MIN_RANKS = 3  # timed ranks a job needs before its compute decides (else the step-rate rule)
MAD_K = 3.0  # a slow rank is also beyond this many robust deviations above the median
MAD_SCALE = 1.4826  # MAD x this estimates a normal distribution's standard deviation


def median(values: Sequence[float]) -> float:
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def slow(fractions: Sequence[float], threshold: float) -> list[tuple[float, bool]]:
    """Per compute fraction: (its score, median / own; whether it is slow: the
    score below ``threshold`` and the fraction more than MAD_K robust
    deviations above the median). Nobody is slow with fewer than MIN_RANKS
    fractions, or when the median is 0 (the ranks do not compute, as far as
    their timings say)."""
    if len(fractions) < MIN_RANKS:
        return [(1.0, False) for _ in fractions]
    mid = median(fractions)
    if mid <= 0:
        return [(1.0, False) for _ in fractions]
    spread = MAD_K * MAD_SCALE * median([abs(f - mid) for f in fractions])
    out = []
    for f in fractions:
        score = mid / f if f > 0 else float("inf")
        out.append((score, score < threshold and f - mid > spread))
    return out


def timed(job: Job, members: list[Node], now: float) -> list[tuple[Node, int, float]]:
    """(node, local rank, compute fraction) of every rank of ``members`` whose
    node's timings are fresh: no older than the straggler window plus two of
    their own windows (the next progress heartbeat is late)."""
    window = job.spec.straggler_window_s
    out: list[tuple[Node, int, float]] = []
    for n in members:
        if not n.timings or n.timings_at is None:
            continue
        if now - n.timings_at <= window + 2 * max(t.window_s for t in n.timings):
            out.extend((n, t.local_rank, min(1.0, t.compute_s / t.window_s)) for t in n.timings)
    return out


def check(job: Job, ranks: list[tuple[Node, int, float]], members: list[Node], now: float) -> Effects:
    """Flag the members with a rank slow for the straggler window (an event, and
    a failure counted against its host); unflag those with none slow (a log
    line). ``ranks``: :func:`timed`, at least MIN_RANKS. O(r log r)."""
    fx = Effects()
    spec = job.spec
    scored = slow([f for _, _, f in ranks], spec.straggler_score)
    mid = median([f for _, _, f in ranks])
    worst: dict[str, SlowRank] = {}
    slow_now: dict[str, set[int]] = {}
    for (n, local_rank, fraction), (score, is_slow) in zip(ranks, scored, strict=True):
        if not is_slow:
            continue
        since = n.rank_slow_since.setdefault(local_rank, now)
        slow_now.setdefault(n.node_id, set()).add(local_rank)
        if now - since >= spec.straggler_window_s:
            best = worst.get(n.node_id)
            if best is None or score < best.ratio:
                worst[n.node_id] = SlowRank(local_rank, fraction, mid, score, since)
    for n in members:
        keep = slow_now.get(n.node_id, set())
        n.rank_slow_since = {r: t for r, t in n.rank_slow_since.items() if r in keep}
        flagged = worst.get(n.node_id)
        if flagged is not None:
            if n.slow_rank is None:
                ev = straggler_flagged(job, n, flagged, now)
                fx.event(ev)
                fx.host_failures.append((n.host, f"straggler: {ev.text}"))
            n.slow_rank, n.straggler = flagged, True
        elif n.straggler and not keep and not nccl_lag.owns(n):  # (by its compute, or earlier its step rate)
            n.slow_rank, n.straggler, n.straggler_note, n.slow_since = None, False, None, None
            text = (
                f"job {job.job_id}: node {n.node_id} ({n.host}) is no longer a straggler: no rank of it "
                f"computes beyond the job's (median compute fraction {mid:.3f})"
            )
            fx.logs.append(note(job, text, n.node_id, host=n.host))
    return fx


def why(job: Job, n: Node) -> str:
    """Why ``n`` was replaced, in words (straggler_policy replace)."""
    s = n.slow_rank
    assert s is not None
    if s.rule == "nccl_lag":
        return nccl_lag.why(job, n)
    return (
        f"rank {n.rank_offset + s.local_rank} computes {s.fraction:.3f} of its time, the job's median "
        f"{s.median:.3f} (score {s.ratio:.2f} below {job.spec.straggler_score:g}) for {job.spec.straggler_window_s:g}s"
    )
