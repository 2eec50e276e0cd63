"""Thin handlers: parse a request, call the store, return a response model.

Domain errors propagate as :class:`RdzvError` and become JSON in one place,
the error middleware of :mod:`rdzv_server.app`.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import WSMsgType, web
from pydantic import ValidationError

from .keys import METRICS, OPENAPI, STORE
from .metrics import CONTENT_TYPE_LATEST
from .protocol import (
    AGENT_MESSAGE,
    MAX_BODY_BYTES,
    DEFAULT_PAGE,
    MAX_PAGE,
    AckMsg,
    CloseResult,
    DeleteResult,
    ErrorCode,
    ErrorMsg,
    FailedMsg,
    Health,
    HeartbeatMsg,
    JobList,
    JobState,
    JoinMsg,
    LeaveMsg,
    NotJoinedError,
    RdzvError,
    RequestError,
    SucceededMsg,
    is_valid_id,
)

log = logging.getLogger(__name__)


def _json(model, status: int = 200) -> web.Response:
    return web.json_response(text=model.model_dump_json(), status=status)


def _job_id(request: web.Request) -> str:
    job_id = request.match_info["job_id"]
    if not is_valid_id(job_id):
        raise RequestError(f"job id {job_id[:64]!r} is not valid: 1-128 characters of [A-Za-z0-9._:@+-]",
                           ErrorCode.VALIDATION_ERROR)
    return job_id


def _page_params(request: web.Request) -> tuple[JobState | None, int, str | None]:
    q = request.rel_url.query
    state = None
    if "state" in q:
        try:
            state = JobState(q["state"])
        except ValueError:
            raise RequestError(f"state {q['state'][:64]!r} is not one of "
                               f"{', '.join(s.value for s in JobState)}", ErrorCode.VALIDATION_ERROR) from None
    limit = DEFAULT_PAGE
    if "limit" in q:
        text = q["limit"]
        if not (text.isascii() and text.isdigit() and len(text) <= 6 and 1 <= int(text) <= MAX_PAGE):
            raise RequestError(f"limit {text[:64]!r} is not a whole number from 1 to {MAX_PAGE}",
                               ErrorCode.VALIDATION_ERROR)
        limit = int(text)
    return state, limit, q.get("cursor") or None  # an empty cursor: the first page


async def list_jobs(request: web.Request) -> web.Response:
    state, limit, cursor = _page_params(request)
    jobs, next_cursor = request.app[STORE].summaries(state, limit, cursor)
    return _json(JobList(jobs=jobs, next_cursor=next_cursor))


async def get_job(request: web.Request) -> web.Response:
    return _json(request.app[STORE].view(_job_id(request)))


async def close_job(request: web.Request) -> web.Response:
    job_id = _job_id(request)
    if request.can_read_body:
        body = await request.read()
        if body.strip() not in (b"", b"{}"):
            raise RequestError("close takes no body (or an empty JSON object)", ErrorCode.VALIDATION_ERROR)
    job = request.app[STORE].close_job(job_id)
    return _json(CloseResult(job_id=job.job_id, state=job.state))


async def delete_job(request: web.Request) -> web.Response:
    job = request.app[STORE].delete_job(_job_id(request))
    return _json(DeleteResult(job_id=job.job_id, state=job.state))


async def healthz(request: web.Request) -> web.Response:
    store = request.app[STORE]
    return _json(Health(jobs=len(store.jobs), nodes=store.live_nodes()))


async def metrics(request: web.Request) -> web.Response:
    body = await request.app[METRICS].render_off_loop()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(request.app[OPENAPI])


# ----------------------------------------------------------- agent channel

_HB_FRAME = '{"op":"hb"}'


class WsChannel:
    """One agent's connection: messages queue up and a writer task sends them,
    so one slow agent never holds up the others."""

    def __init__(self, ws: web.WebSocketResponse) -> None:
        self.ws = ws
        self.queue: asyncio.Queue[str | None] = asyncio.Queue()
        self.writer = asyncio.create_task(self._write())

    def deliver(self, text: str) -> None:
        self.queue.put_nowait(text)

    def tell(self, msg) -> None:
        """Reply on this connection only (acks and errors)."""
        self.queue.put_nowait(msg.model_dump_json())

    def drop(self) -> None:
        self.queue.put_nowait(None)

    async def _write(self) -> None:
        try:
            while (text := await self.queue.get()) is not None:
                await self.ws.send_str(text)
            await self.ws.close()
        except (ConnectionError, RuntimeError, asyncio.CancelledError):
            pass


async def agent_channel(request: web.Request) -> web.WebSocketResponse:
    """The agent's WebSocket: join, heartbeats, reports in; assignments out."""
    store = request.app[STORE]
    counter = request.app[METRICS].agent_messages
    ws = web.WebSocketResponse(max_msg_size=MAX_BODY_BYTES, autoping=True, heartbeat=None)
    await ws.prepare(request)
    chan = WsChannel(ws)
    bound: tuple[str, str] | None = None
    try:
        async for frame in ws:
            if frame.type != WSMsgType.TEXT:
                if frame.type == WSMsgType.BINARY:
                    chan.tell(ErrorMsg(code=ErrorCode.BAD_REQUEST, message="send JSON text frames"))
                continue
            if frame.data == _HB_FRAME and bound is not None:  # the hot path: no parsing
                store.heartbeat(*bound)
                continue
            try:
                msg = AGENT_MESSAGE.validate_json(frame.data)
            except ValidationError as e:
                chan.tell(ErrorMsg(code=ErrorCode.VALIDATION_ERROR, message=_short(e)))
                continue
            counter.labels(msg.op).inc()
            try:
                bound = _dispatch(store, msg, bound, chan)
            except RdzvError as e:
                chan.tell(ErrorMsg(code=e.code, message=e.message))
    finally:
        if bound is not None:
            store.disconnected(*bound, chan)
        chan.drop()
        await asyncio.wait([chan.writer], timeout=1.0)
        chan.writer.cancel()
    return ws


def _dispatch(store, msg, bound, chan):
    if isinstance(msg, JoinMsg):
        if bound is not None and bound != (msg.job_id, msg.node_id):
            raise RequestError(f"this connection belongs to node {bound[1]!r} of job {bound[0]!r}",
                               ErrorCode.ALREADY_JOINED)
        store.join(msg, chan)
        return (msg.job_id, msg.node_id)
    if bound is None:
        raise NotJoinedError(f"send a join before {msg.op!r}")
    if isinstance(msg, HeartbeatMsg):
        store.heartbeat(*bound)
    elif isinstance(msg, FailedMsg):
        store.fail(*bound, msg.round, msg.failures)
        chan.tell(AckMsg(of="failed"))
    elif isinstance(msg, SucceededMsg):
        store.succeed(*bound, msg.round)
        chan.tell(AckMsg(of="succeeded"))
    elif isinstance(msg, LeaveMsg):
        store.leave(*bound, msg.reason, chan)
        chan.tell(AckMsg(of="leave"))
        return None
    return bound


def _short(e: ValidationError) -> str:
    parts = []
    for err in e.errors()[:5]:
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)[:1000]
