"""``GET /v1/events`` and ``GET /v1/jobs/{job_id}/events``: the event log
(:mod:`rdzv_server.events`) as Server-Sent Events, or as JSON with ``?since=ID``.

A stream starts with a ``retry:`` line, then the events after
``Last-Event-ID`` (the header, or ``?last_event_id=``) still in the ring
(preceded by a ``gap`` event when some are no longer held), then live events;
a comment line every ``keepalive_s`` when nothing happens. A client that reads
too slowly is dropped by the log (its connection aborted); at most
``max_streams`` streams are open at once (beyond: 503 ``unavailable``).
"""

from __future__ import annotations

import asyncio
import json
import logging

from aiohttp import web

from .events import EventLog, Subscriber
from .keys import EVENTS, EVENTS_KEEPALIVE
from .protocol import ErrorCode, RequestError, UnavailableError, is_valid_id

log = logging.getLogger(__name__)

RETRY_MS = 1000
MAX_SINCE = 10_000  # events one JSON answer holds at most (the ring's default size)


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
        return _since(log_, job, _event_id(q["since"], "since"))
    last = request.headers.get("Last-Event-ID") or q.get("last_event_id")
    last_id = _event_id(last.strip(), "Last-Event-ID") if last else None
    if len(log_.subscribers) >= log_.max_streams:
        raise UnavailableError(
            f"{len(log_.subscribers)} event streams are open, the limit: retry later", ErrorCode.UNAVAILABLE
        )
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    transport = request.transport
    sub = log_.subscribe(job, on_drop=transport.abort if transport is not None else None)
    wake = asyncio.Event()
    sub.wake = wake.set
    try:
        await resp.prepare(request)
        replay, gap = log_.replay(last_id, job)
        head = [f"retry: {RETRY_MS}\n\n".encode()] + ([gap.frame] if gap else []) + [e.frame for e in replay]
        await resp.write(b"".join(head))
        await _pump(resp, sub, wake, request.app[EVENTS_KEEPALIVE])
    except ConnectionError:
        pass  # the client went away or was dropped
    finally:
        log_.unsubscribe(sub)
    return resp


async def _pump(resp: web.StreamResponse, sub: Subscriber, wake: asyncio.Event, keepalive_s: float) -> None:
    while not sub.dropped:
        frames = sub.take()
        if frames:
            await resp.write(b"".join(frames))
            continue
        wake.clear()
        try:
            await asyncio.wait_for(wake.wait(), keepalive_s)
        except asyncio.TimeoutError:
            await resp.write(b": keep-alive\n\n")


def _since(log_: EventLog, job: str | None, since: int) -> web.Response:
    """The JSON variant: the held events after ``since``; ``gap`` true when
    some after it are no longer held; ``last_id`` to pass as the next ``since``."""
    replay, gap = log_.replay(since, job)
    replay = replay[:MAX_SINCE]
    last_id = replay[-1].id if replay else max(since, log_.next_id - 1)
    body = '{"events":[' + ",".join(e.data for e in replay) + "]"
    body += f',"gap":{json.dumps(gap is not None)},"last_id":{last_id}}}'
    return web.json_response(text=body)
