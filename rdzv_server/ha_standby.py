"""The state read from etcd (:func:`load`), and the successor's copy of it,
read before it is elected (:class:`Standby`: a warm standby).

A new leader loads every job and host before it serves; at 16,384 nodes that
was ~0.45 s of a leader kill (the read of ~3 MB through the JSON gateway, the
jobs built: bench/big_job ``--etcd``), while every agent waited. The successor
(rdzv_server.ha_peers) keeps a copy instead: every ``CHECK_S`` it reads the
*marks* of the state, for each of ``jobs/`` and ``hosts/`` the highest mod
revision and the number of keys, and when they changed and then held still
for a check, loads the whole state at the revision the marks were read at.
Elected, it reads the marks again: the same marks mean no job pointer or host
record was put (a put raises the highest mod revision) or deleted (a delete
lowers the count, unless a put came with it) since the copy's revision, so
the copy is what a load would read now, and it serves it; otherwise it loads
as before. ``jobdata/`` needs no mark: a job's blobs are named by its pointer,
which a write puts after them (rdzv_server.etcd_jobs), and the blobs a pointer
names are never written again while it names them (a write's generation is
always new; a failed write's blobs are named by no pointer). A sorted range
makes etcd read every key of it: a check costs etcd a read of the job pointers
(one per job kept) and host records, not of the jobs' data. The load runs in a
task of its own (an election does not wait for it: it is cancelled). A replica
that is not the successor keeps no copy. Reads only: a copy that cannot be
read (etcd away, a record that is not rdzv's) is simply not kept.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from dataclasses import dataclass

from rdzv_common.tasks import cancel_and_wait
from rdzv_common.wire import printable

from . import etcd, etcd_jobs, joblog
from .etcd_jobs import StateError
from .hosts import HostRecord
from .rounds import Job

log = logging.getLogger("rdzv_server.ha")

CHECK_S = 1.0  # how often the successor compares its copy with etcd's marks
MARKED = (b"jobs/", b"hosts/")  # under the prefix: the key ranges whose marks date the state

State = tuple[dict[str, tuple[Job, joblog.Written]], list[HostRecord]]
Marks = tuple[tuple[int, int], ...]  # per key range of MARKED: (highest mod revision, keys)


async def load(client: etcd.EtcdClient, prefix: bytes, revision: int = 0) -> State:
    """Every job (and what etcd holds of it) and host record under ``prefix``, all
    read at ``revision`` (0: the newest, pinned by a first small read); raises
    StateError on a foreign record."""
    revision = revision or await client.revision(prefix + b"leader")
    jobs = await etcd_jobs.load(client, prefix, revision)
    hosts: list[HostRecord] = []
    kvs, _ = await client.range_prefix(prefix + b"hosts/", revision)
    for kv in kvs:
        try:
            hosts.append(HostRecord.from_record(json.loads(kv.value)["record"]))
        except Exception as e:
            raise StateError(f"etcd key {printable(kv.key.decode('utf-8', 'replace'))}: not a host ({e!r})") from e
    return jobs, hosts


async def marks(client: etcd.EtcdClient, prefix: bytes) -> tuple[int, Marks]:
    """(the revision read at, the marks of the state's key ranges at it)."""
    revision, out = 0, []
    for part in MARKED:
        read, mod, count = await client.newest(prefix + part, revision)
        revision = revision or read
        out.append((mod, count))
    return revision, tuple(out)


@dataclass
class Copy:
    marks: Marks
    revision: int
    state: State


class Standby:
    """One replica's copy of the state (kept only while it is the successor)."""

    def __init__(self, client: etcd.EtcdClient, prefix: bytes) -> None:
        self.client, self.prefix = client, prefix
        self.copy: Copy | None = None
        self._seen: Marks | None = None  # the marks of the last check (a copy is read once they hold still)
        self._checked_at = -math.inf
        self._loading: asyncio.Task[None] | None = None  # a copy being read
        self.used = 0  # elections served from the copy (for tests and benches)

    def drop(self) -> None:
        self.copy, self._seen = None, None
        if self._loading is not None:
            self._loading.cancel()
            self._loading = None

    async def keep(self, successor: bool, now: float) -> None:
        """(follower, every poll) As the successor, bring the copy up to date when due
        (the read itself in a task: the caller's polls go on meanwhile)."""
        if not successor:
            self.drop()
            return
        if now - self._checked_at < CHECK_S or (self._loading is not None and not self._loading.done()):
            return
        self._checked_at = now
        revision, found = await marks(self.client, self.prefix)
        if self.copy is not None and self.copy.marks == found:
            return
        steady, self._seen = self._seen == found, found
        if steady:  # (changing now, a formation, a storm: read it once it holds still)
            self._loading = asyncio.create_task(self._read(found, revision), name="rdzv-ha-standby")

    async def _read(self, found: Marks, revision: int) -> None:
        try:
            state = await load(self.client, self.prefix, revision)
        except (StateError, etcd.EtcdError) as e:  # the elected replica's load says it; no copy meanwhile
            log.debug("standby: %s", e)
            self.copy = None
            return
        except Exception:  # a bug here must not go unsaid (nobody awaits this task)
            log.exception("standby: reading a copy of the state failed")
            self.copy = None
            return
        self.copy = Copy(found, revision, state)
        log.info("standby: copied the state at etcd revision %d (%d job(s))", revision, len(state[0]))

    async def take(self) -> State | None:
        """(just elected) The copy if it is what etcd holds now, else None; either way it is gone
        (a read in progress is cancelled)."""
        copy = self.copy
        loading, self._loading = self._loading, None
        await cancel_and_wait(loading)
        self.copy, self._seen = None, None
        if copy is None:
            return None
        _, now = await marks(self.client, self.prefix)
        if now != copy.marks:
            return None
        self.used += 1
        return copy.state
