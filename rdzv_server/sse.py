"""``GET /v1/events`` and ``GET /v1/jobs/{job_id}/events``: the event log
(:mod:`rdzv_server.events`) as Server-Sent Events, or as JSON with ``?since=ID``.

A stream starts with a ``retry:`` line, then the events after
``Last-Event-ID`` (the header, or ``?last_event_id=``) still in the ring
(preceded by a ``gap`` event when some are no longer held), then live events;
a comment line every ``keepalive_s`` when nothing happens. A client that reads
too slowly is dropped (its connection aborted): its queue is full (in frames or
bytes), its replay left the ring before it took it, or a write to it did not
drain within ``write_timeout_s``. Every write is at most CHUNK_BYTES, read from
the ring's own frames: neither a replay nor a JSON answer is built whole. At
most ``max_streams`` streams are open at once and ``max_streams_per_addr``
from one client address (beyond: 503 ``unavailable``).
"""

from __future__ import annotations

import asyncio
import json
import logging

from aiohttp import web

from rdzv_common.protocol import ErrorCode, RequestError, UnavailableError, is_valid_id
from rdzv_common.wire import printable

from .events import EventLog, Subscriber
from .keys import EVENTS, EVENTS_KEEPALIVE

log = logging.getLogger(__name__)

RETRY_MS = 1000
MAX_SINCE = 10_000  # events one JSON answer holds at most (the ring's default size)
MAX_SINCE_BYTES = 4 * 1024 * 1024  # about the most one JSON answer holds (then "more": true)
CHUNK_BYTES = 64 * 1024  # one write to a client's socket at most


def _event_id(text: str, what: str) -> int:
    if not (text.isascii() and text.isdigit() and len(text) <= 18):
        raise RequestError(f"{what} {text[:64]!r} is not an event id (a whole number)", ErrorCode.VALIDATION_ERROR)
    return int(text)


def _job_filter(request: web.Request) -> str | None:
    job_id = request.match_info.get("job_id")
    if job_id is not None and not is_valid_id(job_id):
        raise RequestError(
            f"job id {job_id[:64]!r} is not valid: 1-128 characters of [A-Za-z0-9._:@+-]", ErrorCode.VALIDATION_ERROR
        )
    return job_id


async def events(request: web.Request) -> web.StreamResponse:
    log_ = request.app[EVENTS]
    job = _job_filter(request)
    q = request.rel_url.query
    if "since" in q:
        return await _since(request, log_, job, _event_id(q["since"], "since"))
    last = request.headers.get("Last-Event-ID") or q.get("last_event_id")
    last_id = _event_id(last.strip(), "Last-Event-ID") if last else None
    if len(log_.subscribers) >= log_.max_streams:
        raise UnavailableError(
            f"{len(log_.subscribers)} event streams are open, the limit: retry later", ErrorCode.UNAVAILABLE
        )
    addr = request.remote
    if (mine := log_.streams_from(addr)) >= log_.max_streams_per_addr:
        raise UnavailableError(
            f"{mine} event streams are open from {printable(addr)}, the limit for one client address "
            f"({log_.max_streams_per_addr}): close one, or retry later",
            ErrorCode.UNAVAILABLE,
        )
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    transport = request.transport
    sub = log_.subscribe(job, on_drop=transport.abort if transport is not None else None, addr=addr)
    until = log_.next_id  # the replay is the held events before it; the queue gets the rest
    wake = asyncio.Event()
    sub.wake = wake.set
    timeout = log_.write_timeout_s
    try:
        await resp.prepare(request)
        gap = log_.gap(last_id, job) if last_id is not None else None
        await _write(resp, f"retry: {RETRY_MS}\n\n".encode() + (gap.frame if gap else b""), timeout)
        if last_id is not None:
            await _replay(resp, log_, sub, gap.id if gap else last_id, until, timeout)
        await _pump(resp, sub, wake, request.app[EVENTS_KEEPALIVE], timeout)
    except ConnectionError:
        pass  # the client went away or was dropped
    except _Stalled:
        log_.drop(sub, f"its socket took nothing for {timeout:g} s")
    finally:
        log_.unsubscribe(sub)
    return resp


class _Stalled(Exception):
    """A write did not drain within the write timeout: the client does not read."""


async def _write(resp: web.StreamResponse, data: bytes, timeout: float) -> None:
    """One bounded write (aiohttp waits for the socket to drain past 64 KiB buffered)."""
    try:
        await asyncio.wait_for(resp.write(data), timeout)
    except asyncio.TimeoutError:
        raise _Stalled() from None


async def _replay(
    resp: web.StreamResponse, log_: EventLog, sub: Subscriber, last_id: int, until: int, timeout: float
) -> None:
    """The held events after ``last_id`` (the gap marker's id when one was
    sent), a chunk at a time from the ring (no copy of the replay is built): a
    stream that cannot take it before its events leave the ring, or whose
    queue of live events fills meanwhile, is dropped."""
    cursor = last_id
    while cursor < until - 1 and not sub.dropped:
        chunk, cursor, lost = log_.read(cursor, sub.job, until, CHUNK_BYTES)
        if lost:
            log_.drop(sub, "it read its replay too slowly (the ring no longer held it)")
            return
        if chunk:
            await _write(resp, b"".join(e.frame for e in chunk), timeout)
        await asyncio.sleep(0)  # a bounded step at a time: other requests run in between


async def _pump(
    resp: web.StreamResponse, sub: Subscriber, wake: asyncio.Event, keepalive_s: float, timeout: float
) -> None:
    while not sub.dropped:
        frames = sub.take(CHUNK_BYTES)
        if frames:
            await _write(resp, b"".join(frames), timeout)
            continue
        wake.clear()
        try:
            await asyncio.wait_for(wake.wait(), keepalive_s)
        except asyncio.TimeoutError:
            await _write(resp, b": keep-alive\n\n", timeout)


async def _since(request: web.Request, log_: EventLog, job: str | None, since: int) -> web.StreamResponse:
    """The JSON variant: the held events after ``since``, at most MAX_SINCE of
    them and about MAX_SINCE_BYTES, streamed a chunk at a time from the ring;
    ``gap`` true when some after ``since`` are no longer held; ``last_id`` to
    pass as the next ``since``; ``more`` true when the answer stopped at its
    limit before the newest event (ask again from ``last_id``)."""
    until = log_.next_id
    gap = log_.gap(since, job) is not None
    timeout = log_.write_timeout_s
    resp = web.StreamResponse(headers={"Content-Type": "application/json; charset=utf-8"})
    await resp.prepare(request)
    cursor, count, size = since, 0, 0
    try:
        await _write(resp, b'{"events":[', timeout)
        while cursor < until - 1 and count < MAX_SINCE and size < MAX_SINCE_BYTES:
            chunk, after, lost = log_.read(cursor, job, until, min(CHUNK_BYTES, MAX_SINCE_BYTES - size))
            gap = gap or lost
            if len(chunk) > MAX_SINCE - count:
                chunk = chunk[: MAX_SINCE - count]
                after = chunk[-1].id
            cursor = after
            if chunk:
                body = b",".join(memoryview(e.frame)[e.at : -2] for e in chunk)
                await _write(resp, (b"," if count else b"") + body, timeout)
                count += len(chunk)
                size += len(body)
            await asyncio.sleep(0)  # a bounded step at a time: other requests run in between
        more = cursor < until - 1
        tail = f'],"gap":{json.dumps(gap)},"last_id":{cursor},"more":{json.dumps(more)}}}'
        await _write(resp, tail.encode(), timeout)
        await resp.write_eof()
    except ConnectionError:
        pass  # the client went away
    except _Stalled:
        if request.transport is not None:
            request.transport.abort()
    return resp
