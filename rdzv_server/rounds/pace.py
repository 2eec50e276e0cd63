"""Heartbeats that fit the job (issue 23, item 2): how often a node is told to
heartbeat, and when its silence is worth a probe. Pure: no I/O, no clock
(every operation takes ``now``; the I/O is :mod:`rdzv_server.pacing`).

The interval (:func:`heartbeat_s`): as fast as ``FAST_HEARTBEAT_S`` while the
server's total heartbeat rate, over all nodes of all jobs, stays within
``HEARTBEAT_BUDGET`` a second: ``max(FAST_HEARTBEAT_S, nodes / HEARTBEAT_BUDGET)``,
never slower than the job's own ``heartbeat_interval(spec)`` (a few per
heartbeat timeout, at most every 2 s). A small job is told 0.25 s; past
1,250 nodes in all the interval grows, and from 10,000 it is the 2 s it was.

The judgment (:class:`Arrivals`): per node, an exponentially weighted mean and
variance of the gaps between its heartbeats (a few floats, no list). A node is
*silent* once nothing came for :meth:`Arrivals.limit`:
``max(SILENCE_MIN_S, MISSED x expected gap + DEVIATIONS x deviation)``, the
expected gap being the larger of the interval it was told and the mean gap
seen (an agent that heartbeats slower than told, or a link that delivers them
late, widens its own limit). The false-positive rules (design.md "A vanished
host"):

1. Silence is only a reason to probe (:mod:`.suspicion`, the same kernel-ack
   probe a peer's report causes). When the suspect's *kernel* acknowledged
   nothing and no peer reported it, its connection is lost
   (:func:`unanswered`): the disconnect grace still applies, as when the
   keep-alive finds it. The heartbeat timeout stays the hard bound.
2. A node is judged on the interval it was *told* (a faster one takes effect
   only from its next heartbeat: the agent's sleep in progress is the old
   one), and only after it heartbeated at least once since, and since it
   last joined (a reconnect: its old silence was its old connection's).
3. A node whose limit is not shorter than its heartbeat timeout is not judged
   (the timeout comes first anyway).
4. The caller judges no silence that spans a time its own loop was late
   (``since``): heartbeats it did not read are not a node's silence; a gap
   spanning such a time is not learned from.
"""

from __future__ import annotations

import math

from rdzv_common.job_spec import JobSpec, heartbeat_interval

from .model import RUNNING, Job

FAST_HEARTBEAT_S = 0.25  # the fastest interval a node is told
HEARTBEAT_BUDGET = 5000.0  # heartbeats a second, all nodes of all jobs, the interval is sized for
SILENCE_MIN_S = 1.0  # never judged silent sooner
MISSED = 3.0  # ... nor before this many expected gaps
DEVIATIONS = 4.0  # ... plus this many deviations of the gaps seen
WEIGHT = 0.125  # of the newest gap in the running mean and variance


def heartbeat_s(spec: JobSpec, nodes: int) -> float:
    """The interval to tell a node of a job with ``spec`` when the server
    counts ``nodes`` nodes in all (those it has, and those the job is sure to
    bring: its ``min_nodes``)."""
    return min(heartbeat_interval(spec), max(FAST_HEARTBEAT_S, round(nodes / HEARTBEAT_BUDGET, 2)))


def told_interval(job: Job) -> float:
    """The interval a ``joined`` of ``job`` tells: the one the store chose
    (``job.heartbeat_s``), else the spec's own."""
    return job.heartbeat_s if job.heartbeat_s is not None else heartbeat_interval(job.spec)


def unanswered(job: Job, node_id: str, round_no: int, silent_s: float, waited_s: float) -> str | None:
    """The server probed ``node_id`` for its silence alone (no peer reported
    it) and its kernel acknowledged nothing in ``waited_s``: what the
    keep-alive would find seconds later, that its connection is lost. The
    caller cuts the connection, and the node is lost after the disconnect
    grace, as any lost connection (a partition that heals within it costs
    nothing), with this reason; None: the round or the node changed meanwhile."""
    node = job.nodes.get(node_id)
    if job.finished or job.forming or round_no != job.round or node is None or node.state != RUNNING:
        return None
    node.lost_why = f"silent for {silent_s * 1000:.0f} ms, no answer to probe in {waited_s * 1000:.0f} ms"
    return node.lost_why


class Arrivals:
    """One node's heartbeats: the interval it was told, when the last came,
    and the running mean and variance of the gaps."""

    __slots__ = ("told", "next", "last", "mean", "var", "quiet_at")

    def __init__(self, told: float) -> None:
        self.told = told  # the interval it is judged on now
        self.next = told  # ... and from its next heartbeat (rule 2)
        self.last: float | None = None  # its last heartbeat since it was told (None: none yet)
        self.mean: float | None = None
        self.var = 0.0
        # last + floor(): before then it is not silent, whatever its gaps (the sweep's one
        # comparison for most nodes); inf while it has not been heard
        self.quiet_at = math.inf

    def tell(self, interval: float) -> None:
        """It was told ``interval``: a slower one counts at once, a faster one
        from its next heartbeat."""
        self.next = interval
        if interval > self.told:
            self.told = interval
            if self.last is not None:
                self.quiet_at = self.last + self.floor()

    def rejoined(self) -> None:
        """It joined again (a new connection): its silence so far was judged on
        the old one; on this one it is judged once heard there (rule 2)."""
        self.last = None
        self.quiet_at = math.inf

    def heard(self, now: float, learn: bool = True) -> None:
        """A heartbeat at ``now``; ``learn``: the gap since the last one is a
        fair sample (the caller's loop was not late within it)."""
        if self.last is not None and learn and now > self.last:
            gap = now - self.last
            if self.mean is None:
                self.mean = gap
            else:
                d = gap - self.mean
                self.mean += WEIGHT * d
                self.var = (1.0 - WEIGHT) * (self.var + WEIGHT * d * d)
        self.last = now
        self.told = self.next
        self.quiet_at = now + self.floor()

    def floor(self) -> float:
        """How long a silence it takes at the least to be judged silent (what :meth:`limit`
        never goes below, without its square root): a node heard more lately than this
        is not silent, whatever its gaps were."""
        return max(SILENCE_MIN_S, MISSED * self.told)

    def limit(self) -> float:
        """How long a silence it takes to be judged silent."""
        expected = max(self.told, self.mean or 0.0)
        return max(SILENCE_MIN_S, MISSED * expected + DEVIATIONS * math.sqrt(self.var))

    def silent(self, now: float, since: float, timeout: float) -> float | None:
        """Seconds it has been silent if that is past its limit (counted from
        ``since`` at the earliest), None if not, or if it is not judged
        (rules 2, 3)."""
        if self.last is None:
            return None
        quiet = now - max(self.last, since)
        if quiet < SILENCE_MIN_S:  # the common case, decided without the square root
            return None
        limit = self.limit()
        if limit >= timeout or quiet < limit:
            return None
        return now - self.last
