"""The store's clock: its tick loop and what one tick does.

:class:`StoreTicks` is a collaborator of :class:`rdzv_server.store.Store`
(``store.ticks``), split out to keep one module readable. A tick visits only
the jobs whose next deadline passed (``store.due``, a heap keyed by
:func:`rounds.next_due`), so its cost does not grow with idle jobs. A full
tick comes every :data:`TICK_S` and also looks at hosts (cool-downs, cordons),
silences (``store.pacing``) and retention; a job's deadline that comes first
gets a tick of its own (``Due.sleep``: a lost node's grace, a last call, a
scale-up window end on time).

After a stall of the loop every node heard from since its last stall grace
gets a full heartbeat timeout (rounds.grace): a silent node gets one such
grace, not one per stall.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from rdzv_common.protocol import UnavailableError
from rdzv_common.tasks import cancel_and_wait

from . import rounds
from .due import DUE_SLACK_S

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger("rdzv_server.store")  # the store's log, as before the split

TICK_S = 0.1  # a full tick's period; a job's deadline that comes first gets a tick of its own (Due.wait_s)
STALL_S = 1.5  # a loop that slept this long was stopped or starved: be lenient


class StoreTicks:
    """The tick loop of a :class:`~rdzv_server.store.Store` (event loop only)."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._task: asyncio.Task[None] | None = None
        self.last = time.monotonic()  # when the last tick ran (a later one sees a stall)

    def start(self) -> None:
        self.last = time.monotonic()
        self._task = asyncio.create_task(self._run(), name="rdzv-tick")

    def cancel(self) -> None:
        """Stop ticking at once (a replica that steps down)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def _run(self) -> None:
        store = self._store
        loop = asyncio.get_running_loop()
        full_at = loop.time() + TICK_S
        while True:
            await store.due.sleep(full_at - loop.time(), store.clock())
            full = loop.time() >= full_at - DUE_SLACK_S  # (uvloop's timers round to the ms: early by a hair)
            if full:
                full_at = loop.time() + TICK_S
            try:
                self.tick(full)
            except Exception:  # a bug here must not stop the clock for every job
                log.exception("tick failed")

    def tick(self, full: bool = True) -> None:
        """Visit the jobs whose deadline passed; when ``full``, hosts, silences and retention
        too (not ``full``: a deadline's tick between two full ones)."""
        store = self._store
        store.gc_hold.tick()  # first: whatever fails below, the hold still ends
        mono = time.monotonic()
        stalled = mono - self.last > STALL_S
        self.last = mono
        now = store.clock()
        if stalled:
            for job_id in store.active:  # deadlines only move later: the heap stays valid
                rounds.grace(store.jobs[job_id], now, stall=True)
            log.warning(
                "the server did not run for a while (stopped or starved); "
                "every node heard from since gets a full heartbeat timeout"
            )
        if full:
            store.host_side.tick(now)  # a cool-down or a cordon's ttl ended: its spares may be admitted
            store.pacing.tick()  # silent running members: probed (rdzv_server.pacing)
        for job_id in store.due.pop(now):
            job = store.jobs.get(job_id)
            if job is None or job_id not in store.active:
                continue
            try:
                store._apply(job, rounds.tick(job, now), now)  # reschedules it
            except UnavailableError:
                pass  # a write failed: the job was put back as saved, and rescheduled
            except Exception:  # a bug here must not stop the clock for this job
                log.exception("tick of job %s failed", job_id)
                store.due.schedule(job)
        if full:
            store.retention.expire(now)
