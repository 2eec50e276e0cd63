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
from collections.abc import Callable, Iterable

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (re-exported for the app)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from rdzv_common import __version__
from rdzv_common.protocol import JobState

from .hosts import Hosts
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
        self.stragglers = Counter(
            "rdzv_stragglers_flagged",
            "Ranks flagged as stragglers by their compute or NCCL RAS (lock-step; the straggler_flagged event)",
            ["job_id"],
            registry=r,
        )
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
        self.storage_requests = Counter(
            "rdzv_storage_write_requests",
            "Write requests sent to durable storage (SQLite or etcd transactions)",
            registry=r,
        )
        self._storage_seen = 0
        self.ha_leader: Gauge | None = None  # only on an HA replica (--etcd): see set_leader
        self.since_progress = Gauge(
            "rdzv_job_since_progress_seconds",
            "Most seconds any node's step has not advanced (jobs whose workers call rdzv_client.worker.progress)",
            ["job_id"],
            registry=r,
        )
        self.job_state = Gauge(
            "rdzv_job_state", "1, with the job's state as a label (one series per job)", ["job_id", "state"], registry=r
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
            self.stragglers,
            self.live_nodes,
            self.job_round,
            self.since_progress,
            self.waiting,
        )
        # the labelled children counted per message (a .labels() call costs a lock and a
        # tuple per use: twice per join at 16,384 joins a round): per job (dropped with its
        # series, :meth:`_remove`), and per op (a handful)
        self._joins: dict[str, Counter] = {}
        self._by_op: dict[str, Counter] = {}
        # per job: what its gauges show now ((state, nodes per node state, nodes, round))
        self._shown: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        self._dirty: set[str] = set()  # jobs whose gauges changed since the last scrape
        self._rendering: asyncio.Future[bytes] | None = None

    def joined(self, job_id: str) -> None:
        """A join accepted (rdzv_joins_total)."""
        child = self._joins.get(job_id)
        if child is None:
            child = self._joins[job_id] = self.joins.labels(job_id)
        child.inc()

    def agent_message(self, op: str) -> None:
        """A message of an agent, by its op (rdzv_agent_messages_total): the protocol's few ops."""
        child = self._by_op.get(op)
        if child is None:
            child = self._by_op[op] = self.agent_messages.labels(op)
        child.inc()

    def observe(self, job: Job, fx: Effects) -> None:
        """A step's effects: its events (rounds, restarts, formation times), nodes
        whose connection the server dropped, and the job's gauges (a finished job's
        at once, a live job's at the next scrape)."""
        j = job.job_id
        for ev in fx.events:
            if ev.kind == "round_opened":
                self.rounds_opened.labels(j).inc()
            elif ev.kind == "round_completed":
                self.rounds_completed.labels(j).inc()
                self.formation.observe(max(0.0, ev.fields["formation_s"]))
            elif ev.kind == "restart_charged":
                self.restarts.labels(j).inc()
            elif ev.kind == "straggler_flagged":
                self.stragglers.labels(j).inc()
        if fx.evicted:
            self.evictions.labels(j).inc(len(fx.evicted))
        if j in self._finished:
            if job.finished:
                return  # (a finished job's series are final)
            del self._finished[j]  # the job id started its next run: its series move again
        if not job.finished:  # its gauges are set at the next scrape (refresh), not per join:
            self._dirty.add(j)  # a 16,384-node formation is 16,384 effects
            return
        self._dirty.discard(j)
        self._set_job(job)
        self._finished[j] = None
        while len(self._finished) > self.max_finished_jobs:
            old, _ = self._finished.popitem(last=False)
            self._remove(old)

    def _set_job(self, job: Job) -> None:
        """The job's gauges, where they changed since they were last set (a
        scrape or an effect costs a tuple comparison per unchanged job)."""
        j = job.job_id
        counts = tuple(job.counts.get(s, 0) for s in _NODE_STATES)
        now = (job.state.value, counts, len(job.nodes), job.round)
        was = self._shown.get(j)
        if now == was:
            return
        self._shown[j] = now
        if was is None or was[0] != job.state.value:
            if was is not None:
                self.job_state.remove(j, was[0])
            self.job_state.labels(j, job.state.value).set(1)
            if job.finished:
                self._remove_series(self.waiting, j)
            elif not job.forming:
                self.waiting.labels(j).set(0)
        for i, node_state in enumerate(_NODE_STATES):
            if was is None or was[1][i] != counts[i]:
                self.job_nodes.labels(j, node_state.value).set(counts[i])
        self.live_nodes.labels(j).set(len(job.nodes))
        self.job_round.labels(j).set(job.round)

    def refresh(self, jobs: Iterable[Job], hosts: Hosts, now: float) -> None:
        """Before a scrape, on the event loop: what changes with time or is not
        an effect: jobs by state, how long forming jobs have waited, the
        gauges of jobs restored from disk, hosts cordoned and cooling down.
        O(jobs) dictionary look-ups, plus label updates only where something changed."""
        counts = dict.fromkeys(_JOB_STATES, 0)
        for job in jobs:
            counts[job.state.value] += 1
            if job.finished:
                continue
            if job.job_id not in self._shown or job.job_id in self._dirty:
                self._set_job(job)
            if job.forming:
                rec = job.history[-1] if job.history else None
                waited = now - rec.started_at if rec is not None else 0.0
                self.waiting.labels(job.job_id).set(round(max(0.0, waited), 3))
        self._dirty.clear()
        for state, n in counts.items():
            self.jobs.labels(state).set(n)
        records = list(hosts.records.values())
        self.hosts_cordoned.set(sum(1 for rec in records if rec.cordon_active(now)))
        self.hosts_cooling.set(sum(1 for rec in records if rec.cooling(now) and not rec.cordon_active(now)))

    def forget(self, job_id: str) -> None:
        """Remove a job's series (when the job itself is removed)."""
        self._finished.pop(job_id, None)
        self._remove(job_id)

    @staticmethod
    def _remove_series(metric: Gauge | Counter, *labels: str) -> None:
        try:
            metric.remove(*labels)
        except KeyError:
            pass

    def _remove(self, job_id: str) -> None:
        self._shown.pop(job_id, None)
        self._joins.pop(job_id, None)  # a child of a removed series counts for nobody
        self._dirty.discard(job_id)
        for metric in self.per_job:
            self._remove_series(metric, job_id)
        for job_state in _JOB_STATES:
            self._remove_series(self.job_state, job_id, job_state)
        for node_state in _NODE_STATES:
            self._remove_series(self.job_nodes, job_id, node_state.value)

    def set_leader(self, serving: bool) -> None:
        """An HA replica (--etcd): rdzv_ha_leader is 1 while it leads and serves, else 0
        (absent on a standalone server, so that "no leader" alerts see only replicas)."""
        if self.ha_leader is None:
            self.ha_leader = Gauge(
                "rdzv_ha_leader", "1 while this HA replica leads and serves, 0 while it follows", registry=self.registry
            )
        self.ha_leader.set(1 if serving else 0)

    def watch_request_bytes(self, read: Callable[[], int]) -> None:
        """An HA replica (--etcd): rdzv_storage_max_request_bytes, ``read()`` at each scrape."""
        Gauge(
            "rdzv_storage_max_request_bytes",
            "The largest request sent to etcd so far, in bytes as sent (JSON, values in base64: more than "
            "what etcd's --max-request-bytes counts)",
            registry=self.registry,
        ).set_function(read)

    def set_storage_requests(self, total: int) -> None:
        """The backend's running count of write requests (it restarts with a new backend)."""
        self.storage_requests.inc(max(0, total - self._storage_seen))
        self._storage_seen = total

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
