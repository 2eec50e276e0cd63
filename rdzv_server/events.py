"""The event stream: what happened to jobs and hosts, numbered, in a bounded ring.

Events are derived in one place, :meth:`EventLog.observe`, which the store calls
from ``_apply`` after the job was written to disk (persist before publish: a
client never hears of a round that a crash could forget) with the effects of
the step and, for a join or a report, the node it concerns. Job-level changes
(a round opened or completed, restarts charged, the job's state) are found by
comparing the job with what the log last saw of it (O(1) per step); nodes lost
or evicted are the step's ``Effects.evicted`` and left nodes; host cordons come
from the store's host side.

Each event is one JSON object ``{"id", "time", "type", "job", "run", "round",
"node", ...fields}`` (``run``: the job id's run, from 1; None for host events;
ASCII, control characters escaped by JSON), serialized once into a
Server-Sent Events frame. Ids increase by one per event; the first id of a
server process is its start time in microseconds, so ids also increase across
restarts (as long as the wall clock does not go back), and a ``Last-Event-ID``
from before a restart is older than the ring: the client gets a ``gap`` marker
and should refetch the views it shows.

Bounds: the ring keeps the last ``ring`` events; every subscriber has a queue
of at most ``queue`` frames; a subscriber whose queue is full is dropped (its
connection aborted), never buffered further; at most ``max_streams``
subscribers at once.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .conns import LogLimiter
from .protocol import JobState
from .rounds import Effects, Job
from .wire import printable

log = logging.getLogger("rdzv_server.events")

# The event types are logs.EVENTS (one list for the stream and the json log's `event` field).
GAP = "gap"  # the stream's marker: events a client asked for are no longer held

DEFAULT_RING = 10_000
DEFAULT_QUEUE = 1024
DEFAULT_MAX_STREAMS = 1000
MAX_FAILURES = 8  # exit records an event carries (a node may report one per local rank)

_dropped_log = LogLimiter(log, logging.WARNING, burst=5, rate=0.2)


@dataclass
class Event:
    id: int
    type: str
    job: str | None
    data: str  # the JSON object
    frame: bytes  # the SSE frame: id, event, data lines


@dataclass
class _Mark:
    """What the log last saw of a job."""

    state: str
    round: int
    completed: bool  # the round ``round`` had completed
    restarts: int


@dataclass(eq=False)
class Subscriber:
    """One stream: its job filter (None: every event) and its bounded queue."""

    job: str | None
    limit: int
    on_drop: Callable[[], None] | None = None
    queue: deque[bytes] = field(default_factory=deque)
    dropped: bool = False
    wake: Callable[[], None] | None = None  # set by the stream's writer

    def offer(self, frame: bytes) -> bool:
        if self.dropped:
            return False
        if len(self.queue) >= self.limit:
            self.dropped = True
            self.queue.clear()
            if self.on_drop is not None:
                self.on_drop()
        else:
            self.queue.append(frame)
        if self.wake is not None:
            self.wake()
        return not self.dropped

    def take(self) -> list[bytes]:
        out = list(self.queue)
        self.queue.clear()
        return out


class EventLog:
    def __init__(
        self,
        ring: int = DEFAULT_RING,
        queue: int = DEFAULT_QUEUE,
        max_streams: int = DEFAULT_MAX_STREAMS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.ring: deque[Event] = deque(maxlen=ring)
        self.queue_limit = queue
        self.max_streams = max_streams
        self.clock = clock
        self.first_id = int(time.time() * 1_000_000)  # see the module docstring: ids across restarts
        self.next_id = self.first_id
        self.subscribers: set[Subscriber] = set()
        self.marks: dict[str, _Mark] = {}
        self.dropped_total = 0

    # ------------------------------------------------------------ publish

    def emit(
        self,
        type_: str,
        job: str | None,
        round_: int | None = None,
        node: str | None = None,
        run: int | None = None,
        **fields: Any,
    ) -> Event:
        """Number the event, keep it in the ring, queue it for its subscribers
        (``run``: the run of the job id, None for host events)."""
        eid = self.next_id
        self.next_id += 1
        body: dict[str, Any] = {
            "id": eid,
            "time": round(self.clock(), 6),
            "type": type_,
            "job": job,
            "run": run,
            "round": round_,
            "node": node,
        }
        body.update(fields)
        data = json.dumps(body, separators=(",", ":"))  # ASCII, control characters escaped: one line
        ev = Event(eid, type_, job, data, f"id: {eid}\nevent: {type_}\ndata: {data}\n\n".encode())
        self.ring.append(ev)
        for sub in list(self.subscribers):
            if (sub.job is None or sub.job == job) and not sub.offer(ev.frame):
                self._drop(sub)
        return ev

    def _drop(self, sub: Subscriber) -> None:
        self.subscribers.discard(sub)
        self.dropped_total += 1
        _dropped_log(
            "event stream%s dropped: the client read too slowly (%d events unread, the limit)",
            f" of job {printable(sub.job)}" if sub.job else "",
            sub.limit,
        )

    # ------------------------------------------------------------ derive

    def mark(self, job: Job) -> None:
        """Remember the job as it is, with no event (a job loaded from disk)."""
        last = job.history[-1] if job.history else None
        self.marks[job.job_id] = _Mark(
            job.state.value, job.round, last is not None and last.completed_at is not None, job.restarts
        )

    def forget(self, job_id: str) -> None:
        self.marks.pop(job_id, None)

    def observe(
        self,
        job: Job,
        fx: Effects,
        now: float,
        node: tuple[str, str, dict[str, Any]] | None = None,
        lost: tuple[str, str] | None = None,
        created: bool = False,
        new_run: str | None = None,
    ) -> None:
        """The events of one step of ``job`` (already persisted): ``node`` is
        (type, node id, fields) of the join or report that caused it, ``lost``
        (node id, reason) a node that left, ``created`` the job is new,
        ``new_run`` the state the job id's previous run ended in when this step
        started its next run; the rest comes from ``fx`` and from comparing the
        job with its mark. Every event carries the job's run."""
        j = job.job_id
        mark = self.marks.get(j)
        if new_run is not None:  # the run starts over: waiting, round 0, like a new job
            mark = self.marks[j] = _Mark(JobState.WAITING.value, 0, False, 0)
            reason = job.history[0].reason if job.history else f"run {job.run} started"
            self.emit("job_state", j, 0, None, run=job.run, state=mark.state, previous=new_run, reason=reason)
        elif mark is None:
            if not created:
                return  # a finished job (its mark is gone): a late report changes nothing
            mark = self.marks[j] = _Mark(JobState.WAITING.value, 0, False, 0)  # every job starts waiting
            self.emit("job_state", j, 0, None, run=job.run, state=mark.state, previous=None, reason="job created")
        run = job.run
        if node is not None:
            self.emit(node[0], j, mark.round, node[1], run, **node[2])  # the round it reported in
        if lost is not None:
            self.emit("node_lost", j, mark.round, lost[0], run, reason=printable(lost[1]))
        if fx.evicted:
            reasons = {n: getattr(msg, "reason", None) for n, msg in fx.sends if getattr(msg, "op", "") == "evicted"}
            for nid in fx.evicted:
                why = reasons.get(nid) or "evicted"
                # connection lost: the node went away; no heartbeat: the server gave up on it
                kind = "node_lost" if why.endswith("connection lost") else "node_evicted"
                self.emit(kind, j, mark.round, nid, run, reason=why)
        if job.restarts > mark.restarts:
            self.emit(
                "restart_charged",
                j,
                job.round,
                None,
                run,
                restarts=job.restarts,
                max_restarts=job.spec.max_restarts,
                reason=job.history[-1].reason if job.history else None,
            )
        if job.round > mark.round or (job.round == mark.round and not mark.completed):
            opened = [r for r in _tail(job, mark.round) if r.round > mark.round]
            for rec in opened:
                self.emit("round_opened", j, rec.round, None, run, reason=rec.reason, started_at=rec.started_at)
            for rec in _tail(job, mark.round):
                if rec.completed_at is not None and (rec.round > mark.round or not mark.completed):
                    self.emit(
                        "round_completed",
                        j,
                        rec.round,
                        None,
                        run,
                        reason=rec.reason,
                        formation_s=round(rec.completed_at - rec.started_at, 6),
                        world_size=rec.world_size,
                        nodes=rec.nodes,
                    )
        if job.state.value != mark.state:
            fields: dict[str, Any] = {"state": job.state.value, "previous": mark.state}
            if job.finished:
                fields.update(reason=job.end_reason, root_cause=job.root_cause)
            self.emit("job_state", j, job.round, None, run, **fields)
        last = job.history[-1] if job.history else None
        mark.state, mark.round, mark.restarts = job.state.value, job.round, job.restarts
        mark.completed = last is not None and last.round == job.round and last.completed_at is not None
        if job.finished:
            self.marks.pop(j, None)

    # ------------------------------------------------------------ read

    def replay(self, last_id: int | None, job: str | None) -> tuple[list[Event], Event | None]:
        """Events after ``last_id`` held in the ring (for ``job``, or all), and
        a gap marker when some after it are no longer held (``last_id`` 0:
        every event held, without a marker)."""
        if last_id is None:
            return [], None
        first = self.ring[0].id if self.ring else self.next_id
        gap = None
        if last_id + 1 < first and last_id != 0:  # 0: everything held, no marker
            gap_id = first - 1
            data = json.dumps(
                {
                    "id": gap_id,
                    "time": round(self.clock(), 6),
                    "type": GAP,
                    "job": job,
                    "run": None,
                    "round": None,
                    "node": None,
                    "after": last_id,
                    "message": f"events after {last_id} up to {gap_id} are no longer held (the server keeps "
                    f"the last {self.ring.maxlen}, ids restart higher after a server restart): refetch what "
                    f"you show",
                },
                separators=(",", ":"),
            )
            gap = Event(gap_id, GAP, job, data, f"id: {gap_id}\nevent: {GAP}\ndata: {data}\n\n".encode())
        start = max(0, last_id + 1 - first)
        events = [self.ring[i] for i in range(start, len(self.ring))] if start < len(self.ring) else []
        if job is not None:
            events = [e for e in events if e.job == job]
        return events, gap

    def subscribe(self, job: str | None, on_drop: Callable[[], None] | None = None) -> Subscriber:
        sub = Subscriber(job, self.queue_limit, on_drop)
        self.subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        self.subscribers.discard(sub)

    def close_all(self) -> None:
        """Server shutdown: every stream ends."""
        for sub in list(self.subscribers):
            sub.dropped = True
            if sub.wake is not None:
                sub.wake()
        self.subscribers.clear()


def _tail(job: Job, after_round: int) -> list[Any]:
    """The job's round records from round ``after_round`` on (the newest few)."""
    out = []
    for rec in reversed(job.history):
        if rec.round < after_round:
            break
        out.append(rec)
    out.reverse()
    return out


def failure_fields(failures: list[Any]) -> dict[str, Any]:
    """A node_failed event's fields from its exit records (bounded, printable)."""
    first = min(failures, key=lambda r: (r.timestamp or float("inf"), r.rank))
    return {
        "cause": printable(first.describe()),
        "failures": [
            {k: (printable(v) if isinstance(v, str) else v) for k, v in r.model_dump(mode="json").items()}
            for r in failures[:MAX_FAILURES]
        ],
        "failures_omitted": max(0, len(failures) - MAX_FAILURES),
    }
