"""Thin handlers: parse a request, call the store, return a response model.

Domain errors propagate as :class:`RdzvError` and become JSON in one place,
the error middleware of :mod:`rdzv_server.app`.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import WSMsgType, web
from pydantic import ValidationError

from .keys import AUDIT, METRICS, OPENAPI, STORE
from .metrics import CONTENT_TYPE_LATEST
from .protocol import (
    AGENT_MESSAGE,
    MAX_BODY_BYTES,
    AckMsg,
    CloseResult,
    ErrorCode,
    ErrorMsg,
    FailedMsg,
    Health,
    HeartbeatMsg,
    JobList,
    JoinMsg,
    LeaveMsg,
    NotJoinedError,
    RdzvError,
    RequestError,
    SucceededMsg,
    is_valid_id,
    printable,
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


async def list_jobs(request: web.Request) -> web.Response:
    return _json(JobList(jobs=request.app[STORE].summaries()))


async def get_job(request: web.Request) -> web.Response:
    return _json(request.app[STORE].view(_job_id(request)))


async def close_job(request: web.Request) -> web.Response:
    job_id = _job_id(request)
    if request.can_read_body:
        body = await request.read()
        if body.strip() not in (b"", b"{}"):
            raise RequestError("close takes no body (or an empty JSON object)", ErrorCode.VALIDATION_ERROR)
    store = request.app[STORE]
    was_open = job_id in store.jobs and not store.jobs[job_id].finished
    job = store.close_job(job_id)
    if was_open and job.finished:
        request.app[AUDIT].event("close", f"job {job_id} closed on request from {printable(request.remote)}")
    return _json(CloseResult(job_id=job.job_id, state=job.state))


async def healthz(request: web.Request) -> web.Response:
    store = request.app[STORE]
    return _json(Health(jobs=len(store.jobs), nodes=store.live_nodes()))


async def metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS].render()
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
                if isinstance(msg, JoinMsg):
                    request.app[AUDIT].event(
                        "join", f"join refused: job {msg.job_id} node {msg.node_id} from "
                                f"{printable(request.remote)}: {e.code.value}: {e.message}")
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
