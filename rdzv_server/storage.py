"""Where the store's state outlives the process: one small seam, three backends.

The store (:mod:`rdzv_server.store`) changes a job in memory, asks its backend
to write the job's record (or its removal, or host records), and hands it what
may be published only once that write is durable (:meth:`Backend.after`). A
write that fails puts the job back as :meth:`Backend.last` says it was last
written (one put-back path, in the store), whether the failure is known at once
or later:

* :class:`SqliteBackend` (``--data-dir``): durable at once (WAL, synchronous
  FULL, :mod:`rdzv_server.database`); a failed write raises
  :class:`WriteError` to the step that made it, so nothing is published;
* :class:`EtcdBackend` (``--etcd``, :mod:`rdzv_server.ha`): writes queue in
  the :class:`~rdzv_server.outbox.Outbox` (ordered per key, coalesced, off
  the event loop) and what waits for them runs after etcd acknowledged them;
  a failed write calls the store back (``failed``) with the job's key;
* :class:`MemoryBackend` (no data dir, ``--standalone``, unit tests): nothing
  outlives the process, so every write is "durable" at once and never fails.

The three answer the same calls; the store has no branch on which it has.
SQLite and etcd keep a job the same way (:mod:`rdzv_server.joblog`): a base
and deltas, so that a write costs what changed since the last one.
Loading is each medium's own, when it may happen: SQLite when the server
opens its data dir (:meth:`Store.open`, before serving), etcd when a replica
is elected (:meth:`EtcdBackend.load`, awaited); the store serves what they
return the same way (``Store._loaded``).
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from rdzv_common.protocol import ErrorCode, NotLeaderError, UnavailableError, printable

from . import joblog, rounds

if TYPE_CHECKING:
    from .database import Database
    from .ha import Replica
    from .hosts import HostRecord
    from .rounds import Job

log = logging.getLogger("rdzv_server.store")  # the store's log: its lines read as before the seam

HOSTS_KEY = "\0hosts"  # the key of host records (flushed, outbox queues); never a job id


class WriteError(Exception):
    """A write failed at once (SQLite): nothing was written, nobody may be told."""


def record_text(job: Job) -> str:
    """A job's record as the backends store it (compact JSON)."""
    return json.dumps(rounds.to_record(job), separators=(",", ":"))


def decode(text: str | None) -> Job | None:
    """A job from its stored record; None when there is none or it cannot be read."""
    if text is None:
        return None
    try:
        return rounds.from_record(json.loads(text))
    except Exception:
        return None


class Backend(Protocol):
    """What the store needs of durable storage (its methods run on the event loop)."""

    @property
    def durable(self) -> bool:
        """Jobs outlive this process."""

    @property
    def where(self) -> str:
        """Where writes go, for log lines."""

    @property
    def requests(self) -> int:
        """Write requests sent to the medium so far (SQLite or etcd transactions; /metrics)."""

    def write_job(self, job: Job, now: float) -> None:
        """Write the job's record. Raises WriteError when that fails at once."""

    def remove_jobs(self, job_ids: list[str]) -> None:
        """Remove jobs' records (together). Raises WriteError when that fails at once."""

    def write_hosts(self, records: list[HostRecord], removed: list[str]) -> None:
        """Write changed host records and remove ``removed``; a failure is the backend's to report."""

    def after(self, key: str, fn: Callable[[], None]) -> None:
        """Run ``fn`` once everything written for ``key`` so far is durable (at once if it is)."""

    def last(self, job_id: str) -> Job | None:
        """The job as last durably written (None: never, or removed)."""

    async def flushed(self, key: str) -> None:
        """Wait until what was written for ``key`` is durable; raise UnavailableError
        (or NotLeaderError) if it is not."""

    def drop_all(self) -> None:
        """Forget every queued write (nothing waiting for them runs): a replica that stops leading."""

    def close(self) -> None: ...


class _AtOnce:
    """A backend whose writes are durable when they return: what waits for them runs at once."""

    def after(self, key: str, fn: Callable[[], None]) -> None:
        fn()

    async def flushed(self, key: str) -> None:
        return None

    def drop_all(self) -> None:
        pass


class MemoryBackend(_AtOnce):
    """Nothing outlives the process: every write is durable at once and never fails."""

    durable = False
    where = "memory"
    requests = 0

    def write_job(self, job: Job, now: float) -> None:
        pass

    def remove_jobs(self, job_ids: list[str]) -> None:
        pass

    def write_hosts(self, records: list[HostRecord], removed: list[str]) -> None:
        pass

    def last(self, job_id: str) -> Job | None:
        return None

    def close(self) -> None:
        pass


class SqliteBackend(_AtOnce):
    """The data dir's SQLite file: a write is durable when it returns."""

    durable = True

    def __init__(self, db: Database) -> None:
        self.db = db
        self.where = str(db.path)
        self.requests = 0

    def write_job(self, job: Job, now: float) -> None:
        self.requests += 1
        try:
            self.db.save(job, now)
        except sqlite3.Error as e:
            raise WriteError(str(e)) from e

    def remove_jobs(self, job_ids: list[str]) -> None:
        self.requests += 1
        try:
            self.db.delete(job_ids)
        except sqlite3.Error as e:
            raise WriteError(str(e)) from e

    def write_hosts(self, records: list[HostRecord], removed: list[str]) -> None:
        self.requests += 1
        try:
            self.db.save_hosts(records, removed)
        except sqlite3.Error as e:  # in effect in memory; the next write of the host saves it
            log.error(
                "cannot save host record(s) %s to %s: %s", ", ".join(printable(r.host) for r in records), self.where, e
            )

    def last(self, job_id: str) -> Job | None:
        return self.db.last(job_id)

    def close(self) -> None:
        self.db.close()


class EtcdBackend:
    """etcd through an HA replica (:mod:`rdzv_server.ha`): writes queue in the
    outbox and what waits for them runs after etcd acknowledged them. A job
    write that fails calls ``failed(job_id, error)``; a host write that fails
    makes the replica reload the whole state from etcd."""

    durable = True
    where = "etcd"

    def __init__(self, replica: Replica, failed: Callable[[str, BaseException], None]) -> None:
        from .outbox import Outbox

        self.replica = replica
        self.outbox = Outbox(self._write, self._failed)
        self.failed = failed
        self.committed: dict[str, joblog.Written] = {}  # each job as etcd last acknowledged it
        self._read: dict[str, joblog.Written] = {}  # what the last load read, until loaded()
        self._taken: dict[str, joblog.Snapshot] = {}  # each job's newest snapshot (queued): rows to reuse
        self.written_rows = self.written_chars = 0  # node rows and characters written, for benches

    @property
    def requests(self) -> int:
        return self.replica.requests

    async def load(self) -> tuple[dict[str, Job], list[HostRecord]]:
        """Every job and host record in etcd (raises ha.StateError on a foreign record)."""
        found, hosts = await self.replica.load()
        self._read = {j: written for j, (_, written) in found.items()}
        return {j: job for j, (job, _) in found.items()}, hosts

    def loaded(self, jobs: dict[str, Job]) -> None:
        """The store serves ``jobs`` as loaded: they are what etcd last acknowledged."""
        self.committed = {j: self._read[j] for j in jobs}
        self._read = {}

    def write_job(self, job: Job, now: float) -> None:
        written = self.committed.get(job.job_id)
        memo = self._taken.get(job.job_id) or (written.snap if written is not None else None)
        snap = self._taken[job.job_id] = joblog.snapshot(job, now, memo)
        self.outbox.write(job.job_id, snap)  # (the newest queued is written: a delta from what etcd holds then)

    def remove_jobs(self, job_ids: list[str]) -> None:
        for job_id in job_ids:  # each queued behind its job's writes
            self._taken.pop(job_id, None)
            self.outbox.write(job_id, None)

    def write_hosts(self, records: list[HostRecord], removed: list[str]) -> None:
        self.outbox.write(HOSTS_KEY, self.replica.host_ops(records, removed), coalesce=False)

    def after(self, key: str, fn: Callable[[], None]) -> None:
        self.outbox.publish(key, fn)

    def last(self, job_id: str) -> Job | None:
        written = self.committed.get(job_id)
        return None if written is None else joblog.to_job(written.snap)

    async def flushed(self, key: str) -> None:
        try:
            await self.outbox.flushed(key)
        except NotLeaderError:
            raise
        except Exception as e:
            if not self.replica.serving:  # stepped down meanwhile: clients go on to the leader
                raise self.replica.refusal() from e
            raise UnavailableError(
                f"the change could not be saved to etcd ({printable(str(e), 300)}); retry", ErrorCode.UNAVAILABLE
            ) from e

    def drop_all(self) -> None:
        self.outbox.drop_all()
        self.committed, self._taken = {}, {}

    def close(self) -> None:
        pass

    async def _write(self, key: str, payload: object) -> None:
        if key == HOSTS_KEY:
            await self.replica.write(payload)  # type: ignore[arg-type]  # host ops
            return
        if payload is None:
            await self.replica.write(self.replica.job_ops(key, None))
            self.committed.pop(key, None)
            return
        assert isinstance(payload, joblog.Snapshot)
        plan = joblog.plan(self.committed.get(key), payload)
        await self.replica.write(self.replica.job_ops(key, plan))
        self.committed[key] = plan.written
        self.written_rows += plan.nodes
        self.written_chars += plan.chars

    def _failed(self, key: str, err: BaseException) -> None:
        if key != HOSTS_KEY:
            self.failed(key, err)
            return
        # The host change is in effect here but not in etcd (and the ones queued behind it
        # were dropped): stop serving and load the state again from etcd, so that nothing
        # stays in effect that the next leader would not know of. Agents reconnect.
        log.error(
            "cannot save host records to etcd: %s; reloading the state from etcd (agents reconnect)",
            printable(str(err), 300),
        )
        if self.replica.serving:
            self.replica.reload("a host record could not be saved to etcd")
