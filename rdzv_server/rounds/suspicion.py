"""Suspicion from the peers (issue 23): who watches whom, which reports count,
how long a probe waits, and the eviction a failed probe causes. Pure, no I/O,
no clock: every operation takes ``now`` (the I/O is rdzv_server.suspicion).

The false-positive rules (design.md "A vanished host"):

1. A report is only a reason to probe. The server evicts a node only when its
   own probe of that node's connection went unacknowledged by the node's
   *kernel*: a frozen process on a live host (SIGSTOP, a GC pause) is never
   evicted this way, nor a node with a slow link (the deadline follows its RTT).
2. A report counts only from a running member of the round it names, about
   another running member of that round; a stale one changes nothing.
3. Reports are rate-limited per reporting node (a token bucket) and a suspect
   whose host answered is not probed again for ``CLEARED_FOR_S``; the tables
   are bounded in entries.
4. An agent suspects only a peer that answered its probes before
   (rdzv_client.peer_probe): a peer that cannot be probed is never suspected.
5. The server's own judgment that a node went silent (:mod:`.pace`) opens
   the same probe (no reporter: ``silent_s`` instead), under the same
   one-probe-per-suspect, hold-off and caps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from rdzv_common.protocol import MAX_WATCH, WatchPeer

from .model import RUNNING, Effects, Job, Node

T = TypeVar("T")

PROBE_RTTS = 4.0  # the wait for the suspect's kernel to acknowledge the probe: this many smoothed RTTs ...
# ... plus one retransmission: a lost probe segment is sent again after the kernel's timeout (200 ms at least)
PROBE_RETRANSMIT_S = 0.2
# The smoothed RTT learns a link's new delay only from acknowledged server data (a pong every 5 s):
# seconds after a link slowed it still reads the old value. The shortest wait covers this much delay
# gained unseen (issue 23's soak: 300 ms added on one node), a retransmission and 0.1 s of scheduling.
UNSEEN_DELAY_S = 0.3
PROBE_MIN_S = UNSEEN_DELAY_S + PROBE_RETRANSMIT_S + 0.1
REPORT_BURST = 4  # reports one node may make at once ...
REPORT_RATE = 1.0  # ... and per second after that
CLEARED_FOR_S = 2.0  # a suspect whose host answered is not probed again for this long
MAX_PROBES = 4096  # suspects probed or recently cleared, server-wide
MAX_REPORTERS = 65536  # reporting nodes with a budget, server-wide


def watch_list(job: Job, node: Node) -> list[WatchPeer]:
    """The peers ``node``'s agent probes: the next MAX_WATCH members after it
    in group-rank order that answer probes, each at the address the server
    chose for it (``Node.probe_addr``: its connection's, rounds.probe_addr).
    Every member is watched by up to MAX_WATCH others, whatever the job's size.
    (A round's fan-out writes each member's once: forming.peer_texts.)"""
    return watched(job, node, peer_at(job))


def peer_at(job: Job) -> Callable[[int], WatchPeer | None]:
    """The member of each group rank as its watchers are told of it, made when asked."""
    return lambda i: _watch_peer(job, job.order[i])


def watched(job: Job, node: Node, peer: Callable[[int], T | None]) -> list[T]:
    """:func:`watch_list`'s rule, over any form of the members: ``peer(i)``
    is the member of group rank ``i`` as the list holds it (None: it answers
    no probes)."""
    n = len(job.order)
    if node.group_rank is None or n < 2:
        return []
    out = []
    for k in range(1, min(MAX_WATCH, n - 1) + 1):
        p = peer((node.group_rank + k) % n)
        if p is not None:
            out.append(p)
    return out


def _watch_peer(job: Job, node_id: str) -> WatchPeer | None:
    peer = probed(job, node_id)
    return None if peer is None else as_peer(peer)


def as_peer(node: Node) -> WatchPeer:
    """A member that answers probes (:func:`probed`) as its watchers are told of it, validated."""
    return WatchPeer(node_id=node.node_id, addr=node.probe_addr, port=node.probe_port)  # type: ignore[arg-type]


def probed(job: Job, node_id: str) -> Node | None:
    """The member ``node_id`` if it answers probes (its watchers are told of it), else None."""
    peer = job.nodes.get(node_id)
    if peer is None or peer.probe_port is None or peer.probe_addr is None:
        return None
    return peer


def probe_deadline(rtt_s: float | None) -> float:
    """How long the server waits for the suspect's kernel to acknowledge its
    probe: PROBE_MIN_S, or PROBE_RTTS round trips plus one retransmission."""
    if rtt_s is None:
        return PROBE_MIN_S
    return max(PROBE_MIN_S, PROBE_RTTS * rtt_s + PROBE_RETRANSMIT_S)


def suspects(job: Job, reporter: str, round_no: int, nodes: list[str]) -> list[str]:
    """The named nodes a report may cause a probe of (rule 2); [] for a stale
    report. The reporter naming itself is a ValueError (no race explains it)."""
    if reporter in nodes:
        raise ValueError(f"node {reporter!r} cannot suspect itself")
    me = job.nodes.get(reporter)
    if job.finished or job.forming or round_no != job.round or me is None or me.state != RUNNING:
        return []
    out = []
    for node_id in dict.fromkeys(nodes):
        peer = job.nodes.get(node_id)
        if peer is not None and peer.state == RUNNING:
            out.append(node_id)
    return out


def confirmed(
    job: Job, node_id: str, round_no: int, reporters: int, waited_s: float, now: float, silent_s: float | None = None
) -> Effects:
    """The server's probe of a suspect went unanswered: it is out, as a node
    silent past the heartbeat timeout is (its host charged), unless the round
    or the node changed meanwhile. ``silent_s``: the server probed it for its
    silence (rule 5), that long before the probe went out."""
    from .machine import _lose  # machine -> forming -> this module: imported when used

    node = job.nodes.get(node_id)
    if job.finished or job.forming or round_no != job.round or node is None or node.state != RUNNING:
        return Effects()
    said = [f"suspected by {reporters} peer(s)"] if reporters else []
    if silent_s is not None:
        said.append(f"silent for {(silent_s + waited_s) * 1000:.0f} ms")
    why = f"{', '.join(said)}, no answer to probe in {waited_s * 1000:.0f} ms"
    fx = Effects(host_failures=[(node.host, f"evicted: {why}")])
    return fx.merge(_lose(job, node_id, why, now, evict=True, lost=False))


@dataclass
class Probe:
    """One suspect being probed: for which round, and who suspects it (and
    ``silent_s``: how long it had been silent, when its silence did)."""

    round: int
    started: float
    reporters: set[str] = field(default_factory=set)
    silent_s: float | None = None


@dataclass
class Suspicions:
    """Open probes, recently cleared suspects and each reporter's budget
    (rules 3), keyed by (job id, node id). Bounded: MAX_PROBES, MAX_REPORTERS."""

    probes: dict[tuple[str, str], Probe] = field(default_factory=dict)
    cleared: dict[tuple[str, str], float] = field(default_factory=dict)  # until when
    budgets: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)  # (tokens, at)

    def allow(self, job_id: str, reporter: str, now: float) -> bool:
        """One report of ``reporter`` taken from its budget; False: over it."""
        key = (job_id, reporter)
        tokens, at = self.budgets.get(key, (float(REPORT_BURST), now))
        tokens = min(float(REPORT_BURST), tokens + max(0.0, now - at) * REPORT_RATE)
        if tokens < 1.0:
            self.budgets[key] = (tokens, now)
            return False
        if key not in self.budgets and len(self.budgets) >= MAX_REPORTERS:
            full = now - REPORT_BURST / REPORT_RATE  # buckets untouched since then are full again: forget them
            for k in [k for k, (_, t) in self.budgets.items() if t <= full]:
                del self.budgets[k]
            if len(self.budgets) >= MAX_REPORTERS:
                return False
        self.budgets[key] = (tokens - 1.0, now)
        return True

    def open(
        self, job_id: str, suspect: str, reporter: str | None, round_no: int, now: float, silent_s: float | None = None
    ) -> bool:
        """Note a report (``reporter`` None: the server's judgment that the
        suspect is ``silent_s`` silent, rule 5); True when it starts a probe
        (none open for this suspect, none cleared it lately, room in the table)."""
        key = (job_id, suspect)
        probe = self.probes.get(key)
        if probe is not None and probe.round == round_no:
            if reporter is not None:
                probe.reporters.add(reporter)
            if silent_s is not None and probe.silent_s is None:
                probe.silent_s = max(0.0, silent_s + probe.started - now)  # as of when it went out
            return False
        until = self.cleared.get(key)
        if until is not None:
            if now < until:
                return False
            del self.cleared[key]
        if len(self.probes) + len(self.cleared) >= MAX_PROBES:
            for k in [k for k, t in self.cleared.items() if t <= now]:
                del self.cleared[k]
            if len(self.probes) + len(self.cleared) >= MAX_PROBES:
                return False
        reporters = {reporter} if reporter is not None else set()
        self.probes[key] = Probe(round=round_no, started=now, reporters=reporters, silent_s=silent_s)
        return True

    def close(self, job_id: str, suspect: str, answered: bool, now: float, round_no: int | None = None) -> Probe | None:
        """The probe (of ``round_no``, if given) ended: answered (the suspect is
        left alone for CLEARED_FOR_S) or not; returns it (None: not open, or
        a later round's probe replaced it: that one ends on its own timer)."""
        probe = self.probes.get((job_id, suspect))
        if probe is None or (round_no is not None and probe.round != round_no):
            return None
        del self.probes[(job_id, suspect)]
        if answered:
            self.cleared[(job_id, suspect)] = now + CLEARED_FOR_S
        return probe
