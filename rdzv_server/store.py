"""Jobs, their durable state, and who to tell: the only stateful async code.

The store owns every :class:`~rdzv_server.rounds.Job`, feeds events into the
pure state machine, and carries out the :class:`~rdzv_server.rounds.Effects`
in this order: write the job to disk (when the round changed), then deliver
messages to the agents' channels, then log. So nobody ever hears of a round
that a crash could forget.

Durability is a SQLite database (``<data dir>/rdzv.db``, WAL, synchronous
FULL); one row per job holding its state as JSON. A server started again over
the same data dir gets every job back as it was and gives every node a full
heartbeat timeout to reconnect before anyone is evicted. If the database is
unreadable the server refuses to start; if a write fails (disk full), the job
goes back to its last saved state, its agents are told to reconnect, and the
request that caused it gets an ``unavailable`` error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from . import rounds
from .protocol import (
    ErrorCode,
    ErrorMsg,
    EvictedError,
    ExitRecord,
    JobNotFoundError,
    JoinMsg,
    RdzvError,
    UnavailableError,
    printable,
)
from .rounds import Effects, Job

log = logging.getLogger(__name__)

TICK_S = 0.1
STALL_S = 1.5  # a loop that slept this long was stopped or starved: be lenient


class Channel(Protocol):
    """Where messages for one connected agent go (a WebSocket, in the app)."""

    def deliver(self, text: str) -> None:
        """Queue one serialized message (JSON text) for the agent."""

    def drop(self) -> None:
        """Close the connection so the agent reconnects."""


class DataDirError(RdzvError):
    """The data directory or its database cannot be used; the server must not start."""


@dataclass
class StoreSettings:
    data_dir: Path | None = None  # None: memory only (embedded/standalone server)
    disconnect_grace_s: float = 0.5


_SQLITE_CORRUPT, _SQLITE_NOTADB = 11, 26  # primary result codes that mean a damaged or foreign file


def _is_corruption(e: sqlite3.DatabaseError) -> bool:
    code = getattr(e, "sqlite_errorcode", None)  # Python 3.11+
    if code is not None:
        return code & 0xFF in (_SQLITE_CORRUPT, _SQLITE_NOTADB)
    text = str(e).lower()
    return "not a database" in text or "malformed" in text


def _free_space(path: Path) -> str:
    try:
        st = os.statvfs(path)
    except OSError:
        return "free space unknown"
    return f"{st.f_bavail * st.f_frsize} bytes free"


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


class Database:
    """One table, one JSON row per job. Synchronous: writes are small and rare
    (once per round change), and must finish before anyone is told."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / "rdzv.db"
        try:
            data_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DataDirError(f"cannot create data dir {data_dir}: {e.strerror or e}") from e
        if not os.access(data_dir, os.W_OK | os.X_OK):
            if _read_only(data_dir):
                raise DataDirError(f"data dir {data_dir} is on a read-only file system")
            raise DataDirError(f"data dir {data_dir} is not writable by this user (uid {os.getuid()})")
        existed = self.path.exists()
        self.conn = None
        try:
            self.conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=FULL")
            ok = self.conn.execute("PRAGMA quick_check").fetchone()[0]
            if ok != "ok":
                raise DataDirError(f"database {self.path} is corrupt ({ok}); move it away to start empty")
            self.conn.execute(
                "CREATE TABLE IF NOT EXISTS jobs (job_id TEXT PRIMARY KEY, record TEXT NOT NULL, updated_at REAL NOT NULL)"
            )
        except (sqlite3.DatabaseError, DataDirError) as e:
            if self.conn is not None:
                self.conn.close()
            if isinstance(e, DataDirError):
                raise
            if existed and not _is_corruption(e):
                # A full, read-only or failing file system: the file may be fine.
                # Never tell the operator to throw away a database that holds jobs.
                raise DataDirError(
                    f"cannot open database {self.path} ({e}): the file system refused "
                    f"({_free_space(data_dir)}); is it full or read-only? Fix that and start again; "
                    "keep the file, it holds the jobs' state"
                ) from e
            raise DataDirError(
                f"cannot open database {self.path} ({e}); "
                + ("it exists but is unreadable or corrupt: move it away to start empty, or restore a backup"
                   if existed else "check the data dir")
            ) from e

    def load(self) -> dict[str, Job]:
        jobs = {}
        try:
            rows = self.conn.execute("SELECT job_id, record FROM jobs").fetchall()
        except sqlite3.DatabaseError as e:
            raise DataDirError(f"cannot read database {self.path}: {e}") from e
        for job_id, record in rows:
            try:
                jobs[job_id] = rounds.from_record(json.loads(record))
            except Exception as e:  # any shape error means the file is not ours or damaged
                raise DataDirError(f"database {self.path}: job {job_id!r} cannot be loaded ({e!r})") from e
        return jobs

    def save(self, job: Job, now: float) -> None:
        record = json.dumps(rounds.to_record(job), separators=(",", ":"))
        self.conn.execute(
            "INSERT INTO jobs (job_id, record, updated_at) VALUES (?, ?, ?) "
            "ON CONFLICT(job_id) DO UPDATE SET record=excluded.record, updated_at=excluded.updated_at",
            (job.job_id, record, now),
        )

    def close(self) -> None:
        self.conn.close()


class Store:
    """Every job of one server. Methods are called from the event loop only."""

    def __init__(self, settings: StoreSettings, clock: Callable[[], float] = time.time, metrics=None) -> None:
        self.settings = settings
        self.clock = clock
        self.metrics = metrics
        self.jobs: dict[str, Job] = {}
        self.active: set[str] = set()
        self.channels: dict[tuple[str, str], Channel] = {}
        self.db: Database | None = None
        self._tick_task: asyncio.Task | None = None
        self._last_tick = time.monotonic()

    # ------------------------------------------------------------ lifecycle

    def open(self) -> None:
        """Load durable state (raises DataDirError); call before serving."""
        if self.settings.data_dir is None:
            return
        self.db = Database(self.settings.data_dir)
        self.jobs = self.db.load()
        now = self.clock()
        for job in self.jobs.values():
            if not job.finished:
                rounds.restored(job, now)
                self.active.add(job.job_id)
        if self.jobs:
            log.info("loaded %d job(s) from %s (%d active); every node has %s to reconnect",
                     len(self.jobs), self.db.path, len(self.active), "a full heartbeat timeout")

    async def start(self) -> None:
        self._last_tick = time.monotonic()
        self._tick_task = asyncio.create_task(self._run_ticks(), name="rdzv-tick")

    async def stop(self) -> None:
        if self._tick_task:
            self._tick_task.cancel()
            try:
                await self._tick_task
            except asyncio.CancelledError:
                pass
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
        mono = time.monotonic()
        stalled = mono - self._last_tick > STALL_S
        self._last_tick = mono
        now = self.clock()
        for job_id in list(self.active):
            job = self.jobs[job_id]
            if stalled:
                rounds.grace(job, now)
                continue
            self._apply(job, rounds.tick(job, now), now)
        if stalled:
            log.warning("the server did not run for a while (stopped or starved); "
                        "every node gets a full heartbeat timeout")

    # ------------------------------------------------------------ agent side

    def join(self, msg: JoinMsg, chan: Channel) -> None:
        now = self.clock()
        job = self.jobs.get(msg.job_id)
        created = job is None
        if created:
            if msg.resume_round is not None:
                raise EvictedError(f"job {msg.job_id!r} is unknown to this server; rejoin as a new node")
            job = rounds.new_job(msg.job_id, msg.spec, now, job_secret=msg.job_secret)
        # a node this join creates gets a fresh secret; only its own connection hears it
        issued = None if msg.node_id in job.nodes else secrets.token_urlsafe(24)
        fx = rounds.join(job, msg, now, node_secret=issued)  # raises before changing anything
        if created:
            self.jobs[job.job_id] = job
            self.active.add(job.job_id)
            fx.persist = True
            fx.logs.insert(0, f"job {job.job_id} created: nnodes {msg.spec.min_nodes}:{msg.spec.max_nodes}, "
                              f"max_restarts {msg.spec.max_restarts}"
                              + (", with a job secret" if msg.job_secret is not None else ""))
        key = (job.job_id, msg.node_id)
        old = self.channels.get(key)
        self.channels[key] = chan
        if old is not None and old is not chan:
            old.drop()
        if self.metrics:
            self.metrics.joins.labels(job.job_id).inc()
        self._apply(job, fx, now, created=created, requester=chan)

    def heartbeat(self, job_id: str, node_id: str) -> None:
        job = self.jobs.get(job_id)
        if job is not None:
            rounds.heartbeat(job, node_id, self.clock())

    def fail(self, job_id: str, node_id: str, round_no: int, failures: list[ExitRecord]) -> None:
        job, now = self._job(job_id), self.clock()
        self._apply(job, rounds.fail(job, node_id, round_no, failures, now), now)

    def succeed(self, job_id: str, node_id: str, round_no: int) -> None:
        job, now = self._job(job_id), self.clock()
        self._apply(job, rounds.succeed(job, node_id, round_no, now), now)

    def leave(self, job_id: str, node_id: str, reason: str, chan: Channel) -> None:
        job, now = self._job(job_id), self.clock()
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

    # ------------------------------------------------------------- REST side

    def _job(self, job_id: str) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            raise JobNotFoundError(f"no job {job_id!r} on this server")
        return job

    def view(self, job_id: str):
        return rounds.view(self._job(job_id), self.clock())

    def summaries(self):
        return [rounds.summary(j) for j in sorted(self.jobs.values(), key=lambda j: j.created_at)]

    def close_job(self, job_id: str) -> Job:
        job, now = self._job(job_id), self.clock()
        self._apply(job, rounds.close(job, now), now)
        return job

    def live_nodes(self) -> int:
        return sum(len(self.jobs[j].nodes) for j in self.active)

    # --------------------------------------------------------------- effects

    def _apply(self, job: Job, fx: Effects, now: float, created: bool = False,
               requester: Channel | None = None) -> None:
        if fx.persist and self.db is not None:
            try:
                self.db.save(job, now)
            except sqlite3.Error as e:
                self._rollback(job, created, e, requester)
        for line in fx.logs:
            log.info("%s", printable(line))  # one event, one line, whatever a client sent
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
            self.active.discard(job.job_id)
            for key in [k for k in self.channels if k[0] == job.job_id]:
                self.channels.pop(key)  # their agents close after the done message
        if self.metrics:
            self.metrics.observe(job, fx)

    def _rollback(self, job: Job, created: bool, err: Exception, requester: Channel | None = None) -> None:
        """A write failed: nobody was told anything. Put the job back as it was
        saved, make its agents reconnect (they resume or rejoin), refuse.

        ``requester`` (a joining agent's channel) is told why before it is
        dropped: the error the caller raises would otherwise queue behind the
        drop and never be sent. Agents whose report caused the write are only
        dropped: they re-send the report when they reconnect."""
        log.error("job %s: cannot save state to %s: %s; the change is refused", job.job_id,
                  self.db.path if self.db else "?", err)
        saved = None
        if not created and self.db is not None:
            try:
                row = self.db.conn.execute("SELECT record FROM jobs WHERE job_id=?", (job.job_id,)).fetchone()
                saved = rounds.from_record(json.loads(row[0])) if row else None
            except Exception:
                saved = None
        if saved is None:
            self.jobs.pop(job.job_id, None)
            self.active.discard(job.job_id)
        else:
            rounds.restored(saved, self.clock())
            self.jobs[job.job_id] = saved
        error = UnavailableError(f"the server cannot save state ({err}); retry later", ErrorCode.UNAVAILABLE)
        if requester is not None:
            requester.deliver(ErrorMsg(code=error.code, message=error.message).model_dump_json())
        dropped = [self.channels.pop(k) for k in [k for k in self.channels if k[0] == job.job_id]]
        for chan in dropped:
            chan.drop()
        if requester is not None and all(chan is not requester for chan in dropped):
            requester.drop()
        raise error
