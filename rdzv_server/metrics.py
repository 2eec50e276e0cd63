"""Prometheus metrics of one server (its own registry, so apps never share)."""

from __future__ import annotations

import asyncio

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (re-exported for the app)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from .rounds import Effects, Job


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
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
            "rdzv_job_max_seconds_since_progress",
            "Most seconds any node's step has not advanced (jobs whose workers call rdzv_client.worker.progress)",
            ["job_id"],
            registry=r,
        )
        self.per_job = (
            self.joins,
            self.rounds_opened,
            self.rounds_completed,
            self.evictions,
            self.restarts,
            self.live_nodes,
            self.job_round,
            self.since_progress,
        )
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
        self.live_nodes.labels(j).set(len(job.nodes))
        self.job_round.labels(j).set(job.round)

    def forget(self, job_id: str) -> None:
        """Remove a job's series (when the job itself is removed)."""
        for metric in self.per_job:
            try:
                metric.remove(job_id)
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
