"""Heartbeats that fit the job, the server's side (issue 23, item 2): the
interval a joining node is told (:func:`rdzv_server.rounds.pace.heartbeat_s`
over the nodes the server has), each told node's heartbeat arrivals
(:class:`~rdzv_server.rounds.pace.Arrivals`), and a sweep that hands a running
member silent past its limit to the same kernel-ack probe a peer's report
causes (:meth:`rdzv_server.suspicion.Suspicion.silent`). Silence never evicts
by itself; the heartbeat timeout is unchanged and stays the hard bound.

The sweep runs from the store's tick. When the tick itself came late (the
loop was busy or starved: heartbeats may sit unread in the sockets), nobody is
judged on the silence before that moment (``calm_since``), as the agents'
peer probers give a fresh grace after their own stall.

When the server grows (jobs added after a small one was told 0.25 s), the
nodes told an interval now too fast for the budget are told the new one
(``pace``; an agent too old for it keeps its interval until its next
``joined``), so the total stays near the budget however the nodes came.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from rdzv_common.protocol import PaceMsg

from .rounds.model import RUNNING, Effects, Job
from .rounds.pace import Arrivals, heartbeat_s, told_interval, unanswered

if TYPE_CHECKING:
    from .store import Store

SWEEP_S = 0.25  # how often silences are looked for
LATE_S = 0.25  # a tick this much later than due: the loop was busy, silences so far are not judged
MAX_PROBES_PER_SWEEP = 64  # silence probes one sweep may start (a rack's worth; the rest next sweep)
MAX_TRACKED = 1 << 17  # nodes whose arrivals are kept, server-wide
CLEAN_S = 10.0  # how often every entry is checked for a node or job that is gone
REPACE_GROWTH = 1.25  # the server grew by this factor since the nodes were last paced: pace them again


class Pacing:
    """The store's heartbeat intervals and silence judgments."""

    def __init__(self, store: Store, tick_s: float) -> None:
        self.store = store
        self.tick_s = tick_s
        self.arrivals: dict[tuple[str, str], Arrivals] = {}
        self.nodes = 0  # nodes of active jobs, as of the last sweep
        now = time.monotonic()
        self.calm_since = now  # silences before this are not judged (the loop was late then)
        self._ticked = now
        self._swept = now
        self._cleaned = now
        self._paced_nodes = 0  # self.nodes when the nodes were last paced

    def forget(self) -> None:
        """An HA replica stepped down: what it learned of its agents' heartbeats goes with them."""
        self.arrivals.clear()
        self.nodes = self._paced_nodes = 0

    def interval(self, job: Job) -> float:
        """The interval to tell a node joining ``job`` now: over the nodes the
        server has, and those this job is sure to bring (up to its min_nodes),
        so a join storm is told its final interval from its first join."""
        have = max(self.nodes, len(self.store.channels))
        return heartbeat_s(job.spec, have + max(0, job.spec.min_nodes - len(job.nodes)))

    def told(self, job: Job, node_id: str, fx: Effects) -> None:
        """``node_id``'s join had effects ``fx``: the interval its ``joined`` tells.
        A reconnect (``assigned`` again, no ``joined``) is judged anew from its next heartbeat.
        A join told no ``joined`` (a previous member's rejoin after ``restart``, a reconnect)
        of a node told an interval over REPACE_GROWTH times faster or slower than a join is
        told now gets a ``pace`` with that one (a smaller change is not worth a message); one
        this server never told (it restarted, or leads since a failover) gets a ``pace`` at its
        rejoin into a forming round, and is tracked from then on, as a ``joined`` did."""
        key = (job.job_id, node_id)
        arr = self.arrivals.get(key)
        if arr is not None:
            arr.rejoined()
        interval = told_interval(job)  # (what a joined among ``fx`` told)
        for to, msg in fx.sends:
            if to == node_id and msg.op == "joined":
                if arr is not None:
                    arr.tell(interval)
                elif len(self.arrivals) < MAX_TRACKED:
                    self.arrivals[key] = Arrivals(interval)
                return
        if arr is None:
            if not job.forming or node_id not in job.nodes or len(self.arrivals) >= MAX_TRACKED:
                return  # a reconnect into a running round: tracked from its next round change
            self.arrivals[key] = Arrivals(interval)
        elif max(arr.next / interval, interval / arr.next) <= REPACE_GROWTH:
            return
        else:
            arr.tell(interval)
        fx.sends.insert(0, (node_id, PaceMsg(heartbeat_s=interval)))  # before what the join caused

    def heard(self, job_id: str, node_id: str) -> None:
        """A heartbeat of ``node_id`` (the hot path: one lookup, a few flops)."""
        arr = self.arrivals.get((job_id, node_id))
        if arr is not None:
            arr.heard(time.monotonic(), arr.last is None or arr.last >= self.calm_since)

    def unanswered(self, job: Job, node_id: str, round_no: int, silent_s: float, waited_s: float) -> None:
        """``node_id``'s silence was probed and nothing answered, no peer reported it: its
        connection is cut, and it is lost after the disconnect grace with the reason
        rounds.pace.unanswered gives (a partition that heals within the grace costs nothing)."""
        why = unanswered(job, node_id, round_no, silent_s, waited_s)
        chan = self.store.channels.get((job.job_id, node_id))
        if why is not None and chan is not None:
            kill = getattr(chan, "kill", None)
            if kill is not None:
                kill(why)
            else:
                chan.drop()

    def repace(self) -> None:
        """Every tracked node told an interval over REPACE_GROWTH times faster than
        the one it would be told now is told that one (the total rate: near the budget)."""
        texts: dict[float, str] = {}
        wants: dict[str, float | None] = {}  # per job (a join storm's growth repaces every node so far, ~40 times)
        for (job_id, node_id), arr in self.arrivals.items():
            if job_id in wants:
                want = wants[job_id]
            else:
                job = self.store.jobs.get(job_id)
                want = wants[job_id] = None if job is None or job.finished else heartbeat_s(job.spec, self.nodes)
            if want is None or arr.next * REPACE_GROWTH >= want:
                continue
            chan = self.store.channels.get((job_id, node_id))
            if chan is not None:
                text = texts.get(want)
                if text is None:
                    text = texts[want] = PaceMsg(heartbeat_s=want).model_dump_json()
                chan.deliver(text)
                arr.tell(want)

    def tick(self) -> None:
        """From the store's tick: note a late loop; every SWEEP_S, judge."""
        now = time.monotonic()
        if now - self._ticked > self.tick_s + LATE_S:
            self.calm_since = now
        self._ticked = now
        if now - self._swept < SWEEP_S:
            return
        self._swept = now
        store = self.store
        self.nodes = sum(len(store.jobs[j].nodes) for j in store.active if j in store.jobs)
        if not store.serving:
            return
        self._paced_nodes = min(self._paced_nodes, self.nodes)  # growth counts from the lowest since
        if self.nodes > self._paced_nodes * REPACE_GROWTH:
            self._paced_nodes = self.nodes
            self.repace()
        started, gone = 0, []
        # the common case, skipped at the cost of a comparison: never heard since told, or heard
        # within the least silence it could be judged on (at 16,384 nodes heartbeating every 2 s,
        # half of them were over 1 s quiet at any sweep, and each had its limit worked out, 4
        # times a second); every CLEAN_S all are looked at (a node or job gone)
        cleaning = now - self._cleaned >= CLEAN_S
        if cleaning:
            self._cleaned = now
        for key, arr in self.arrivals.items():
            if not cleaning and now < arr.quiet_at:
                continue
            job = store.jobs.get(key[0])
            node = job.nodes.get(key[1]) if job is not None and not job.finished else None
            if job is None or node is None:
                gone.append(key)
                continue
            silent = arr.silent(now, self.calm_since, job.spec.heartbeat_timeout_s)
            if silent is None:
                continue
            judged = node.state == RUNNING and not job.forming and node.connected and started < MAX_PROBES_PER_SWEEP
            if judged and store.suspicion.silent(key[0], key[1], job.round, silent, now):
                started += 1
        for key in gone:
            del self.arrivals[key]
