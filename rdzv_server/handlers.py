"""Thin handlers: parse a request, call the store, return a response model.

Domain errors propagate as :class:`RdzvError` and become JSON in one place,
the error middleware of :mod:`rdzv_server.app`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TypeVar

from aiohttp import WSCloseCode, WSMessage, WSMsgType, web
from pydantic import BaseModel, ValidationError

from rdzv_common.logs import Line
from rdzv_common.protocol import (
    AGENT_MESSAGE,
    DEFAULT_PAGE,
    HEARTBEAT_FRAME,
    MAX_BODY_BYTES,
    MAX_PAGE,
    AckMsg,
    AgentMessage,
    CloseResult,
    CordonRequest,
    DeleteResult,
    ErrorBody,
    ErrorCode,
    ErrorMsg,
    FailedMsg,
    Health,
    HealthReport,
    HeartbeatMsg,
    HostList,
    JobList,
    JobSecretMismatchError,
    JobState,
    JoinMsg,
    LeaveMsg,
    NotJoinedError,
    RdzvError,
    RequestError,
    SucceededMsg,
    SuspectMsg,
    is_valid_id,
    printable,
)

from . import rounds
from .cursors import node_page
from .keys import AUDIT, GUESSES, HEALTH_REPORTS, IDLE_TIMEOUT, JOIN_DEADLINE, METRICS, OPENAPI, STORE
from .metrics import CONTENT_TYPE_LATEST
from .quotas import FRAME_BURST, FRAME_RATE, TokenBucket
from .silence import Silence
from .storage import HOSTS_KEY
from .store import Store
from .ws_channel import MAX_ERRORS as MAX_ERRORS  # re-exported (tests read it here)
from .ws_channel import WsChannel, bug_log, close_log
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
        raise RequestError(_short(e), ErrorCode.VALIDATION_ERROR) from None


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
    return _json(Health(jobs=len(store.jobs), nodes=store.reads.live_nodes(), role=role, leader=r.leader_url))


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

_DONE_TYPES = (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED)


async def agent_channel(request: web.Request) -> web.WebSocketResponse:
    """The agent's WebSocket: join, heartbeats, reports in; assignments out.
    A connection that has not joined (yet, or since it left) within the join
    deadline is closed."""
    store = request.app[STORE]
    guesses = request.app[GUESSES]
    counted = request.app[METRICS].agent_message
    join_deadline, idle_s = request.app[JOIN_DEADLINE], request.app[IDLE_TIMEOUT]
    store.gc_hold.busy()  # a reconnect storm (a failover, a restart) is a round change's too
    ws = AgentSocket(max_msg_size=MAX_BODY_BYTES, autoping=True, heartbeat=None)
    await ws.prepare(request)
    chan = WsChannel(ws, request.transport, printable(request.remote, limit=64))
    bound: tuple[str, str] | None = None
    # the join deadline (fixed), then the idle timeout (from the last frame): one timer per
    # connection, not one per frame (rdzv_server.silence); the job's heartbeat timeout is the
    # client's to set (up to days): the idle timeout is not
    silence = Silence(join_deadline)
    frames = TokenBucket(FRAME_BURST, FRAME_RATE)

    close_next = False  # inline refused a message and the connection must close: the loop does it

    def handle(msg: AgentMessage, held: float) -> bool:
        """One valid message, taken by either path; False: close the connection
        (``held``: a job secret's guess was slowed: one guess per connection)."""
        nonlocal bound
        counted(msg.op)
        try:
            now_bound = _dispatch(store, msg, bound, chan)
        except RdzvError as e:
            if isinstance(msg, JoinMsg):
                request.app[AUDIT].event(
                    "join",
                    f"join refused: job {msg.job_id} node {msg.node_id} from "
                    f"{printable(request.remote)}: {e.code.value}: {e.message}",
                )
                if msg.job_secret and isinstance(e, JobSecretMismatchError):
                    guesses.wrong(msg.job_id, chan.peer)
                    if held:  # one guess per connection while slowed
                        chan.tell(ErrorMsg(code=e.code, message=f"{e.message} ({guesses.why})"))
                        return False
            return chan.refuse(ErrorMsg(code=e.code, message=e.message))
        if bound is not None and now_bound is None:  # it left: join again in time, or go
            silence.restart(join_deadline)
        elif bound is None and now_bound is not None:  # joined: the idle timeout from now on
            silence.restart(idle_s)
        bound = now_bound
        return True

    def handled(msg: AgentMessage, held: float) -> bool:
        """:func:`handle`, where a bug (anything but the RdzvError it answers) closes the connection,
        as on either path, saying so once in a while with its traceback; the agent reconnects."""
        nonlocal bound
        try:
            return handle(msg, held)
        except Exception:
            bug_log("an agent message (op %s) from %s failed: closing its connection", msg.op, chan.peer, exc_info=True)
            chan.close_code, chan.close_reason = WSCloseCode.INTERNAL_ERROR, f"the server failed on {msg.op!r}"
            if isinstance(msg, JoinMsg) and store.channels.get((msg.job_id, msg.node_id)) is chan:
                bound = (msg.job_id, msg.node_id)  # a join that failed once its channel was in: let it go below
            return False

    def inline(frame: WSMessage) -> bool:
        """The hot path, taken where the frame is parsed (rdzv_server.ws_inline): a joined
        node's frames (its heartbeats, a ping, its join again after ``restart``: at 16,384
        nodes a round change is 16,384 joins), and a new connection's join (a formation, or a
        failover's 16,384 resumes). False: the loop below takes the frame, as any other: one
        that does not parse (it says why), a guess to slow, any other frame before the join."""
        nonlocal close_next
        if not store.serving or not frames.take():
            return False
        if frame.type is WSMsgType.TEXT:
            if frame.data == HEARTBEAT_FRAME and bound is not None:
                silence.heard()
                store.heartbeat(*bound)
                return True
            try:
                msg = AGENT_MESSAGE.validate_json(frame.data)
            except ValidationError:
                return False
            if bound is None and not isinstance(msg, JoinMsg):
                return False
            if isinstance(msg, JoinMsg) and msg.job_secret and guesses.hold(msg.job_id, chan.peer):
                return False
            if bound is not None:  # (before the join, its deadline is fixed: frames do not move it)
                silence.heard()
            if not handled(msg, 0.0):
                close_next = True  # queued: the loop reads it next (nothing is taken behind it) and closes
                return False
            return True
        if frame.type is WSMsgType.PING and bound is not None and chan.pong(frame.data):
            silence.heard()
            return True
        return False

    ws.inline = inline
    try:
        while True:
            frame = await ws.receive()
            if close_next:
                break
            if bound is not None:
                silence.heard()
            if frame.type in _DONE_TYPES:
                break
            if not frames.take():  # far more frames than any agent sends: each one costs the loop
                chan.close_code = WSCloseCode.POLICY_VIOLATION
                chan.close_reason = f"more than {FRAME_BURST} frames at over {FRAME_RATE:g}/s"
                close_log("closing agent connection from %s: %s", chan.peer, chan.close_reason)
                break
            if not store.serving:  # an HA replica that stopped leading: its agents go to the new leader
                break
            if frame.type != WSMsgType.TEXT:
                if frame.type == WSMsgType.BINARY and not chan.refuse(
                    ErrorMsg(code=ErrorCode.BAD_REQUEST, message="send JSON text frames")
                ):
                    break
                continue
            if frame.data == HEARTBEAT_FRAME and bound is not None:  # the hot path: no parsing
                store.heartbeat(*bound)
                continue
            try:
                msg = AGENT_MESSAGE.validate_json(frame.data)
            except ValidationError as e:
                if not chan.refuse(ErrorMsg(code=ErrorCode.VALIDATION_ERROR, message=_short(e))):
                    break
                continue
            # a job secret: guessing it is slowed (rdzv_server.guesses); the right one is never refused
            held = guesses.hold(msg.job_id, chan.peer) if isinstance(msg, JoinMsg) and msg.job_secret else 0.0
            if held:
                await asyncio.sleep(held)
                if not store.serving:
                    break
            if not handled(msg, held):
                break
    except asyncio.CancelledError:
        if not silence.caught():
            raise
        # a close frame that says why, not an error message: an agent just reconnects,
        # as after any closed connection
        chan.close_code = WSCloseCode.POLICY_VIOLATION
        chan.close_reason = (
            f"no join within {join_deadline:g}s" if bound is None else f"nothing received for {idle_s:g}s"
        )
        close_log("closing agent connection from %s: %s", chan.peer, chan.close_reason)
    finally:
        ws.inline = None
        silence.stop()
        if bound is not None:
            store.disconnected(*bound, chan)
        chan.drop()
        if not await chan.closed(1.0):  # the close did not go through (an agent that does not read): cut it
            chan.abort()
    return ws


def _dispatch(
    store: Store, msg: AgentMessage, bound: tuple[str, str] | None, chan: WsChannel
) -> tuple[str, str] | None:
    if isinstance(msg, JoinMsg):
        if bound is not None and bound != (msg.job_id, msg.node_id):
            raise RequestError(
                f"this connection belongs to node {bound[1]!r} of job {bound[0]!r}", ErrorCode.ALREADY_JOINED
            )
        store.join(msg, chan)
        return (msg.job_id, msg.node_id)
    if bound is None:
        raise NotJoinedError(f"send a join before {msg.op!r}")
    if isinstance(msg, HeartbeatMsg):
        lag = tuple(msg.nccl_lag) if msg.nccl_lag is not None else None  # (): none lags any more
        store.heartbeat(*bound, msg.step, msg.rate, tuple(msg.timings) if msg.timings else None, lag)
    elif isinstance(msg, FailedMsg):
        store.fail(*bound, msg.round, msg.failures, give_up=msg.give_up)
        store.reply(bound[0], chan, AckMsg(of="failed"))  # after what the report caused is persisted
    elif isinstance(msg, SucceededMsg):
        store.succeed(*bound, msg.round)
        store.reply(bound[0], chan, AckMsg(of="succeeded"))
    elif isinstance(msg, LeaveMsg):
        store.leave(*bound, msg.reason, chan)
        store.reply(bound[0], chan, AckMsg(of="leave"))
        return None
    elif isinstance(msg, SuspectMsg):  # a reason to probe the suspects, never more (rdzv_server.suspicion)
        store.suspicion.report(*bound, msg.round, msg.nodes)
    return bound


def _short(e: ValidationError) -> str:
    parts = []
    for err in e.errors()[:5]:
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)[:1000]
