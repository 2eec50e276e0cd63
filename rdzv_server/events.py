"""The event stream: what happened to jobs and hosts, numbered, in a bounded ring.

Events are made in one place, the round machine's steps (typed, in
``Effects.events``; :mod:`rdzv_server.rounds.events`); the store emits them
here after the job was written to disk (persist before publish: a client
never hears of a round that a crash could forget) and logs the same events'
lines, so the stream and the json log agree. Host cordons come from the
store's host side.

Each event is one JSON object ``{"id", "time", "type", "job", "run", "round",
"node", ...fields}`` (``run``: the job id's run, from 1; None for host events;
ASCII, control characters escaped by JSON), serialized once into a
Server-Sent Events frame. Ids increase by one per event; the first id of a
server process is its start time in microseconds, so ids also increase across
restarts (as long as the wall clock does not go back), and a ``Last-Event-ID``
from before a restart is older than the ring: the client gets a ``gap`` marker
and should refetch the views it shows.

Bounds, in bytes as well as in count (docs/design.md "Bounds"): an event's JSON
takes at most ``max_event_bytes`` (client text in it, failure messages and
reasons, is clipped with a marker and the event says ``"truncated": true``);
the ring keeps the last ``ring`` events and at most ``ring_bytes`` of them,
the oldest going first; every subscriber has a queue of at most ``queue``
frames and ``queue_bytes`` bytes, and one whose queue is full is dropped (its
connection aborted), never buffered further. Queues and replays hold the
ring's own frames (references, never copies). At most ``max_streams``
subscribers at once, and ``max_streams_per_addr`` from one client address.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rdzv_common.sizes import clip
from rdzv_common.wire import printable

from .conns import LogLimiter
from .rounds.events import MAX_FAILURES, failure_fields  # noqa: F401  (re-exported)

log = logging.getLogger("rdzv_server.events")

# The event types are logs.EVENTS (one list for the stream and the json log's `event` field).
GAP = "gap"  # the stream's marker: events a client asked for are no longer held

DEFAULT_RING = 10_000
DEFAULT_RING_BYTES = 32 * 1024 * 1024  # the ring's frames, with EVENT_OVERHEAD each
DEFAULT_QUEUE = 1024
DEFAULT_QUEUE_BYTES = 1024 * 1024  # frames queued per stream (the ring's own: references, not copies)
DEFAULT_MAX_STREAMS = 1000
DEFAULT_MAX_STREAMS_PER_ADDR = 16  # event streams one client address may hold open
DEFAULT_WRITE_TIMEOUT_S = 10.0  # a stream whose socket takes no more bytes for this long is dropped
MAX_EVENT_BYTES = 8 * 1024  # an event's JSON
EVENT_OVERHEAD = 256  # what an Event costs in memory beyond its frame (objects, ring slot), for ring_bytes
_FIXED = ("id", "time", "type", "job", "run", "round", "node")  # never clipped: ids are short, ASCII

_dropped_log = LogLimiter(log, logging.WARNING, burst=5, rate=0.2)


@dataclass(slots=True)
class Event:
    id: int
    type: str
    job: str | None
    frame: bytes  # the SSE frame: id, event, data lines; the JSON object is kept once, in it
    at: int  # where the JSON object starts in frame (it ends 2 bytes before the frame's end)

    @property
    def data(self) -> bytes:
        """The JSON object (a copy: for tests and small answers)."""
        return self.frame[self.at : -2]

    @property
    def cost(self) -> int:
        return len(self.frame) + EVENT_OVERHEAD


def _event(eid: int, type_: str, job: str | None, data: str) -> Event:
    head = f"id: {eid}\nevent: {type_}\ndata: "
    return Event(eid, type_, job, f"{head}{data}\n\n".encode(), len(head))


@dataclass(eq=False)
class Subscriber:
    """One stream: its job filter (None: every event) and its bounded queue."""

    job: str | None
    limit: int
    on_drop: Callable[[], None] | None = None
    limit_bytes: int = DEFAULT_QUEUE_BYTES
    addr: str | None = None  # the client's address (the per-address limit)
    queue: deque[bytes] = field(default_factory=deque)
    queued_bytes: int = 0
    dropped: bool = False
    why: str = ""  # why it was dropped
    wake: Callable[[], None] | None = None  # set by the stream's writer

    def offer(self, frame: bytes) -> bool:
        if self.dropped:
            return False
        if len(self.queue) >= self.limit or self.queued_bytes + len(frame) > self.limit_bytes:
            self.drop(f"the client read too slowly ({len(self.queue)} events, {self.queued_bytes} bytes unread)")
        else:
            self.queue.append(frame)
            self.queued_bytes += len(frame)
        if self.wake is not None:
            self.wake()
        return not self.dropped

    def drop(self, why: str) -> None:
        """End the stream: its queue is released and its connection aborted."""
        if self.dropped:
            return
        self.dropped = True
        self.why = why
        self.queue.clear()
        self.queued_bytes = 0
        if self.on_drop is not None:
            self.on_drop()
        if self.wake is not None:
            self.wake()

    def take(self, max_bytes: int | None = None) -> list[bytes]:
        """Queued frames, oldest first, up to ``max_bytes`` (at least one)."""
        out: list[bytes] = []
        size = 0
        while self.queue and (max_bytes is None or not out or size + len(self.queue[0]) <= max_bytes):
            frame = self.queue.popleft()
            size += len(frame)
            out.append(frame)
        self.queued_bytes -= size
        return out


class EventLog:
    def __init__(
        self,
        ring: int = DEFAULT_RING,
        queue: int = DEFAULT_QUEUE,
        max_streams: int = DEFAULT_MAX_STREAMS,
        clock: Callable[[], float] = time.time,
        ring_bytes: int = DEFAULT_RING_BYTES,
        queue_bytes: int = DEFAULT_QUEUE_BYTES,
        max_streams_per_addr: int = DEFAULT_MAX_STREAMS_PER_ADDR,
        write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S,
        max_event_bytes: int = MAX_EVENT_BYTES,
    ) -> None:
        self.ring: deque[Event] = deque()
        self.ring_limit = ring
        self.ring_bytes_limit = ring_bytes
        self.ring_bytes = 0  # the held events' cost (Event.cost)
        self.queue_limit = queue
        self.queue_bytes = queue_bytes
        self.max_streams = max_streams
        self.max_streams_per_addr = max_streams_per_addr
        self.write_timeout_s = write_timeout_s
        self.max_event_bytes = max_event_bytes
        self.clock = clock
        self.first_id = int(time.time() * 1_000_000)  # see the module docstring: ids across restarts
        self.next_id = self.first_id
        self.subscribers: set[Subscriber] = set()
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
        if len(data) > self.max_event_bytes:
            data = fit(body, self.max_event_bytes)
        ev = _event(eid, type_, job, data)
        self.ring.append(ev)
        self.ring_bytes += ev.cost
        while len(self.ring) > self.ring_limit or (self.ring_bytes > self.ring_bytes_limit and len(self.ring) > 1):
            self.ring_bytes -= self.ring.popleft().cost  # the oldest go first
        for sub in list(self.subscribers):
            if (sub.job is None or sub.job == job) and not sub.offer(ev.frame):
                self._drop(sub)
        return ev

    def _drop(self, sub: Subscriber) -> None:
        self.subscribers.discard(sub)
        self.dropped_total += 1
        _dropped_log(
            "event stream%s%s dropped: %s",
            f" of job {printable(sub.job)}" if sub.job else "",
            f" from {printable(sub.addr)}" if sub.addr else "",
            sub.why,
        )

    def drop(self, sub: Subscriber, why: str) -> None:
        """End a stream (its writer saw the client not reading): its queue is released."""
        if sub in self.subscribers:
            sub.drop(why)
            self._drop(sub)

    # ------------------------------------------------------------ read

    def gap(self, last_id: int, job: str | None) -> Event | None:
        """The marker for a client whose ``last_id`` is older than what the ring
        holds (``last_id`` 0: everything held, no marker)."""
        first = self.ring[0].id if self.ring else self.next_id
        if last_id == 0 or last_id + 1 >= first:
            return None
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
                f"the last {self.ring_limit} events, at most {self.ring_bytes_limit} bytes; ids restart higher "
                f"after a server restart): refetch what you show",
            },
            separators=(",", ":"),
        )
        return _event(gap_id, GAP, job, data)

    def read(
        self, after: int, job: str | None, until: int, max_bytes: int, max_scan: int = 4096
    ) -> tuple[list[Event], int, bool]:
        """Held events with ``after < id < until`` (of ``job``, or all), oldest
        first, whose frames take at most ``max_bytes`` (at least one), looking
        at no more than ``max_scan`` events: a bounded step of a replay, which
        holds the ring's own events, never copies. Returns the events, the id
        to pass as the next ``after`` (done when it is ``until - 1`` or more),
        and whether events after ``after`` were no longer held (``after`` 0:
        never)."""
        first = self.ring[0].id if self.ring else self.next_id
        lost = after != 0 and after + 1 < first
        cursor = max(after, first - 1)
        out: list[Event] = []
        size = 0
        for ev in itertools.islice(self.ring, max(0, after + 1 - first), None):
            if ev.id >= until or max_scan <= 0 or (out and size + len(ev.frame) > max_bytes):
                break
            max_scan -= 1
            cursor = ev.id
            if job is None or ev.job == job:
                out.append(ev)
                size += len(ev.frame)
        return out, cursor, lost

    def streams_from(self, addr: str | None) -> int:
        return sum(1 for sub in self.subscribers if sub.addr == addr)

    def subscribe(
        self, job: str | None, on_drop: Callable[[], None] | None = None, addr: str | None = None
    ) -> Subscriber:
        sub = Subscriber(job, self.queue_limit, on_drop, self.queue_bytes, addr)
        self.subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        """A stream ended: it holds nothing any more."""
        self.subscribers.discard(sub)
        sub.queue.clear()
        sub.queued_bytes = 0

    def close_all(self) -> None:
        """Server shutdown: every stream ends."""
        for sub in list(self.subscribers):
            sub.dropped = True
            if sub.wake is not None:
                sub.wake()
        self.subscribers.clear()


def fit(body: dict[str, Any], max_bytes: int) -> str:
    """``body`` as JSON in at most ``max_bytes``: its text (what clients sent:
    messages, reasons) clipped with a marker, its lists cut (``failures_omitted``
    counts the exit records cut), ``"truncated": true``; at worst only the
    event's ids. Measured as encoded (a 4-byte character is 12 bytes)."""
    fixed = {k: body[k] for k in _FIXED if k in body}
    rest = {k: v for k, v in body.items() if k not in _FIXED}
    for text, items in ((max_bytes // 4, MAX_FAILURES), (max_bytes // 16, 4), (256, 2), (64, 0)):
        out = {**fixed, **{k: _shrink(v, text, items) for k, v in rest.items()}, "truncated": True}
        failures = rest.get("failures")
        if isinstance(failures, list) and isinstance(out.get("failures_omitted"), int):
            out["failures_omitted"] += len(failures) - len(out["failures"])
        data = json.dumps(out, separators=(",", ":"))
        if len(data) <= max_bytes:
            return data
    return json.dumps({**fixed, "truncated": True}, separators=(",", ":"))


def _shrink(value: Any, text: int, items: int) -> Any:
    if isinstance(value, str):
        return clip(value, text)
    if isinstance(value, list):
        return [_shrink(v, text, items) for v in value[:items]]
    if isinstance(value, dict):
        return {k: _shrink(v, text, items) for k, v in value.items()}
    return value
