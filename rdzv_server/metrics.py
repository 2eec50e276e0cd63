"""Prometheus metrics of one server (its own registry, so apps never share).

Names follow Prometheus' conventions (base units, the unit last, ``_total``
on counters, ``_info`` for the version), checked by tests/api/test_metrics.py
(and ``promtool check metrics`` where installed); docs/design.md,
"Observability", lists them. The ``job_id`` label set is bounded: every job
that has not finished, and the last ``max_finished_jobs`` that finished; an
older finished job's series go (its record stays in the REST API until
--retain-finished). Per-job gauges of jobs that have not finished are set when
/metrics is scraped (:meth:`Metrics.refresh`, on the event loop), so jobs
restored from disk show at once.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterable

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (re-exported for the app)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from . import __version__
from .hosts import Hosts
from .protocol import JobState
from .rounds import Effects, Job, NodeState

# no <name>_created series next to every counter and histogram: twice the series for a
# timestamp nobody alerts on
disable_created_metrics()  # type: ignore[no-untyped-call]

DEFAULT_MAX_FINISHED_JOBS = 100
FORMATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
_JOB_STATES = [s.value for s in JobState]
_NODE_STATES = list(NodeState)


class Metrics:
    def __init__(self, max_finished_jobs: int = DEFAULT_MAX_FINISHED_JOBS) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.max_finished_jobs = max_finished_jobs
        self._finished: OrderedDict[str, None] = OrderedDict()  # finished jobs that keep series, oldest first
        self.joins = Counter("rdzv_joins", "Join messages accepted", ["job_id"], registry=r)
        self.rounds_opened = Counter("rdzv_rounds_opened", "Rounds opened after the first", ["job_id"], registry=r)
        self.rounds_completed = Counter(
            "rdzv_rounds_completed", "Rounds whose membership froze", ["job_id"], registry=r
        )
        self.evictions = Counter(
            "rdzv_evictions", "Nodes evicted (lost connection or heartbeat)", ["job_id"], registry=r
        )
        self.restarts = Counter("rdzv_restarts", "Restarts counted against the budget", ["job_id"], registry=r)
        self.live_nodes = Gauge("rdzv_live_nodes", "Nodes known to the job", ["job_id"], registry=r)
        self.job_round = Gauge("rdzv_job_round", "Current round number", ["job_id"], registry=r)
        self.latency = Histogram(
            "rdzv_request_seconds",
            "REST request latency",
            ["route"],
            registry=r,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
        )
        self.agent_messages = Counter("rdzv_agent_messages", "Agent channel messages received", ["op"], registry=r)
        self.since_progress = Gauge(
            "rdzv_job_since_progress_seconds",
            "Most seconds any node's step has not advanced (jobs whose workers call rdzv_client.worker.progress)",
            ["job_id"],
            registry=r,
        )
        self.job_state = Gauge(
            "rdzv_job_state", "1 for the job's state, 0 for the others", ["job_id", "state"], registry=r
        )
        self.job_nodes = Gauge("rdzv_job_nodes", "The job's nodes by node state", ["job_id", "state"], registry=r)
        self.waiting = Gauge(
            "rdzv_job_waiting_seconds",
            "Seconds the job's forming round has waited for nodes (0 while it runs)",
            ["job_id"],
            registry=r,
        )
        self.jobs = Gauge("rdzv_jobs", "Jobs on this server by state", ["state"], registry=r)
        self.formation = Histogram(
            "rdzv_round_formation_seconds",
            "Seconds from a round's opening to its membership freezing (all jobs)",
            registry=r,
            buckets=FORMATION_BUCKETS,
        )
        self.hosts_cordoned = Gauge("rdzv_hosts_cordoned", "Hosts an operator cordoned", registry=r)
        self.hosts_cooling = Gauge(
            "rdzv_hosts_cooling_down", "Hosts cooled down after repeated failures (--host-failures)", registry=r
        )
        self.info = Gauge("rdzv_server_info", "The server's version", ["version"], registry=r)
        self.info.labels(__version__).set(1)
        for state in _JOB_STATES:
            self.jobs.labels(state).set(0)
        self.hosts_cordoned.set(0)
        self.hosts_cooling.set(0)
        self.per_job = (
            self.joins,
            self.rounds_opened,
            self.rounds_completed,
            self.evictions,
            self.restarts,
            self.live_nodes,
            self.job_round,
            self.since_progress,
            self.waiting,
        )
        self.per_job_state = ((self.job_state, _JOB_STATES), (self.job_nodes, [s.value for s in _NODE_STATES]))
        self._rendering: asyncio.Future[bytes] | None = None

    def observe(self, job: Job, fx: Effects) -> None:
        j = job.job_id
        if fx.rounds_opened:
            self.rounds_opened.labels(j).inc(fx.rounds_opened)
        if fx.rounds_completed:
            self.rounds_completed.labels(j).inc(fx.rounds_completed)
        if fx.evicted:
            self.evictions.labels(j).inc(len(fx.evicted))
        if fx.restarts:
            self.restarts.labels(j).inc(fx.restarts)
        if fx.rounds_completed and job.history:
            rec = job.history[-1]
            if rec.completed_at is not None:
                self.formation.observe(max(0.0, rec.completed_at - rec.started_at))
        if j in self._finished:
            return  # (a finished job's series are final)
        self.live_nodes.labels(j).set(len(job.nodes))
        self.job_round.labels(j).set(job.round)
        if job.finished:
            self._set_job(job, 0.0)
            try:
                self.waiting.remove(j)
            except KeyError:
                pass
            self._finished[j] = None
            while len(self._finished) > self.max_finished_jobs:
                old, _ = self._finished.popitem(last=False)
                self._remove(old)

    def _set_job(self, job: Job, now: float) -> None:
        j = job.job_id
        for state in _JOB_STATES:
            self.job_state.labels(j, state).set(1 if job.state.value == state else 0)
        for node_state in _NODE_STATES:
            self.job_nodes.labels(j, node_state.value).set(job.counts.get(node_state, 0))
        if not job.finished:
            rec = job.history[-1] if job.history else None
            waited = now - rec.started_at if job.forming and rec is not None else 0.0
            self.waiting.labels(j).set(round(max(0.0, waited), 3))

    def refresh(self, jobs: Iterable[Job], hosts: Hosts, now: float) -> None:
        """Set what changes with time or is not an effect (before a scrape, on
        the event loop): per-job gauges of jobs that have not finished, jobs by
        state, hosts cordoned and cooling down."""
        counts = dict.fromkeys(_JOB_STATES, 0)
        for job in jobs:
            counts[job.state.value] += 1
            if not job.finished:
                self._set_job(job, now)
                self.live_nodes.labels(job.job_id).set(len(job.nodes))
                self.job_round.labels(job.job_id).set(job.round)
        for state, n in counts.items():
            self.jobs.labels(state).set(n)
        records = list(hosts.records.values())
        self.hosts_cordoned.set(sum(1 for rec in records if rec.cordon_active(now)))
        self.hosts_cooling.set(sum(1 for rec in records if rec.cooling(now) and not rec.cordon_active(now)))

    def forget(self, job_id: str) -> None:
        """Remove a job's series (when the job itself is removed)."""
        self._finished.pop(job_id, None)
        self._remove(job_id)

    def _remove(self, job_id: str) -> None:
        for metric in self.per_job:
            try:
                metric.remove(job_id)
            except KeyError:
                pass
        for metric, states in self.per_job_state:
            for state in states:
                try:
                    metric.remove(job_id, state)
                except KeyError:
                    pass

    def set_progress(self, since: dict[str, float]) -> None:
        for job_id, seconds in since.items():
            self.since_progress.labels(job_id).set(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def render_off_loop(self) -> bytes:
        """Render in a worker thread, so a large registry never holds the event
        loop; requests that arrive meanwhile share the render in progress."""
        if self._rendering is None:
            self._rendering = asyncio.ensure_future(asyncio.to_thread(self.render))
            self._rendering.add_done_callback(self._rendered)
        return await asyncio.shield(self._rendering)

    def _rendered(self, fut: asyncio.Future[bytes]) -> None:
        self._rendering = None
        if not fut.cancelled():
            fut.exception()  # retrieved: waiters that were cancelled must not leave it unobserved
