"""Per-client quotas: what one client address may hold or send, so that no
single client can exhaust a cap that every client shares.

* **Waiting jobs** (:class:`Room`): a new job (or a finished id's next run)
  is refused while ``max_waiting_jobs`` jobs wait for nodes, as before, but
  the cap is no lever any more: a job counts against its creator's address
  only while some node of it is connected (``--max-waiting-jobs-per-address``),
  and when the cap is full a waiting job that no connected node holds (every
  node left or dropped) is closed to make room (:func:`rounds.reclaim`;
  one with no node left first, then the newest). So one address can hold at most its quota of
  jobs; the rest of the table is either held by others or reclaimable.
* **Health reports** (:class:`AddressBuckets`): ``POST /v1/hosts/{host}/health``
  per address through a token bucket (429 ``rate_limited`` beyond it).
* **Frames on an agent connection** (:class:`TokenBucket`, one per
  connection, :mod:`rdzv_server.handlers`): beyond the bucket the connection
  is closed.

Connections per address are counted where connections are accepted
(:mod:`rdzv_server.conns`). Everything here is bounded: the tables hold at
most a fixed number of addresses.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

from rdzv_common.protocol import ErrorCode, ErrorMsg, UnavailableError, printable

from . import rounds
from .conns import LogLimiter
from .database import free_bytes

if TYPE_CHECKING:
    from .store import Channel, Store

log = logging.getLogger("rdzv_server.store")  # refusals of new jobs: the store's log, as before

DEFAULT_WAITING_JOBS_PER_ADDRESS = 100  # held waiting jobs one address may create (--max-waiting-jobs-per-address)
# Health reports per client address: a burst, then one per HEALTH_REPORT_EVERY_S. A real agent
# reports once per failed check, with backoff (1 s doubling to 30 s): a rack behind one address
# fits in the burst.
HEALTH_REPORT_BURST = 30
HEALTH_REPORT_EVERY_S = 2.0
MAX_TRACKED_ADDRS = 10_000  # addresses a rate table keeps (the least recently used go first)
# Frames one agent connection may send: a burst, then FRAME_RATE per second. A real agent sends a
# heartbeat every 2 s at most (wire.heartbeat_every; with progress, one more per interval): far below.
FRAME_BURST = 200
FRAME_RATE = 50.0


class TokenBucket:
    """``burst`` tokens, refilled at ``rate`` per second; :meth:`take` spends one."""

    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, burst: float, rate: float, now: float | None = None) -> None:
        self.burst, self.rate = float(burst), rate
        self.tokens = float(burst)
        self.stamp = time.monotonic() if now is None else now

    def take(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True

    def wait_s(self) -> float:
        """Seconds until the next token."""
        return max(0.0, (1.0 - self.tokens) / self.rate) if self.rate > 0 else float("inf")


class AddressBuckets:
    """A token bucket per client address, at most ``max_addrs`` of them (the
    least recently used is forgotten first: it starts full again)."""

    def __init__(self, burst: float, rate: float, max_addrs: int = MAX_TRACKED_ADDRS) -> None:
        self.burst, self.rate, self.max_addrs = burst, rate, max_addrs
        self.buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def take(self, addr: str, now: float | None = None) -> bool:
        bucket = self.buckets.get(addr)
        if bucket is None:
            bucket = self.buckets[addr] = TokenBucket(self.burst, self.rate, now)
            if len(self.buckets) > self.max_addrs:
                self.buckets.popitem(last=False)
        self.buckets.move_to_end(addr)
        return bucket.take(now)

    def retry_after(self, addr: str) -> str:
        bucket = self.buckets.get(addr)
        return str(max(1, round(bucket.wait_s() + 0.5))) if bucket is not None else "1"


class Room:
    """Whether a new job may be created: the waiting-jobs cap (per address and
    in total, reclaiming unheld jobs) and the data dir's free space."""

    def __init__(self) -> None:
        self.creator: dict[str, str] = {}  # job id -> the address whose join created it (or its current run)
        # refused agents retry: one line per interval, with a count
        self.refusal_log = LogLimiter(log, logging.WARNING, burst=1, rate=0.1)
        self.reclaim_log = LogLimiter(log, logging.WARNING, burst=1, rate=0.1)

    def check(self, store: Store, job_id: str, chan: Channel) -> None:
        """Refuse a new job (unavailable: its agent retries later) when its
        address holds its quota of waiting jobs, when the cap is full of held
        jobs, or when the data dir's disk is nearly full. Nothing is created;
        the agent is told why and its connection closed so that it retries
        with backoff. Existing jobs are never refused here."""
        s = store.settings
        addr = getattr(chan, "peer", None) or "?"
        why = self._waiting(store, job_id, addr)
        if why is None and store.db is not None and s.data_dir is not None and s.min_free_disk > 0:
            free = free_bytes(s.data_dir)
            if free is not None and free < s.min_free_disk:
                why = (
                    f"only {free} bytes free on {s.data_dir} (--min-free-disk {s.min_free_disk}); "
                    f"new jobs are refused until there is space, running jobs carry on; "
                    f"job {job_id!r} is not created"
                )
        if why is None:
            self.creator[job_id] = addr
            if len(self.creator) > 2 * len(store.waiting) + 1024:  # forget jobs that wait no more
                self.creator = {j: a for j, a in self.creator.items() if j in store.waiting}
            return
        error = UnavailableError(why, ErrorCode.UNAVAILABLE)
        self.refusal_log("refused a new job: %s", why)
        chan.deliver(ErrorMsg(code=error.code, message=error.message).model_dump_json())
        chan.drop()
        raise error

    def _waiting(self, store: Store, job_id: str, addr: str) -> str | None:
        s = store.settings
        mine = 0
        unheld: list[rounds.Job] = []
        for j in store.waiting:
            job = store.jobs[j]
            if not rounds.held(job):
                unheld.append(job)
            elif self.creator.get(j) == addr:
                mine += 1
        if s.waiting_jobs_per_address > 0 and mine >= s.waiting_jobs_per_address:
            return (
                f"{printable(addr, 64)} holds {mine} jobs waiting for nodes (--max-waiting-jobs-per-address "
                f"{s.waiting_jobs_per_address}); job {job_id!r} is not created: retry later"
            )
        if len(store.waiting) < s.max_waiting_jobs:
            return None
        if not unheld:
            return (
                f"{len(store.waiting)} jobs are waiting for nodes on this server (--max-waiting-jobs "
                f"{s.max_waiting_jobs}), each held by a connected node; job {job_id!r} is not created: retry later"
            )
        # a job with no node left goes before one whose nodes only dropped (within their grace:
        # a team's connection that blinked), and the newest first: an old one is likelier a team's
        victim = max(unheld, key=lambda job: (not job.nodes, job.created_at, job.job_id))
        now = store.clock()
        reason = (
            f"closed by the server to make room for a new job: no node of it was connected while "
            f"--max-waiting-jobs ({s.max_waiting_jobs}) jobs waited"
        )
        try:
            store._apply(victim, rounds.reclaim(victim, now, reason), now)
        except UnavailableError as e:  # the close could not be saved: the job stays, the new one waits
            return f"{e.message}; job {job_id!r} is not created"
        self.reclaim_log(
            "job %s closed to make room (no node of it connected, --max-waiting-jobs %d full) for job %s",
            victim.job_id,
            s.max_waiting_jobs,
            printable(job_id, 128),
        )
        return None
