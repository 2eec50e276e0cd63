"""Jobs, their durable state, and who to tell: the only stateful async code.

The store owns every :class:`~rdzv_server.rounds.Job`, feeds events into the
pure state machine, and carries out the :class:`~rdzv_server.rounds.Effects`
in this order: write the job to disk (when the round changed), then, once the
write is durable, publish: the events (stream, log lines, metrics), then the
messages to the agents' channels. So nobody ever hears of a round that a crash
could forget.

Durability is a backend (:mod:`rdzv_server.storage`): SQLite in the data dir,
etcd for HA, or memory. A server started again over the same data dir (or a
new HA leader) gets every job back as it was and gives every node a full
heartbeat timeout to reconnect before anyone is evicted. If the state cannot
be read the server refuses to start; if a write fails (disk full, etcd
unreachable), the job goes back to its last written state (one put-back path,
:meth:`Store._write_failed`), its agents are told to reconnect, and a request
that caused it gets an ``unavailable`` error.

Nothing grows without bound: the tick visits only jobs whose next deadline
passed (a heap keyed by :func:`rounds.next_due`); finished jobs are removed
after ``retain_finished_s`` (or on request) from memory, disk and metrics; a
new job is refused (``unavailable``; its agent retries) while its address
holds its quota of waiting jobs, ``max_waiting_jobs`` jobs wait for nodes
held by connected nodes, or the data dir has less than ``min_free_disk``
bytes free (:mod:`rdzv_server.quotas`). Running jobs are never refused for space.
"""

from __future__ import annotations

import bisect
import functools
import logging
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from rdzv_common import logs
from rdzv_common.protocol import (
    ErrorCode,
    ErrorMsg,
    EvictedError,
    ExitRecord,
    JobFinishedError,
    JoinMsg,
    RankLag,
    RankTiming,
    UnavailableError,
    printable,
)

from . import rounds
from .database import Database, DataDirError  # noqa: F401  (DataDirError: re-exported)
from .due import Due
from .events import EventLog
from .gc_policy import GcHold
from .hosts import HostRecord, Hosts
from .pacing import Pacing
from .quotas import Room
from .rounds import Effects, Job
from .rounds.templates import Prepared
from .seen_addr import seen_addr
from .storage import Backend, EtcdBackend, MemoryBackend, SqliteBackend, WriteError
from .store_hosts import StoreHosts
from .store_reads import StoreReads
from .store_retention import StoreRetention
from .store_settings import DEFAULT_DISCONNECT_GRACE_S as DEFAULT_DISCONNECT_GRACE_S  # re-exported
from .store_settings import DEFAULT_MAX_WAITING_JOBS as DEFAULT_MAX_WAITING_JOBS  # re-exported
from .store_settings import FAILOVER_GRACE_S, reconnect_grace_s
from .store_settings import StoreSettings as StoreSettings  # re-exported
from .store_ticks import STALL_S as STALL_S  # re-exported
from .store_ticks import TICK_S, StoreTicks
from .suspicion import Suspicion

if TYPE_CHECKING:
    from pydantic import BaseModel

    from .ha import Replica
    from .metrics import Metrics

log = logging.getLogger(__name__)


class Channel(Protocol):
    """Where messages for one connected agent go (a WebSocket, in the app)."""

    def deliver(self, text: str) -> None:
        """Queue one serialized message (JSON text) for the agent."""

    def drop(self) -> None:
        """Close the connection so the agent reconnects."""


class Store:
    """Every job of one server. Methods are called from the event loop only.
    Its collaborators: the host records' side (cordon, health, cool-downs) is ``host_side``
    (:class:`~rdzv_server.store_hosts.StoreHosts`), removal of finished jobs ``retention``
    (:class:`~rdzv_server.store_retention.StoreRetention`), what REST reads ``reads``
    (:class:`~rdzv_server.store_reads.StoreReads`)."""

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
        # where jobs and host records outlive this process (rdzv_server.storage): memory
        # until open() (SQLite) or use_replica() (etcd) says otherwise
        self.backend: Backend = MemoryBackend()
        self.due = Due()  # active jobs by the next time a tick could change them (rdzv_server.due)
        self.order: list[tuple[float, str]] = []  # every job by (created_at, job_id): listing pages
        self.room = Room()  # the waiting-jobs cap, per address and in total (rdzv_server.quotas)
        self.hosts = Hosts(settings.host_rules)  # host records across jobs (rdzv_server.hosts)
        self.replica: Replica | None = None  # HA (--etcd, rdzv_server.ha): this replica's leadership
        self.host_side = StoreHosts(self)  # cordons, cool-downs, health reports; when the next block ends
        self.retention = StoreRetention(self)  # finished jobs by end time, removed past --retain-finished
        self.reads = StoreReads(self)  # what REST and /metrics read
        self.suspicion = Suspicion(self)  # peers' suspicions and the probes they cause (issue 23)
        self.ticks = StoreTicks(self)  # the tick loop (rdzv_server.store_ticks)
        self.pacing = Pacing(self, TICK_S)  # heartbeat intervals told, silences judged (rdzv_server.pacing)
        self.gc_hold = GcHold()  # young collections held in round changes (rdzv-server turns it on)

    @property
    def durable(self) -> bool:
        """Jobs outlive this process (SQLite or etcd)."""
        return self.backend.durable

    @property
    def db(self) -> Database | None:
        """The SQLite database (--data-dir), if that is the backend."""
        return self.backend.db if isinstance(self.backend, SqliteBackend) else None

    @property
    def serving(self) -> bool:
        """Not an HA replica, or its leader with the state loaded and the lease surely alive."""
        return self.replica is None or self.replica.serving

    @property
    def successor_url(self) -> str | None:
        """(HA leader) Where its agents go first when it goes (rdzv_server.ha_peers), or None."""
        return self.replica.successor_url if self.replica is not None else None

    # ------------------------------------------------------------ lifecycle

    def open(self) -> None:
        """Load durable state (raises DataDirError); call before serving."""
        if self.settings.data_dir is None:
            return
        db = Database(self.settings.data_dir)
        self.backend = SqliteBackend(db)
        self._loaded(db.load(), db.load_hosts(), str(db.path))

    def _loaded(self, jobs: dict[str, Job], hosts: list[HostRecord], where: str, extra_s: float = 0.0) -> None:
        """Serve ``jobs``: every node gets a full heartbeat timeout, plus
        ``extra_s`` and the reconnect storm's allowance for all their nodes, to reconnect."""
        self.jobs = jobs
        self.hosts.load(hosts)
        extra_s += reconnect_grace_s(sum(len(j.nodes) for j in jobs.values() if not j.finished))
        now = self.clock()
        self.host_side.rearm(now)
        for job in self.jobs.values():
            job.gate = self.hosts
            self.order.append((job.created_at, job.job_id))
            if not job.finished:
                rounds.restored(job, now, extra_s)
                self._place(job, now)
            else:
                self.retention.queue(job.ended_at or job.created_at, job.job_id)
        self.order.sort()
        if self.jobs:
            log.info(
                "loaded %d job(s) from %s (%d active); every node has %s to reconnect",
                len(self.jobs),
                where,
                len(self.active),
                "a full heartbeat timeout" + (f" + {extra_s:.3g}s" if extra_s else ""),
            )

    async def start(self) -> None:
        self.ticks.start()

    # ------------------------------------------------------- HA (--etcd)

    def use_replica(self, replica: Replica) -> None:
        """Keep state in etcd through ``replica`` (rdzv_server.ha): serve only while it leads."""
        self.replica = replica
        self.backend = EtcdBackend(replica, self._write_failed)
        replica.on_elected = self.become_leader
        replica.on_deposed = self.step_down
        self.gc_hold.may_pause = replica.may_pause  # the collector's valve never outlasts the lease

    async def become_leader(self) -> None:
        """Elected: load every job and host from etcd and serve them as a restarted server does."""
        assert self.replica is not None and isinstance(self.backend, EtcdBackend)
        jobs, hosts = await self.backend.load()
        if self.replica.role != "leader":
            return
        self.step_down("reloading", quiet=True)  # nothing may survive from an earlier term
        self.backend.loaded(jobs)
        self._loaded(jobs, hosts, f"etcd (term {self.replica.term})", FAILOVER_GRACE_S)
        await self.start()

    def step_down(self, reason: str, quiet: bool = False) -> None:
        """Not the leader any more: forget every job (the next leader has them in etcd),
        drop every agent connection (agents reconnect and find the leader)."""
        self.ticks.cancel()
        self.backend.drop_all()
        for chan in list(self.channels.values()):
            chan.drop()
        if not quiet and (self.jobs or self.channels):
            log.warning("dropped %d agent connection(s) and %d job(s): %s", len(self.channels), len(self.jobs), reason)
        self.channels.clear()
        if self.metrics:
            for job_id in self.jobs:
                self.metrics.forget(job_id)
        self.jobs = {}
        self.active.clear()
        self.waiting.clear()
        self.progress_jobs.clear()
        self.due, self.order = Due(), []
        self.retention.clear()
        self.hosts = Hosts(self.settings.host_rules)
        self.host_side.clear()
        self.events.close_all()
        self.suspicion.forget()
        self.pacing.forget()
        self.gc_hold.release()  # a follower does not tick: nothing else would put it back

    def _write_failed(self, job_id: str, err: BaseException, requester: Channel | None = None) -> None:
        """The one put-back path: a write of ``job_id`` failed (at once, SQLite; or
        later, etcd) and nothing queued behind it was announced. The job goes
        back to its last written record (none: forgotten), or a removal that did
        not happen is undone; its agents reconnect (they resume or rejoin, and
        re-send a report the write was for). ``requester`` (a joining agent's
        channel) is told why before it is dropped."""
        if not self.serving:
            return  # this replica stepped down (and forgot everything)
        job, saved = self.jobs.get(job_id), self.backend.last(job_id)
        if job is None:  # a removal (DELETE, retention) that did not happen: the job is back, to remove again
            self._unremove(job_id, saved, err)
            return
        log.error(
            "job %s: cannot save state to %s: %s; the change is refused, its agents reconnect",
            job_id,
            self.backend.where,
            printable(str(err), 300),
        )
        self._put_back(job, saved)
        if requester is not None:
            error = UnavailableError(f"the server cannot save state ({err}); retry later", ErrorCode.UNAVAILABLE)
            requester.deliver(ErrorMsg(code=error.code, message=error.message).model_dump_json())
        dropped = [self.channels.pop(k) for k in [k for k in self.channels if k[0] == job_id]]
        for chan in dropped:
            chan.drop()
        if requester is not None and all(chan is not requester for chan in dropped):
            requester.drop()

    def _unremove(self, job_id: str, saved: Job | None, err: BaseException) -> None:
        """A removed job whose record is still written: put it back as last written
        (a DELETE's retry finds it; retention tries again in a minute), so that
        memory says what storage and the next leader say."""
        if saved is None:
            return  # never written: nothing to remove
        log.error(
            "job %s: cannot remove it from %s: %s; it stays (removal tried again)",
            job_id,
            self.backend.where,
            printable(str(err), 300),
        )
        self._put_back(saved, saved)
        bisect.insort(self.order, (saved.created_at, job_id))
        if saved.finished:
            self.retention.queue(self.clock() - self.settings.retain_finished_s + 60.0, job_id)

    def reply(self, job_id: str, chan: Channel, msg: BaseModel) -> None:
        """Answer one agent (an ack) after what its report caused is written."""
        self.backend.after(job_id, functools.partial(chan.deliver, msg.model_dump_json()))

    async def flushed(self, key: str) -> None:
        """Wait until what was queued for ``key`` (a job id, or HOSTS_KEY) is in etcd
        (at once without HA); raise UnavailableError (or NotLeaderError) if it is not."""
        await self.backend.flushed(key)

    async def stop(self) -> None:
        await self.ticks.stop()
        self.gc_hold.release()
        for chan in list(self.channels.values()):
            chan.drop()
        self.channels.clear()
        self.backend.close()

    def tick(self, full: bool = True) -> None:
        """One tick now (rdzv_server.store_ticks: what the loop runs every TICK_S, or at a deadline)."""
        self.ticks.tick(full)

    # ------------------------------------------------------------ agent side

    def join(self, msg: JoinMsg, chan: Channel) -> None:
        self.gc_hold.busy()  # a join storm, a round change's rejoins, a failover's resumes
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
        if rerun:  # only its owner may take its room: ownership first (nothing changes on a refusal)
            rounds.check_owner(job, msg)
            self.room.check(self, msg.job_id, chan)
        if job.probe_seed is None:  # its rounds' probe keys (rounds.probe_addr.round_key); not saved
            job.probe_seed = secrets.token_bytes(16)
        # a node this join creates gets a fresh secret; only its own connection hears it
        issued = None if msg.node_id in job.nodes else secrets.token_urlsafe(24)
        job.heartbeat_s = self.pacing.interval(job)
        # raises before changing anything; peers probe the node where its connection came from
        fx = rounds.join(job, msg, now, node_secret=issued, seen_addr=seen_addr(chan, msg))
        self.pacing.told(job, msg.node_id, fx)
        if rerun:
            self.active.add(job.job_id)
        if created:
            self.jobs[job.job_id] = job
            self.active.add(job.job_id)
            bisect.insort(self.order, (job.created_at, job.job_id))
            fx = rounds.job_created(job).merge(fx)
        key = (job.job_id, msg.node_id)
        old = self.channels.get(key)
        self.channels[key] = chan
        if old is not None and old is not chan:
            old.drop()
        if self.metrics:
            self.metrics.joined(job.job_id)
        self._apply(job, fx, now, requester=chan)
        if job.job_id in self.due:
            # its deadline is now + timeout: sooner than a failover's longer grace already queued
            self.due.schedule(job, also=now + job.spec.heartbeat_timeout_s)

    def heartbeat(
        self,
        job_id: str,
        node_id: str,
        step: int | None = None,
        rate: float | None = None,
        timings: tuple[RankTiming, ...] | None = None,
        nccl_lag: tuple[RankLag, ...] | None = None,
    ) -> None:
        job = self.jobs.get(job_id)
        if job is not None:
            now = self.clock()
            self.pacing.heard(job_id, node_id)
            fx = rounds.heartbeat(job, node_id, now, step, rate, timings, nccl_lag)
            if step is not None:
                self.progress_jobs.add(job_id)
            # stragglers flagged (or no longer, or kept): notes, as warnings; the round a
            # replacement opened (straggler_policy replace) and a rank's flag (slow_ranks): its
            # events as every step's, a flag's failure counted against its host,
            # and all of them after the save (nothing is said of a refused step)
            warnings = [ln for ln in fx.logs if not (isinstance(ln, logs.Line) and ln.fields.get("event"))]
            if fx.persist or fx.sends or fx.events or fx.host_failures:
                fx.logs = [ev.line for ev in fx.events]
                self._apply(job, fx, now)
            for line in warnings:
                log.warning("%s", printable(line), extra=logs.extra(line))

    def fail(self, job_id: str, node_id: str, round_no: int, failures: list[ExitRecord], give_up: bool = False) -> None:
        """A failure report; ``give_up``: the node's launcher stops for good (the job fails)."""
        job, now = self.reads.job(job_id), self.clock()
        step = rounds.give_up if give_up else rounds.fail
        self._apply(job, step(job, node_id, round_no, failures, now), now)

    def succeed(self, job_id: str, node_id: str, round_no: int) -> None:
        job, now = self.reads.job(job_id), self.clock()
        self._apply(job, rounds.succeed(job, node_id, round_no, now), now)

    def leave(self, job_id: str, node_id: str, reason: str, chan: Channel) -> None:
        job, now = self.reads.job(job_id), self.clock()
        if self.channels.get((job_id, node_id)) is chan:
            del self.channels[(job_id, node_id)]
        self._apply(job, rounds.leave(job, node_id, reason, now), now)

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
                self.due.schedule(job, also=node.lost_deadline)

    # ------------------------------------------------------------- REST side

    def close_job(self, job_id: str) -> Job:
        job, now = self.reads.job(job_id), self.clock()
        self._apply(job, rounds.close(job, now), now)
        return job

    # --------------------------------------------------------------- effects

    def _apply(self, job: Job, fx: Effects, now: float, requester: Channel | None = None) -> None:
        """Carry out a step's effects: persist, then publish (:meth:`_publish`) once
        the write is durable (at once, or after etcd acknowledged it). A write
        that fails at once puts the job back and raises UnavailableError;
        ``requester``: the joining agent's channel, told why."""
        if fx.persist:
            try:
                self.backend.write_job(job, now)
            except WriteError as e:
                self._write_failed(job.job_id, e, requester)
                raise UnavailableError(f"the server cannot save state ({e}); retry later", ErrorCode.UNAVAILABLE) from e
        self.backend.after(job.job_id, functools.partial(self._publish, job, fx))
        self._place(job, now)
        for host, reason in fx.host_failures:
            self.host_side.host_failure(host, job.job_id, reason, now)

    def _publish(self, job: Job, fx: Effects) -> None:
        """What everyone may hear of a step once it is persisted: the step's
        events (the stream, and their lines in the log), log lines, the agents'
        messages, dropped connections, metrics."""
        if self.jobs.get(job.job_id) is not job:
            return  # put back (a failed write) or forgotten (stepped down): never announced
        try:  # persisted: now it may be published
            for ev in fx.events:
                self.events.emit(ev.kind, ev.job, ev.round, ev.node, ev.run, **ev.fields)
        except Exception:  # a bug here must not undo or block the step
            log.exception("job %s: publishing events failed", job.job_id)
        for line in fx.logs:
            log.info("%s", printable(line), extra=logs.extra(line))  # one event, one line, whatever a client sent
        texts: dict[int, str] = {}  # a broadcast (restart, done, status) is serialized once
        if len(fx.sends) > 1:
            self.gc_hold.busy()  # a round's fan-out
        for node_id, msg in fx.sends:
            chan = self.channels.get((job.job_id, node_id))
            if chan is not None:
                if isinstance(msg, Prepared):
                    chan.deliver(msg.text)
                    continue
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
            self.due.discard(job.job_id)
            self.retention.unlist(job)
            return
        now = self.clock()
        rounds.restored(saved, now)
        saved.gate = self.hosts
        self.jobs[job.job_id] = saved
        self.due.discard(saved.job_id)  # due again as saved
        if saved.finished:
            self.active.discard(saved.job_id)  # (queued for retention when it first ended)
        self._place(saved, now)

    def _place(self, job: Job, now: float) -> None:
        """List the job where it is now: active (waiting while its round forms)
        and due for the tick; once finished, out of those and, if it just
        ended, queued for retention."""
        j = job.job_id
        if job.finished:
            if j in self.active:
                self.retention.queue(job.ended_at or now, j)
            self.active.discard(j)
            self.waiting.discard(j)
            self.due.discard(j)
            return
        self.active.add(j)
        if job.forming:
            self.waiting.add(j)
        else:
            self.waiting.discard(j)
        self.due.schedule(job)
