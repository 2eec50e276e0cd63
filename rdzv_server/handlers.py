"""Thin handlers: parse a request, call the store, return a response model.

Domain errors propagate as :class:`RdzvError` and become JSON in one place,
the error middleware of :mod:`rdzv_server.app`.
"""

from __future__ import annotations

import logging
from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from rdzv_common.errors import SUCCESSOR_HEADER
from rdzv_common.logs import Line
from rdzv_common.protocol import (
    DEFAULT_PAGE,
    MAX_BODY_BYTES,
    MAX_PAGE,
    CloseResult,
    CordonRequest,
    DeleteResult,
    ErrorBody,
    ErrorCode,
    Health,
    HealthReport,
    HostList,
    JobList,
    JobState,
    RequestError,
    is_valid_id,
    printable,
)

from . import rounds
from .agent_conn import AgentConn, short_error
from .cursors import node_page
from .keys import AUDIT, HEALTH_REPORTS, METRICS, OPENAPI, STORE
from .metrics import CONTENT_TYPE_LATEST
from .storage import HOSTS_KEY
from .ws_channel import MAX_ERRORS as MAX_ERRORS  # re-exported (tests read it here)
from .ws_inline import AgentSocket

log = logging.getLogger(__name__)


def _json(model: BaseModel, status: int = 200) -> web.Response:
    return web.json_response(text=model.model_dump_json(), status=status)


def _job_id(request: web.Request) -> str:
    job_id = request.match_info["job_id"]
    if not is_valid_id(job_id):
        raise RequestError(
            f"job id {job_id[:64]!r} is not valid: 1-128 characters of [A-Za-z0-9._:@+-]", ErrorCode.VALIDATION_ERROR
        )
    return job_id


def _page_params(request: web.Request) -> tuple[JobState | None, int, str | None]:
    q = request.rel_url.query
    state = None
    if "state" in q:
        try:
            state = JobState(q["state"])
        except ValueError:
            raise RequestError(
                f"state {q['state'][:64]!r} is not one of {', '.join(s.value for s in JobState)}",
                ErrorCode.VALIDATION_ERROR,
            ) from None
    limit, cursor = _limit(request)
    return state, limit, cursor


async def list_jobs(request: web.Request) -> web.Response:
    state, limit, cursor = _page_params(request)
    order = request.rel_url.query.get("order", "oldest")
    if order not in ("oldest", "newest"):
        raise RequestError(f"order {order[:64]!r} is not oldest or newest", ErrorCode.VALIDATION_ERROR)
    jobs, next_cursor = request.app[STORE].reads.summaries(state, limit, cursor, newest=order == "newest")
    return _json(JobList(jobs=jobs, next_cursor=next_cursor))


async def get_job(request: web.Request) -> web.Response:
    job_id = _job_id(request)
    limit, offset = node_page(request.rel_url.query, rounds.MAX_VIEW_NODES)
    return _json(request.app[STORE].reads.view(job_id, limit, offset))


async def close_job(request: web.Request) -> web.Response:
    job_id = _job_id(request)
    if request.can_read_body:
        body = await request.read()
        if body.strip() not in (b"", b"{}"):
            raise RequestError("close takes no body (or an empty JSON object)", ErrorCode.VALIDATION_ERROR)
    store = request.app[STORE]
    was_open = job_id in store.jobs and not store.jobs[job_id].finished
    job = store.close_job(job_id)
    await store.flushed(job_id)
    if was_open and job.finished:
        request.app[AUDIT].event("close", f"job {job_id} closed on request from {printable(request.remote)}")
    return _json(CloseResult(job_id=job.job_id, state=job.state))


async def delete_job(request: web.Request) -> web.Response:
    store = request.app[STORE]
    job = store.retention.delete_job(_job_id(request))
    await store.flushed(job.job_id)
    request.app[AUDIT].event(
        "delete", f"job {job.job_id} ({job.state.value}) deleted on request from {printable(request.remote)}"
    )
    return _json(DeleteResult(job_id=job.job_id, state=job.state))


_M = TypeVar("_M", bound=BaseModel)


def _limit(request: web.Request) -> tuple[int, str | None]:
    """``?limit=&cursor=`` of a listing (jobs, hosts): (limit, cursor or None)."""
    q = request.rel_url.query
    limit = DEFAULT_PAGE
    if "limit" in q:
        text = q["limit"]
        if not (text.isascii() and text.isdigit() and len(text) <= 6 and 1 <= int(text) <= MAX_PAGE):
            raise RequestError(
                f"limit {text[:64]!r} is not a whole number from 1 to {MAX_PAGE}", ErrorCode.VALIDATION_ERROR
            )
        limit = int(text)
    return limit, q.get("cursor") or None  # an empty cursor: the first page


async def _body(request: web.Request, model: type[_M]) -> _M:
    """The JSON body as ``model``, or one validation error line (changes nothing)."""
    raw = await request.read()
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as e:
        raise RequestError(short_error(e), ErrorCode.VALIDATION_ERROR) from None


async def list_hosts(request: web.Request) -> web.Response:
    limit, cursor = _limit(request)
    hosts, next_cursor = request.app[STORE].host_side.host_views(limit, cursor)
    return _json(HostList(hosts=hosts, next_cursor=next_cursor))


async def get_host(request: web.Request) -> web.Response:
    return _json(request.app[STORE].host_side.host_view(request.match_info["host"]))


async def cordon_host(request: web.Request) -> web.Response:
    host = request.match_info["host"]
    req = await _body(request, CordonRequest)
    view = request.app[STORE].host_side.cordon(host, req.reason, req.ttl_s, req.drain)
    await request.app[STORE].flushed(HOSTS_KEY)
    ttl = f" for {req.ttl_s:g}s" if req.ttl_s is not None else ""
    text = (
        f"host {printable(host)} cordoned{ttl}{' with drain' if req.drain else ''} "
        f"on request from {printable(request.remote)}: {printable(req.reason)}"
    )
    line = Line(text, "host_cordoned", host=host, reason=req.reason, ttl_s=req.ttl_s, drain=req.drain)
    request.app[AUDIT].event("cordon", line)
    return _json(view)


async def uncordon_host(request: web.Request) -> web.Response:
    host = request.match_info["host"]
    if request.can_read_body:
        body = await request.read()
        if body.strip() not in (b"", b"{}"):
            raise RequestError("uncordon takes no body (or an empty JSON object)", ErrorCode.VALIDATION_ERROR)
    view = request.app[STORE].host_side.uncordon(host)
    await request.app[STORE].flushed(HOSTS_KEY)
    text = f"host {printable(host)} uncordoned on request from {printable(request.remote)}"
    request.app[AUDIT].event("uncordon", Line(text, "host_uncordoned", host=host))
    return _json(view)


async def report_health(request: web.Request) -> web.Response:
    host = request.match_info["host"]
    req = await _body(request, HealthReport)
    reports, remote = request.app[HEALTH_REPORTS], request.remote or "?"
    if not reports.take(remote):  # one address cannot cool down hosts at line rate
        why = (
            f"too many health reports from {printable(remote, 64)} (a burst of {reports.burst:g}, then one "
            f"per {1 / reports.rate:g}s); not recorded: retry later"
        )
        body = ErrorBody(code=ErrorCode.RATE_LIMITED, message=why).model_dump_json()
        return web.json_response(text=body, status=429, headers={"Retry-After": reports.retry_after(remote)})
    view = request.app[STORE].host_side.report_health(host, req.job_id, req.reason)
    await request.app[STORE].flushed(HOSTS_KEY)
    return _json(view)


async def healthz(request: web.Request) -> web.Response:
    store = request.app[STORE]
    r = store.replica
    if r is None:
        return _json(Health(jobs=len(store.jobs), nodes=store.reads.live_nodes()))
    role = "leader" if store.serving else "follower"
    nodes = store.reads.live_nodes()
    return _json(Health(jobs=len(store.jobs), nodes=nodes, role=role, leader=r.leader_url, successor=r.successor_url))


async def metrics(request: web.Request) -> web.Response:
    store = request.app[STORE]
    if store.replica is not None:
        request.app[METRICS].set_leader(store.serving)
    request.app[METRICS].set_progress(store.reads.since_progress())
    request.app[METRICS].set_storage_requests(store.backend.requests)
    request.app[METRICS].refresh(store.jobs.values(), store.hosts, store.clock())
    body = await request.app[METRICS].render_off_loop()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(request.app[OPENAPI])


# ----------------------------------------------------------- agent channel


async def agent_channel(request: web.Request) -> web.WebSocketResponse:
    """The agent's WebSocket through aiohttp (rdzv_server.agent_conn has its rules;
    rdzv_server.upgrade takes most upgrades before aiohttp sees them)."""
    ws = AgentSocket(max_msg_size=MAX_BODY_BYTES, autoping=True, heartbeat=None)
    if successor := request.app[STORE].successor_url:  # (HA) where its agents go first when it goes
        ws.headers[SUCCESSOR_HEADER] = successor
    await ws.prepare(request)
    await AgentConn.serve(request.app, ws, request.transport, request.remote)
    return ws
