"""Jobs, their durable state, and who to tell: the only stateful async code.

The store owns every :class:`~rdzv_server.rounds.Job`, feeds events into the
pure state machine, and carries out the :class:`~rdzv_server.rounds.Effects`
in this order: write the job to disk (when the round changed), then deliver
messages to the agents' channels, then log. So nobody ever hears of a round
that a crash could forget.

Durability is a SQLite database (``<data dir>/rdzv.db``, WAL, synchronous
FULL; :mod:`rdzv_server.database`); one row per job holding its state as JSON. A server started again over
the same data dir gets every job back as it was and gives every node a full
heartbeat timeout to reconnect before anyone is evicted. If the database is
unreadable the server refuses to start; if a write fails (disk full), the job
goes back to its last saved state, its agents are told to reconnect, and the
request that caused it gets an ``unavailable`` error.

Nothing grows without bound: the tick visits only jobs whose next deadline
passed (a heap keyed by :func:`rounds.next_due`); finished jobs are removed
after ``retain_finished_s`` (or on request) from memory, disk and metrics; a
new job is refused (``unavailable``; its agent retries) while its address
holds its quota of waiting jobs, ``max_waiting_jobs`` jobs wait for nodes
held by connected nodes, or the data dir has less than ``min_free_disk``
bytes free (:mod:`rdzv_server.quotas`). Running jobs are never refused for space.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import heapq
import json
import logging
import secrets
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from . import etcd, logs, rounds
from .cursors import decode_cursor, encode_cursor
from .database import Database, DataDirError  # noqa: F401  (DataDirError: re-exported)
from .events import EventLog, failure_fields
from .hosts import HostRecord, HostRules, Hosts
from .protocol import (
    ErrorCode,
    ErrorMsg,
    EvictedError,
    ExitRecord,
    JobFinishedError,
    JobNotFoundError,
    JobState,
    JoinMsg,
    NotLeaderError,
    RankTiming,
    UnavailableError,
    printable,
)
from .quotas import DEFAULT_WAITING_JOBS_PER_ADDRESS, Room
from .rounds import Effects, Job
from .store_hosts import HOSTS_KEY, HostsMixin
from .store_retention import RetentionMixin
from .tasks import cancel_and_wait

if TYPE_CHECKING:
    from pydantic import BaseModel

    from .ha import Replica
    from .metrics import Metrics
    from .outbox import Outbox
    from .protocol import JobSummary, JobView

log = logging.getLogger(__name__)

TICK_S = 0.1
STALL_S = 1.5  # a loop that slept this long was stopped or starved: be lenient


class Channel(Protocol):
    """Where messages for one connected agent go (a WebSocket, in the app)."""

    def deliver(self, text: str) -> None:
        """Queue one serialized message (JSON text) for the agent."""

    def drop(self) -> None:
        """Close the connection so the agent reconnects."""


# After an election, on top of the heartbeat timeout: agents of a leader whose
# host died learn it only when a heartbeat goes unacknowledged for the link's
# TCP_USER_TIMEOUT_S (4 s), up to a heartbeat interval (2 s) after the death;
# the new leader is elected about a lease TTL (2 s) after it. Without this,
# 6 s (the default heartbeat timeout) left them ~1 s to spare.
FAILOVER_GRACE_S = 5.0
DEFAULT_DISCONNECT_GRACE_S = 0.5  # a dropped connection has this long to come back (--disconnect-grace)
DEFAULT_RETAIN_FINISHED_S = 7 * 24 * 3600.0
DEFAULT_MAX_WAITING_JOBS = 1000
DEFAULT_MIN_FREE_DISK = 64 * 1024 * 1024
BIG_RECORD = 1_000_000  # bytes of a job's record past which a refused etcd write names its size


@dataclass
class StoreSettings:
    data_dir: Path | None = None  # None: memory only (embedded/standalone server)
    disconnect_grace_s: float = DEFAULT_DISCONNECT_GRACE_S
    retain_finished_s: float = DEFAULT_RETAIN_FINISHED_S  # finished jobs older than this are removed
    max_waiting_jobs: int = DEFAULT_MAX_WAITING_JOBS  # beyond it a new job is refused (or an unheld one closed)
    waiting_jobs_per_address: int = DEFAULT_WAITING_JOBS_PER_ADDRESS  # held by one creator address (0: no limit)
    min_free_disk: int = DEFAULT_MIN_FREE_DISK  # bytes; below it a new job is refused (0: no check)
    host_rules: HostRules = field(default_factory=HostRules)  # cool-downs of failing hosts, the host table's cap


class Store(HostsMixin, RetentionMixin):
    """Every job of one server. Methods are called from the event loop only.
    The host records' side (cordon, health, cool-downs) is :class:`~rdzv_server.store_hosts.HostsMixin`,
    removal of finished jobs :class:`~rdzv_server.store_retention.RetentionMixin`."""

    def __init__(
        self,
        settings: StoreSettings,
        clock: Callable[[], float] = time.time,
        metrics: Metrics | None = None,
        events: EventLog | None = None,
    ) -> None:
        self.settings = settings
        self.events = events or EventLog()  # what happened, for /v1/events (rdzv_server.events)
        self.clock = clock
        self.progress_jobs: set[str] = set()  # jobs whose agents sent progress (a subset of jobs)
        self.metrics = metrics
        self.jobs: dict[str, Job] = {}
        self.active: set[str] = set()
        self.waiting: set[str] = set()  # active jobs whose round forms: capped for new jobs
        self.channels: dict[tuple[str, str], Channel] = {}
        self.db: Database | None = None
        self._tick_task: asyncio.Task[None] | None = None
        self._last_tick = time.monotonic()
        # Active jobs by the next time a tick could change them (rounds.next_due):
        # (due, seq, job_id), stale when _due_at[job_id] says otherwise.
        self._due: list[tuple[float, int, str]] = []
        self._due_at: dict[str, float] = {}
        self._seq = 0
        self._ended: list[tuple[float, str]] = []  # finished jobs by end time, for retention
        self._order: list[tuple[float, str]] = []  # every job by (created_at, job_id): listing pages
        self.room = Room()  # the waiting-jobs cap, per address and in total (rdzv_server.quotas)
        self.hosts = Hosts(settings.host_rules)  # host records across jobs (rdzv_server.hosts)
        self._unblock_at: float | None = None  # when the next host block ends (hosts.next_unblock)
        # HA (--etcd, rdzv_server.ha): the replica's leadership, and writes queued with what waits
        # for them (rdzv_server.outbox); _committed: each job's record as etcd last acknowledged it
        self.replica: Replica | None = None
        self.outbox: Outbox | None = None
        self._committed: dict[str, str] = {}

    @property
    def durable(self) -> bool:
        """Jobs outlive this process (SQLite or etcd)."""
        return self.db is not None or self.replica is not None

    @property
    def serving(self) -> bool:
        """Not an HA replica, or its leader with the state loaded and the lease surely alive."""
        return self.replica is None or self.replica.serving

    # ------------------------------------------------------------ lifecycle

    def open(self) -> None:
        """Load durable state (raises DataDirError); call before serving."""
        if self.settings.data_dir is None:
            return
        self.db = Database(self.settings.data_dir)
        self._loaded(self.db.load(), self.db.load_hosts(), str(self.db.path))

    def _loaded(self, jobs: dict[str, Job], hosts: list[HostRecord], where: str, extra_s: float = 0.0) -> None:
        """Serve ``jobs``: every node gets a full heartbeat timeout, plus
        ``extra_s``, to reconnect."""
        self.jobs = jobs
        self.hosts.load(hosts)
        now = self.clock()
        self._unblock_at = self.hosts.next_unblock(now)
        for job in self.jobs.values():
            job.gate = self.hosts
            self._order.append((job.created_at, job.job_id))
            if not job.finished:
                rounds.restored(job, now, extra_s)
                self.events.mark(job)
                self.active.add(job.job_id)
                if job.forming:
                    self.waiting.add(job.job_id)
                self._schedule(job)
            else:
                heapq.heappush(self._ended, (job.ended_at or job.created_at, job.job_id))
        self._order.sort()
        if self.jobs:
            log.info(
                "loaded %d job(s) from %s (%d active); every node has %s to reconnect",
                len(self.jobs),
                where,
                len(self.active),
                "a full heartbeat timeout" + (f" + {extra_s:g}s" if extra_s else ""),
            )

    async def start(self) -> None:
        self._last_tick = time.monotonic()
        self._tick_task = asyncio.create_task(self._run_ticks(), name="rdzv-tick")

    # ------------------------------------------------------- HA (--etcd)

    def use_replica(self, replica: Replica) -> None:
        """Keep state in etcd through ``replica`` (rdzv_server.ha): serve only while it leads."""
        from .outbox import Outbox

        self.replica = replica
        self.outbox = Outbox(self._remote_write, self._write_failed)
        replica.on_elected = self.become_leader
        replica.on_deposed = self.step_down

    async def become_leader(self) -> None:
        """Elected: load every job and host from etcd and serve them as a restarted server does."""
        assert self.replica is not None
        jobs, hosts = await self.replica.load()
        if self.replica.role != "leader":
            return
        self.step_down("reloading", quiet=True)  # nothing may survive from an earlier term
        self._committed = {j: json.dumps(rounds.to_record(job), separators=(",", ":")) for j, job in jobs.items()}
        self._loaded(jobs, hosts, f"etcd (term {self.replica.term})", FAILOVER_GRACE_S)
        await self.start()

    def step_down(self, reason: str, quiet: bool = False) -> None:
        """Not the leader any more: forget every job (the next leader has them in etcd),
        drop every agent connection (agents reconnect and find the leader)."""
        if self._tick_task is not None:
            self._tick_task.cancel()
            self._tick_task = None
        if self.outbox is not None:
            self.outbox.drop_all()
        for chan in list(self.channels.values()):
            chan.drop()
        if not quiet and (self.jobs or self.channels):
            log.warning("dropped %d agent connection(s) and %d job(s): %s", len(self.channels), len(self.jobs), reason)
        self.channels.clear()
        if self.metrics:
            for job_id in self.jobs:
                self.metrics.forget(job_id)
        self.jobs, self._committed = {}, {}
        self.active.clear()
        self.waiting.clear()
        self.progress_jobs.clear()
        self._due, self._due_at, self._ended, self._order = [], {}, [], []
        self.hosts = Hosts(self.settings.host_rules)
        self._unblock_at = None
        self.events.marks.clear()
        self.events.close_all()

    async def _remote_write(self, key: str, payload: object) -> None:
        assert self.replica is not None
        if key == HOSTS_KEY:
            await self.replica.write(payload)  # type: ignore[arg-type]  # host ops
            return
        text = payload if isinstance(payload, str) else None
        try:
            await self.replica.write([self.replica.job_put(key, text)])
        except etcd.EtcdError as e:
            if text is not None and len(text) > BIG_RECORD:  # say why a big job cannot re-form
                raise etcd.EtcdError(
                    f"{e}; the job's record is {len(text)} bytes: etcd refuses requests over its "
                    "--max-request-bytes (1.5 MiB by default, about 3,500 nodes); raise it on etcd"
                ) from e
            raise
        if text is None:
            self._committed.pop(key, None)
        else:
            self._committed[key] = text

    def _write_failed(self, key: str, err: BaseException) -> None:
        """A write to etcd failed: nothing queued behind it was announced. A job
        goes back to its last written record and its agents reconnect."""
        if key == HOSTS_KEY:
            # The host change is in effect here but not in etcd (and the ones queued behind it
            # were dropped): stop serving and load the state again from etcd, so that nothing
            # stays in effect that the next leader would not know of. Agents reconnect.
            log.error(
                "cannot save host records to etcd: %s; reloading the state from etcd (agents reconnect)",
                printable(str(err), 300),
            )
            if self.replica is not None and self.serving:
                self.replica.reload("a host record could not be saved to etcd")
            return
        job = self.jobs.get(key)
        if not self.serving:
            return  # this replica stepped down (and forgot everything)
        if job is None:  # a removal (DELETE, retention) etcd did not apply: the job is back, to remove again
            self._unremove(key, err)
            return
        log.error(
            "job %s: cannot save state to etcd: %s; the change is refused, its agents reconnect",
            key,
            printable(str(err), 300),
        )
        text = self._committed.get(key)
        try:
            saved = rounds.from_record(json.loads(text)) if text is not None else None
        except Exception:
            saved = None
        self._put_back(job, saved)
        for chan in [self.channels.pop(k) for k in [k for k in self.channels if k[0] == key]]:
            chan.drop()

    def _unremove(self, job_id: str, err: BaseException) -> None:
        """A removed job whose key etcd still holds: put it back as last written
        (a DELETE's retry finds it; retention tries again in a minute), so that
        memory says what etcd and the next leader say."""
        text = self._committed.get(job_id)
        try:
            saved = rounds.from_record(json.loads(text)) if text is not None else None
        except Exception:
            saved = None
        if saved is None:
            return  # never written: nothing in etcd to remove
        log.error(
            "job %s: cannot remove it from etcd: %s; it stays (removal tried again)", job_id, printable(str(err), 300)
        )
        self._put_back(saved, saved)
        bisect.insort(self._order, (saved.created_at, job_id))
        if saved.finished:
            due = self.clock() - self.settings.retain_finished_s + 60.0
            heapq.heappush(self._ended, (due, job_id))

    def reply(self, job_id: str, chan: Channel, msg: BaseModel) -> None:
        """Answer one agent (an ack) after what its report caused is written."""
        text = msg.model_dump_json()
        if self.outbox is not None:
            self.outbox.publish(job_id, functools.partial(chan.deliver, text))
        else:
            chan.deliver(text)

    async def flushed(self, key: str) -> None:
        """Wait until what was queued for ``key`` (a job id, or HOSTS_KEY) is in etcd
        (at once without HA); raise UnavailableError (or NotLeaderError) if it is not."""
        if self.outbox is None:
            return
        try:
            await self.outbox.flushed(key)
        except NotLeaderError:
            raise
        except Exception as e:
            if self.replica is not None and not self.serving:  # stepped down meanwhile: clients go on to the leader
                raise self.replica.refusal() from e
            raise UnavailableError(
                f"the change could not be saved to etcd ({printable(str(e), 300)}); retry", ErrorCode.UNAVAILABLE
            ) from e

    async def stop(self) -> None:
        await cancel_and_wait(self._tick_task)
        for chan in list(self.channels.values()):
            chan.drop()
        self.channels.clear()
        if self.db:
            self.db.close()

    async def _run_ticks(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                self.tick()
            except Exception:  # a bug here must not stop the clock for every job
                log.exception("tick failed")

    def tick(self) -> None:
        """Visit only the jobs whose next deadline passed (a heap), so the cost
        does not grow with idle jobs; then remove finished jobs past retention.

        After a stall of the loop every node heard from since its last stall
        grace gets a full heartbeat timeout (rounds.grace): a silent node gets
        one such grace, not one per stall."""
        mono = time.monotonic()
        stalled = mono - self._last_tick > STALL_S
        self._last_tick = mono
        now = self.clock()
        if stalled:
            for job_id in self.active:  # deadlines only move later: the heap stays valid
                rounds.grace(self.jobs[job_id], now, stall=True)
            log.warning(
                "the server did not run for a while (stopped or starved); "
                "every node heard from since gets a full heartbeat timeout"
            )
        if self._unblock_at is not None and now >= self._unblock_at:
            self._unblock_at = self.hosts.next_unblock(now)
            self._hosts_changed(now)  # a cool-down or a cordon's ttl ended: its spares may be admitted
        due: list[str] = []
        while self._due and self._due[0][0] <= now:
            at, _, job_id = heapq.heappop(self._due)
            if self._due_at.get(job_id) == at:
                del self._due_at[job_id]
                due.append(job_id)
        for job_id in due:
            job = self.jobs.get(job_id)
            if job is None or job_id not in self.active:
                continue
            try:
                self._apply(job, rounds.tick(job, now), now)  # reschedules it
            except UnavailableError:
                pass  # a write failed: the job was put back as saved, and rescheduled
            except Exception:  # a bug here must not stop the clock for this job
                log.exception("tick of job %s failed", job_id)
                self._schedule(job)
        if len(self._due) > 2 * len(self._due_at) + 1024:  # stale entries: rebuild
            self._due = [(at, i, j) for i, (j, at) in enumerate(self._due_at.items())]
            heapq.heapify(self._due)
        self._expire(now)

    def _schedule(self, job: Job, also: float | None = None) -> None:
        """Queue the job for the tick at rounds.next_due. An entry already
        queued is at or before every node's deadline (those only move later,
        but for ``also``: a dropped connection's, or a join's after a failover's
        longer grace), so then only the job's own deadlines are looked at: O(1)
        per join or report, not O(nodes)."""
        queued = self._due_at.get(job.job_id)
        if queued is None:
            at = rounds.next_due(job)
        else:
            at = rounds.next_due(job, nodes=False)
            if at is not None and also is not None:
                at = min(at, also)
        if at is None:
            self._due_at.pop(job.job_id, None)
            return
        if at == float("inf") or (queued is not None and queued <= at):
            return
        self._seq += 1
        self._due_at[job.job_id] = at
        heapq.heappush(self._due, (at, self._seq, job.job_id))

    # ------------------------------------------------------------ agent side

    def join(self, msg: JoinMsg, chan: Channel) -> None:
        now = self.clock()
        job = self.jobs.get(msg.job_id)
        created = job is None
        if job is None:
            if msg.run is not None and self.durable:
                # every job an agent heard of is on disk: this one ended and was removed (or deleted)
                raise JobFinishedError(
                    f"job {msg.job_id!r} is not on this server any more (it ended and was removed or deleted); "
                    f"this agent belongs to its run {msg.run}"
                )
            if msg.resume_round is not None:
                raise EvictedError(f"job {msg.job_id!r} is unknown to this server; rejoin as a new node")
            self.room.check(self, msg.job_id, chan)
            job = rounds.new_job(msg.job_id, msg.spec, now, job_secret=msg.job_secret)
            if msg.run is not None:  # a memory-only server restarted: its agents bring the run back
                job.run = msg.run
            job.gate = self.hosts
        rerun = not created and rounds.starts_run(job, msg)  # a finished job id's next run
        ended = job.state.value if rerun else None  # the state the previous run ended in
        if rerun:  # only its owner may take its room: ownership first (nothing changes on a refusal)
            rounds.check_owner(job, msg)
            self.room.check(self, msg.job_id, chan)
        # a node this join creates gets a fresh secret; only its own connection hears it
        issued = None if msg.node_id in job.nodes else secrets.token_urlsafe(24)
        fx = rounds.join(job, msg, now, node_secret=issued)  # raises before changing anything
        node = job.nodes.get(msg.node_id)
        joined = None
        if issued is not None and node is not None:
            joined_as = "spare" if node.state == rounds.SPARE else "waiting"
            joined = (
                "node_joined",
                msg.node_id,
                # as it joined: waiting, or spare (a round it completed at once is the next event)
                {"host": node.host, "addr": node.addr, "nproc": node.local_world_size, "state": joined_as},
            )
        if rerun:
            self.active.add(job.job_id)
        if created:
            self.jobs[job.job_id] = job
            self.active.add(job.job_id)
            bisect.insort(self._order, (job.created_at, job.job_id))
            fx.persist = True
            fx.logs.insert(
                0,
                f"job {job.job_id} created: nnodes {msg.spec.min_nodes}:{msg.spec.max_nodes}, "
                f"max_restarts {msg.spec.max_restarts}" + (", with a job secret" if msg.job_secret is not None else ""),
            )
        key = (job.job_id, msg.node_id)
        old = self.channels.get(key)
        self.channels[key] = chan
        if old is not None and old is not chan:
            old.drop()
        if self.metrics:
            self.metrics.joins.labels(job.job_id).inc()
        self._apply(job, fx, now, created=created, requester=chan, event=joined, new_run=ended)
        if job.job_id in self._due_at:
            # its deadline is now + timeout: sooner than a failover's longer grace already queued
            self._schedule(job, also=now + job.spec.heartbeat_timeout_s)

    def heartbeat(
        self,
        job_id: str,
        node_id: str,
        step: int | None = None,
        rate: float | None = None,
        timings: tuple[RankTiming, ...] | None = None,
    ) -> None:
        job = self.jobs.get(job_id)
        if job is not None:
            now = self.clock()
            fx = rounds.heartbeat(job, node_id, now, step, rate, timings)
            if step is not None:
                self.progress_jobs.add(job_id)
            # stragglers flagged (or no longer, or kept): warnings; the round a
            # replacement opened (straggler_policy replace): its lines as every step's,
            # and all of them after the save (nothing is said of a refused step)
            events: list[str] = []
            warnings: list[str] = []
            for ln in fx.logs:
                (events if isinstance(ln, logs.Line) and ln.fields.get("event") else warnings).append(ln)
            if fx.persist or fx.sends or events:
                fx.logs = events
                self._apply(job, fx, now)
            for line in warnings:
                log.warning("%s", printable(line), extra=logs.extra(line))

    def since_progress(self) -> dict[str, float]:
        """Per job whose agents report progress: the most seconds any running
        member's step has not advanced (for /metrics)."""
        now, out = self.clock(), {}
        for job_id in list(self.progress_jobs):
            job = self.jobs.get(job_id)
            if job is None or job.finished:
                self.progress_jobs.discard(job_id)
                continue
            ages = [  # running members only: a spare (a replaced straggler) keeps its last step
                now - n.progress_at
                for n in job.nodes.values()
                if n.progress_at is not None and n.state == rounds.RUNNING
            ]
            out[job_id] = round(max(0.0, *ages), 3) if ages else 0.0
        return out

    def fail(self, job_id: str, node_id: str, round_no: int, failures: list[ExitRecord], give_up: bool = False) -> None:
        """A failure report; ``give_up``: the node's launcher stops for good (the job fails)."""
        job, now = self._job(job_id), self.clock()
        step = rounds.give_up if give_up else rounds.fail
        fx = step(job, node_id, round_no, failures, now)
        # an in-place "collective" echo that changed nothing is no failure of this node
        echo = not give_up and all(r.reason == "collective" for r in failures)
        if echo and not (fx.logs or fx.sends or fx.persist):
            self._apply(job, fx, now)
            return
        self._apply(job, fx, now, event=("node_failed", node_id, failure_fields(failures)))

    def succeed(self, job_id: str, node_id: str, round_no: int) -> None:
        job, now = self._job(job_id), self.clock()
        node = job.nodes.get(node_id)
        again = node is not None and node.state == rounds.SUCCEEDED and round_no == job.round  # a lost ack
        fx = rounds.succeed(job, node_id, round_no, now)
        self._apply(job, fx, now, event=None if again else ("node_succeeded", node_id, {}))

    def leave(self, job_id: str, node_id: str, reason: str, chan: Channel) -> None:
        job, now = self._job(job_id), self.clock()
        if self.channels.get((job_id, node_id)) is chan:
            del self.channels[(job_id, node_id)]
        gone = None if job.finished or node_id not in job.nodes else (node_id, f"left ({reason})")
        self._apply(job, rounds.leave(job, node_id, reason, now), now, lost=gone)

    def disconnected(self, job_id: str, node_id: str, chan: Channel) -> None:
        """A connection closed. Ignored if the node already has a newer one."""
        if self.channels.get((job_id, node_id)) is not chan:
            return
        del self.channels[(job_id, node_id)]
        job = self.jobs.get(job_id)
        if job is not None:
            now = self.clock()
            self._apply(job, rounds.disconnect(job, node_id, now, self.settings.disconnect_grace_s), now)
            node = job.nodes.get(node_id)
            if node is not None and node.lost_deadline is not None and job_id in self.active:
                self._schedule(job, also=node.lost_deadline)

    # ------------------------------------------------------------- REST side

    def _job(self, job_id: str) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            raise JobNotFoundError(f"no job {job_id!r} on this server")
        return job

    def view(self, job_id: str) -> JobView:
        return rounds.view(self._job(job_id), self.clock())

    def summaries(
        self, state: JobState | None = None, limit: int = 100, cursor: str | None = None
    ) -> tuple[list[JobSummary], str | None]:
        """One page of job summaries in creation order: (summaries, next_cursor).
        ``cursor`` is a ``next_cursor`` this server returned (opaque to clients)."""
        start = 0
        if cursor is not None:
            start = bisect.bisect_right(self._order, decode_cursor(cursor))
        out: list[JobSummary] = []
        i = start
        while i < len(self._order) and len(out) < limit:
            job = self.jobs[self._order[i][1]]
            if state is None or job.state == state:
                out.append(rounds.summary(job))
            i += 1
        more = i < len(self._order) and len(out) == limit
        return out, (encode_cursor(self._order[i - 1]) if more else None)

    def close_job(self, job_id: str) -> Job:
        job, now = self._job(job_id), self.clock()
        self._apply(job, rounds.close(job, now), now)
        return job

    def live_nodes(self) -> int:
        return sum(len(self.jobs[j].nodes) for j in self.active)

    # --------------------------------------------------------------- effects

    def _apply(
        self,
        job: Job,
        fx: Effects,
        now: float,
        created: bool = False,
        requester: Channel | None = None,
        event: tuple[str, str, dict[str, object]] | None = None,
        lost: tuple[str, str] | None = None,
        new_run: str | None = None,
    ) -> None:
        """``event`` (type, node id, fields): the join or report that caused the
        step; ``lost`` (node id, reason): a node that left; ``new_run``: the step
        started the job id's next run, the previous one ended in this state. For
        the event log (and the metrics: a new run's series move again)."""
        if fx.persist and self.db is not None:
            try:
                self.db.save(job, now)
            except sqlite3.Error as e:
                self._rollback(job, created, e, requester)
        publish = functools.partial(self._publish, job, fx, now, created, event, lost, new_run)
        if self.outbox is not None:  # HA: announced once etcd holds it (rdzv_server.outbox)
            if fx.persist:
                self.outbox.write(job.job_id, json.dumps(rounds.to_record(job), separators=(",", ":")))
            self.outbox.publish(job.job_id, publish)
        else:
            publish()
        if job.finished:
            if job.job_id in self.active:
                self.active.discard(job.job_id)
                self.waiting.discard(job.job_id)
                self._due_at.pop(job.job_id, None)
                heapq.heappush(self._ended, (job.ended_at or now, job.job_id))
        else:
            if job.forming:
                self.waiting.add(job.job_id)
            else:
                self.waiting.discard(job.job_id)
            self._schedule(job)
        for host, reason in fx.host_failures:
            self.host_failure(host, job.job_id, reason, now)

    def _publish(
        self,
        job: Job,
        fx: Effects,
        now: float,
        created: bool,
        event: tuple[str, str, dict[str, object]] | None,
        lost: tuple[str, str] | None,
        new_run: str | None,
    ) -> None:
        """What everyone may hear of a step once it is persisted: events, log
        lines, the agents' messages, dropped connections, metrics."""
        if self.jobs.get(job.job_id) is not job:
            return  # put back (a failed write) or forgotten (stepped down): never announced
        try:  # persisted: now it may be published
            self.events.observe(job, fx, now, node=event, lost=lost, created=created, new_run=new_run)
        except Exception:  # a bug here must not undo or block the step
            log.exception("job %s: deriving events failed", job.job_id)
        for line in fx.logs:
            log.info("%s", printable(line), extra=logs.extra(line))  # one event, one line, whatever a client sent
        texts: dict[int, str] = {}  # a broadcast (restart, done, status) is serialized once
        for node_id, msg in fx.sends:
            chan = self.channels.get((job.job_id, node_id))
            if chan is not None:
                text = texts.get(id(msg))
                if text is None:
                    text = texts[id(msg)] = msg.model_dump_json()
                chan.deliver(text)
        for node_id in fx.evicted:
            chan = self.channels.pop((job.job_id, node_id), None)
            if chan is not None:
                chan.drop()
        if job.finished:
            for key in [k for k in self.channels if k[0] == job.job_id]:
                self.channels.pop(key)  # their agents close after the done message
        if self.metrics:
            self.metrics.observe(job, fx)

    def _put_back(self, job: Job, saved: Job | None) -> None:
        """The job as last saved (None: never saved, so forgotten)."""
        if saved is None:
            self.jobs.pop(job.job_id, None)
            self.active.discard(job.job_id)
            self.waiting.discard(job.job_id)
            self._due_at.pop(job.job_id, None)
            self._unlist(job)
            return
        rounds.restored(saved, self.clock())
        saved.gate = self.hosts
        self.jobs[job.job_id] = saved
        if saved.finished:
            self.active.discard(saved.job_id)
            self.waiting.discard(saved.job_id)
        else:
            self.active.add(saved.job_id)
            if saved.forming:
                self.waiting.add(saved.job_id)
            else:
                self.waiting.discard(saved.job_id)
        self._due_at.pop(saved.job_id, None)
        if not saved.finished:
            self._schedule(saved)

    def _rollback(self, job: Job, created: bool, err: Exception, requester: Channel | None = None) -> None:
        """A write failed: nobody was told anything. Put the job back as it was
        saved, make its agents reconnect (they resume or rejoin), refuse.

        ``requester`` (a joining agent's channel) is told why before it is
        dropped: the error the caller raises would otherwise queue behind the
        drop and never be sent. Agents whose report caused the write are only
        dropped: they re-send the report when they reconnect."""
        log.error(
            "job %s: cannot save state to %s: %s; the change is refused",
            job.job_id,
            self.db.path if self.db else "?",
            err,
        )
        saved = None
        if not created and self.db is not None:
            try:
                row = self.db.conn.execute("SELECT record FROM jobs WHERE job_id=?", (job.job_id,)).fetchone()
                saved = rounds.from_record(json.loads(row[0])) if row else None
            except Exception:
                saved = None
        self._put_back(job, saved)
        error = UnavailableError(f"the server cannot save state ({err}); retry later", ErrorCode.UNAVAILABLE)
        if requester is not None:
            requester.deliver(ErrorMsg(code=error.code, message=error.message).model_dump_json())
        dropped = [self.channels.pop(k) for k in [k for k in self.channels if k[0] == job.job_id]]
        for chan in dropped:
            chan.drop()
        if requester is not None and all(chan is not requester for chan in dropped):
            requester.drop()
        raise error
