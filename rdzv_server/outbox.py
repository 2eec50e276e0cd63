"""Writes to a remote store (etcd) and what must wait for them, in order.

With SQLite a round change is written synchronously before anyone hears of it
(:mod:`rdzv_server.store`). A remote write takes a round trip, and the event
loop must not wait for it, so the HA store (``--etcd``) keeps the same promise
with a queue per key (a job; the host records): the store's step changes the
job in memory at once, then queues a *write* of the job's record (a snapshot
taken then) and a *publication* (the messages to the agents, the log lines,
the events) that runs only after that write succeeded. Later steps of the same
job queue behind it, so nobody ever hears of a round that etcd does not hold,
and agents hear of rounds in order.

Writes of one job coalesce: while one is in flight, newer records queue; the
next write sends only the newest, and then every publication queued before it
runs. A failed write empties the key's queue (nothing queued is announced) and
calls ``failed(key, error)``: the store puts the job back as last written and
makes its agents reconnect. Bounded: at most one write in flight per key, and
a key's queue holds at most ``MAX_QUEUE`` entries (beyond that the key fails
like a failed write: its agents reconnect and drive it again)."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)

MAX_QUEUE = 100_000  # entries per key: writes and publications (a 10,000-node round change is ~10,000)


class OutboxFull(Exception):
    """A key's queue reached MAX_QUEUE: its remote store is far behind."""


class Outbox:
    """Per key: writes (``payload`` for ``write(key, payload)``) and publications,
    in order. ``coalesce`` keys (jobs) write only their newest queued payload."""

    def __init__(
        self,
        write: Callable[[str, Any], Awaitable[None]],
        failed: Callable[[str, BaseException], None],
    ) -> None:
        self._write = write
        self._failed = failed
        self._queues: dict[str, collections.deque[tuple[str, Any]]] = {}
        self._coalesce: dict[str, bool] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}
        self.writes = 0  # writes sent (for tests and metrics)

    def busy(self, key: str) -> bool:
        """Something is queued or in flight for ``key``."""
        return key in self._queues

    def __len__(self) -> int:
        return len(self._queues)

    def write(self, key: str, payload: Any, coalesce: bool = True) -> None:
        self._put(key, ("w", payload))
        self._coalesce[key] = self._coalesce.get(key, True) and coalesce

    def publish(self, key: str, fn: Callable[[], None]) -> None:
        """Run ``fn`` after every write queued for ``key`` so far (at once if none)."""
        if key not in self._queues:
            fn()
            return
        self._put(key, ("p", fn))

    def _put(self, key: str, entry: tuple[str, Any]) -> None:
        q = self._queues.get(key)
        if q is None:
            q = self._queues[key] = collections.deque()
            self._tasks[key] = asyncio.ensure_future(self._drain(key, q))
        if len(q) >= MAX_QUEUE:
            self._fail(key, OutboxFull(f"{len(q)} entries wait for the remote store"))
            return
        q.append(entry)

    async def flushed(self, key: str) -> None:
        """Wait until nothing is queued for ``key``; raise the error of a failed write."""
        if key not in self._queues:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(key, []).append(fut)
        await fut

    def drop_all(self) -> None:
        """Forget everything queued (nothing is announced); cancel writes in flight."""
        for key in list(self._queues):
            self._end(key, ConnectionAbortedError("this replica stopped serving"), cancel=True)

    def _end(self, key: str, error: BaseException | None, cancel: bool = False) -> None:
        self._queues.pop(key, None)
        self._coalesce.pop(key, None)
        task = self._tasks.pop(key, None)
        if cancel and task is not None and task is not asyncio.current_task():
            task.cancel()
        for fut in self._waiters.pop(key, []):
            if not fut.done():
                if error is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(error)

    def _fail(self, key: str, error: BaseException) -> None:
        self._end(key, error, cancel=True)
        try:
            self._failed(key, error)
        except Exception:
            log.exception("handling a failed write of %s failed", key)

    async def _drain(self, key: str, q: collections.deque[tuple[str, Any]]) -> None:
        await asyncio.sleep(0)  # let the step that queued the first entry finish queueing
        while self._queues.get(key) is q and q:
            writes = [i for i, (kind, _) in enumerate(q) if kind == "w"]
            if writes:
                upto = writes[-1] if self._coalesce.get(key, True) else writes[0]
                try:
                    self.writes += 1
                    await self._write(key, q[upto][1])
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    if self._queues.get(key) is q:
                        self._fail(key, e)
                    return
                if self._queues.get(key) is not q:  # dropped while writing
                    return
                batch = [q.popleft() for _ in range(upto + 1)]
                while q and q[0][0] == "p":  # queued after that write, before the next one
                    batch.append(q.popleft())
            else:
                batch = [q.popleft() for _ in range(len(q))]
            for kind, item in batch:
                if kind == "p":
                    try:
                        item()
                    except Exception:  # one bad publication must not stop the others
                        log.exception("publishing a step of %s failed", key)
        if self._queues.get(key) is q:
            self._end(key, None)
