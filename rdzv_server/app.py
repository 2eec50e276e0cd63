"""create_app(settings): the aiohttp application, its routes and middlewares."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler
from pydantic.json_schema import models_json_schema

from rdzv_common import __version__
from rdzv_common.protocol import (
    AGENT_PATH,
    DEFAULT_PAGE,
    HOST_PATTERN,
    ID_PATTERN,
    LEADER_HEADER,
    MAX_BODY_BYTES,
    MAX_ID_LEN,
    MAX_PAGE,
    CloseResult,
    CordonRequest,
    DeleteResult,
    ErrorBody,
    ErrorCode,
    Health,
    HealthReport,
    HostList,
    HostView,
    JobList,
    JobState,
    JobView,
    RdzvError,
    printable,
)
from rdzv_common.tasks import cancel_and_wait

from . import auth, handlers, rounds, sse, ui
from .audit import Audit
from .auth import Auth
from .auth import error as _error
from .conns import DEFAULT_BODY_TIMEOUT_S, body_deadline
from .cursors import MAX_CURSOR_LEN
from .events import (
    DEFAULT_MAX_STREAMS,
    DEFAULT_MAX_STREAMS_PER_ADDR,
    DEFAULT_QUEUE,
    DEFAULT_QUEUE_BYTES,
    DEFAULT_RING,
    DEFAULT_RING_BYTES,
    DEFAULT_WRITE_TIMEOUT_S,
    EventLog,
)
from .guesses import GuessThrottle
from .ha import HASettings
from .hosts import HostRules
from .keys import (
    AUDIT,
    AUTH,
    EVENTS,
    EVENTS_KEEPALIVE,
    GUESSES,
    HEALTH_REPORTS,
    IDLE_TIMEOUT,
    JOIN_DEADLINE,
    METRICS,
    OPENAPI,
    STORE,
)
from .metrics import Metrics
from .quotas import (
    DEFAULT_WAITING_JOBS_PER_ADDRESS,
    HEALTH_REPORT_BURST,
    HEALTH_REPORT_EVERY_S,
    AddressBuckets,
)
from .store import Store
from .store_settings import (
    DEFAULT_DISCONNECT_GRACE_S,
    DEFAULT_MAX_WAITING_JOBS,
    DEFAULT_MIN_FREE_DISK,
    DEFAULT_RETAIN_FINISHED_S,
    StoreSettings,
)

log = logging.getLogger(__name__)

DEFAULT_JOIN_DEADLINE_S = 10.0
# A joined agent WebSocket that sends nothing for this long is closed, whatever its job's heartbeat
# timeout (a client sets that, up to days). Agents send a heartbeat every 2 s at most (wire.heartbeat_every).
DEFAULT_IDLE_TIMEOUT_S = 60.0
MIN_IDLE_TIMEOUT_S = 10.0  # five heartbeat intervals: a flag below it would close real agents


@dataclass
class Settings:
    data_dir: Path | None = None
    token: str | None = None
    operator_token: str | None = None  # with it, close/delete/cordon/uncordon need it (rdzv_server.auth)
    listen_host: str = "127.0.0.1"  # where the server listens: without a token on loopback, Host is checked
    disconnect_grace_s: float = DEFAULT_DISCONNECT_GRACE_S
    join_deadline_s: float = DEFAULT_JOIN_DEADLINE_S
    retain_finished_s: float = DEFAULT_RETAIN_FINISHED_S
    max_waiting_jobs: int = DEFAULT_MAX_WAITING_JOBS
    waiting_jobs_per_address: int = DEFAULT_WAITING_JOBS_PER_ADDRESS  # 0: no limit of its own
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S  # a joined agent WebSocket that sends nothing is closed
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S  # a request body must arrive whole within this
    min_free_disk: int = DEFAULT_MIN_FREE_DISK
    host_rules: HostRules = field(default_factory=HostRules)
    event_ring: int = DEFAULT_RING  # events kept for Last-Event-ID replay
    event_queue: int = DEFAULT_QUEUE  # events queued per stream; a stream that falls this far behind is dropped
    max_event_streams: int = DEFAULT_MAX_STREAMS  # event streams open at once
    event_ring_bytes: int = DEFAULT_RING_BYTES  # bytes of events kept (oldest go first)
    event_queue_bytes: int = DEFAULT_QUEUE_BYTES  # bytes queued per stream; beyond, the stream is dropped
    max_event_streams_per_addr: int = DEFAULT_MAX_STREAMS_PER_ADDR  # event streams open from one address
    event_write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S  # a stream whose socket does not drain is dropped
    event_keepalive_s: float = 15.0  # a comment line on a quiet stream this often
    ha: HASettings | None = None  # --etcd: an HA replica (rdzv_server.ha); then data_dir is None
    store_settings: StoreSettings = field(init=False)

    def __post_init__(self) -> None:
        self.store_settings = StoreSettings(
            data_dir=self.data_dir,
            disconnect_grace_s=self.disconnect_grace_s,
            retain_finished_s=self.retain_finished_s,
            max_waiting_jobs=self.max_waiting_jobs,
            waiting_jobs_per_address=self.waiting_jobs_per_address,
            min_free_disk=self.min_free_disk,
            host_rules=self.host_rules,
        )


_HTTP_CODES = {
    400: ErrorCode.BAD_REQUEST,
    401: ErrorCode.UNAUTHORIZED,
    404: ErrorCode.NOT_FOUND,
    405: ErrorCode.METHOD_NOT_ALLOWED,
    413: ErrorCode.BODY_TOO_LARGE,
}


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Domain errors and aiohttp's own HTTP errors become {"code", "message"}."""
    try:
        return await handler(request)
    except RdzvError as e:
        return _error(e.code, e.message, e.status)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        code = _HTTP_CODES.get(e.status, ErrorCode.BAD_REQUEST)
        message = e.text if e.text and not e.text.startswith(str(e.status)) else e.reason
        if e.status == 413:
            message = f"request body is larger than the limit of {MAX_BODY_BYTES} bytes"
        elif e.status == 404:
            message = f"no such path: {request.method} {printable(request.path, 200)}"
        elif e.status == 405:
            message = f"method {request.method} is not allowed on {printable(request.path, 200)}"
        headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        return _error(code, message, e.status, headers)


# What a replica that is not the leader still answers itself (everything else: not_leader).
_ANY_REPLICA = frozenset({"/healthz", "/metrics", "/openapi.json"})


@web.middleware
async def leader_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """An HA replica serves only while it leads (rdzv_server.ha); otherwise
    503 not_leader, naming the leader in LEADER_HEADER when it knows one."""
    store = request.app[STORE]
    if store.replica is None or store.serving or request.path in _ANY_REPLICA:
        return await handler(request)
    e = store.replica.refusal()
    if e.leader and request.method == "GET" and (request.path == "/" or request.path.startswith("/ui")):
        # a person's browser on a follower: the dashboard is on the leader
        raise web.HTTPTemporaryRedirect(e.leader + request.rel_url.path_qs, headers={LEADER_HEADER: e.leader})
    return _error(e.code, e.message, e.status, {LEADER_HEADER: e.leader} if e.leader else None)


@web.middleware
async def latency_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    start = time.perf_counter()
    # not the agent channel nor an event stream: they last as long as their client
    # (an event stream's handler ends when its client goes; a ?since= answer is a request)
    streams = request.path == AGENT_PATH or (
        request.match_info.handler is sse.events and "since" not in request.rel_url.query
    )
    try:
        return await handler(request)
    finally:
        if not streams:
            route = request.match_info.route.resource.canonical if request.match_info.route.resource else "other"
            request.app[METRICS].latency.labels(route).observe(time.perf_counter() - start)


def openapi_document() -> dict[str, Any]:
    """The REST contract, generated from the pydantic models (OpenAPI 3.1: its
    schemas are JSON Schema 2020-12, which is what pydantic emits)."""
    _, defs = models_json_schema(
        [
            (m, "serialization")
            for m in (JobList, JobView, CloseResult, DeleteResult, Health, ErrorBody, HostList, HostView)
        ]
        + [(m, "validation") for m in (CordonRequest, HealthReport)],
        ref_template="#/components/schemas/{model}",
    )
    schemas = defs.get("$defs", {})

    def ref(name: str) -> dict[str, str]:
        return {"$ref": f"#/components/schemas/{name}"}

    def resp(name: str, desc: str = "OK") -> dict[str, Any]:
        return {"description": desc, "content": {"application/json": {"schema": ref(name)}}}

    errors = {str(s): resp("ErrorBody", "refused") for s in (400, 401, 403, 404, 405, 409, 413, 422, 429, 503)}
    job_param = {
        "name": "job_id",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "minLength": 1, "maxLength": MAX_ID_LEN, "pattern": ID_PATTERN},
    }
    page_params = [
        {
            "name": "state",
            "in": "query",
            "required": False,
            "description": "only jobs in this state",
            "schema": {"type": "string", "enum": [s.value for s in JobState]},
        },
        {
            "name": "limit",
            "in": "query",
            "required": False,
            "description": "jobs per page",
            "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE, "default": DEFAULT_PAGE},
        },
        {
            "name": "cursor",
            "in": "query",
            "required": False,
            "description": "the next_cursor of the previous page, unchanged",
            "schema": {"type": "string", "maxLength": MAX_CURSOR_LEN},
        },
        {
            "name": "order",
            "in": "query",
            "required": False,
            "description": "by creation time: oldest first, or newest first",
            "schema": {"type": "string", "enum": ["oldest", "newest"], "default": "oldest"},
        },
    ]
    host_param = {
        "name": "host",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "minLength": 1, "maxLength": 255, "pattern": HOST_PATTERN},
    }
    host_page = [page_params[1], page_params[2]]
    view_page = [
        {
            **page_params[1],
            "description": "nodes per page",
            "schema": {
                "type": "integer",
                "minimum": 1,
                "maximum": rounds.MAX_VIEW_NODES,
                "default": rounds.MAX_VIEW_NODES,
            },
        },
        page_params[2],
    ]

    def body(name: str) -> dict[str, Any]:
        return {"required": True, "content": {"application/json": {"schema": ref(name)}}}

    secured: list[dict[str, list[str]]] = [{"bearer": []}]
    job_errors = {"401": errors["401"], "404": errors["404"], "422": errors["422"]}
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "rdzv",
            "version": __version__,
            "description": "Rendezvous server for elastic PyTorch training. Agents use the "
            f"WebSocket at {AGENT_PATH}; see rdzv_common/protocol.py.",
        },
        "components": {"schemas": schemas, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": {
            "/v1/jobs": {
                "get": {
                    "operationId": "listJobs",
                    "security": secured,
                    "parameters": page_params,
                    "description": "Jobs in creation order, one page at a time.",
                    "responses": {"200": resp("JobList"), "401": errors["401"], "422": errors["422"]},
                }
            },
            "/v1/jobs/{job_id}": {
                "get": {
                    "operationId": "getJob",
                    "security": secured,
                    "parameters": [job_param, *view_page],
                    "description": "The job; its nodes a page at a time (members by rank, then the others, spares "
                    "last), all of them counted by state in node_counts.",
                    "responses": {"200": resp("JobView"), **job_errors},
                },
                "delete": {
                    "operationId": "deleteJob",
                    "security": secured,
                    "parameters": [job_param],
                    "description": "Forget a finished job; a live one is refused (409): close it first.",
                    "responses": {
                        "200": resp("DeleteResult"),
                        **job_errors,
                        "409": errors["409"],
                        "503": errors["503"],
                    },
                },
            },
            "/v1/jobs/{job_id}/close": {
                "post": {
                    "operationId": "closeJob",
                    "security": secured,
                    "parameters": [job_param],
                    "responses": {"200": resp("CloseResult"), **job_errors, "503": errors["503"]},
                }
            },
            "/v1/hosts": {
                "get": {
                    "operationId": "listHosts",
                    "security": secured,
                    "parameters": host_page,
                    "description": "Host records (failures, cool-downs, cordons) by host name, one page at a time.",
                    "responses": {"200": resp("HostList"), "401": errors["401"], "422": errors["422"]},
                }
            },
            "/v1/hosts/{host}": {
                "get": {
                    "operationId": "getHost",
                    "security": secured,
                    "parameters": [host_param],
                    "responses": {"200": resp("HostView"), **job_errors},
                }
            },
            "/v1/hosts/{host}/cordon": {
                "post": {
                    "operationId": "cordonHost",
                    "security": secured,
                    "parameters": [host_param],
                    "requestBody": body("CordonRequest"),
                    "description": "No new admissions from the host (joins wait as spares, told why); drain: its "
                    "running nodes are replaced at once.",
                    "responses": {"200": resp("HostView"), **job_errors, "503": errors["503"]},
                }
            },
            "/v1/hosts/{host}/uncordon": {
                "post": {
                    "operationId": "uncordonHost",
                    "security": secured,
                    "parameters": [host_param],
                    "description": "Lift the host's cordon and any cool-down.",
                    "responses": {"200": resp("HostView"), **job_errors, "503": errors["503"]},
                }
            },
            "/v1/hosts/{host}/health": {
                "post": {
                    "operationId": "reportHealth",
                    "security": secured,
                    "parameters": [host_param],
                    "requestBody": body("HealthReport"),
                    "description": "An agent's health check failed on the host: recorded as a failure of the host.",
                    "responses": {"200": resp("HostView"), **job_errors, "503": errors["503"]},
                }
            },
            "/healthz": {"get": {"operationId": "health", "responses": {"200": resp("Health")}}},
            "/metrics": {
                "get": {
                    "operationId": "metrics",
                    "security": secured,
                    "responses": {
                        "200": {
                            "description": "Prometheus text format",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        },
                        "401": errors["401"],
                    },
                }
            },
        },
    }
    # wherever a wrong token is answered 401, too many of them from one address are answered 429,
    # and a cross-site page, a wrong Host or a missing role 403 (rdzv_server.auth)
    for ops in doc["paths"].values():
        for op in ops.values():
            if "401" in op.get("responses", {}):
                op["responses"]["429"] = errors["429"]
                op["responses"]["403"] = errors["403"]
    for method, path in auth.OPERATOR_ROUTES:
        op = doc["paths"][path][method.lower()]
        op["description"] = (op.get("description", "") + " Needs the operator token when one is set.").strip()
    return doc


def create_app(settings: Settings | None = None) -> web.Application:
    """The server as an aiohttp application; the store opens on startup
    (raising DataDirError if its data cannot be used)."""
    settings = settings or Settings()
    audit = Audit()
    guard = Auth(settings.token, settings.operator_token, settings.listen_host, audit)
    app = web.Application(
        client_max_size=MAX_BODY_BYTES,
        middlewares=[
            error_middleware,
            auth.middleware(guard, ui.public),
            body_deadline(settings.body_timeout_s),
            leader_middleware,
            latency_middleware,
        ],
    )
    app[AUTH] = guard
    metrics = Metrics()
    app[METRICS] = metrics
    events = EventLog(
        ring=settings.event_ring,
        queue=settings.event_queue,
        max_streams=settings.max_event_streams,
        ring_bytes=settings.event_ring_bytes,
        queue_bytes=settings.event_queue_bytes,
        max_streams_per_addr=settings.max_event_streams_per_addr,
        write_timeout_s=settings.event_write_timeout_s,
    )
    app[STORE] = Store(settings.store_settings, metrics=metrics, events=events)
    if settings.ha is not None:
        replica = settings.ha.replica()
        app[STORE].use_replica(replica)
        metrics.watch_request_bytes(lambda: replica.client.max_request_bytes)
    app[JOIN_DEADLINE] = settings.join_deadline_s
    app[IDLE_TIMEOUT] = settings.idle_timeout_s
    app[HEALTH_REPORTS] = AddressBuckets(HEALTH_REPORT_BURST, 1.0 / HEALTH_REPORT_EVERY_S)
    app[OPENAPI] = openapi_document()
    app[AUDIT] = audit
    app[GUESSES] = GuessThrottle()
    app[EVENTS] = events
    app[EVENTS_KEEPALIVE] = settings.event_keepalive_s
    app.on_shutdown.append(_end_streams)
    app.cleanup_ctx.append(_store_ctx)
    app.cleanup_ctx.append(_audit_ctx)
    app.router.add_get("/v1/jobs", handlers.list_jobs)
    app.router.add_get("/v1/jobs/{job_id}", handlers.get_job)
    app.router.add_delete("/v1/jobs/{job_id}", handlers.delete_job)
    app.router.add_post("/v1/jobs/{job_id}/close", handlers.close_job)
    app.router.add_get("/v1/hosts", handlers.list_hosts)
    app.router.add_get("/v1/hosts/{host}", handlers.get_host)
    app.router.add_post("/v1/hosts/{host}/cordon", handlers.cordon_host)
    app.router.add_post("/v1/hosts/{host}/uncordon", handlers.uncordon_host)
    app.router.add_post("/v1/hosts/{host}/health", handlers.report_health)
    app.router.add_get("/healthz", handlers.healthz)
    app.router.add_get("/metrics", handlers.metrics)
    app.router.add_get("/openapi.json", handlers.openapi)
    app.router.add_get(AGENT_PATH, handlers.agent_channel)
    app.router.add_get("/v1/events", sse.events)
    app.router.add_get("/v1/jobs/{job_id}/events", sse.events)
    app.router.add_get("/", ui.root)
    app.router.add_get("/ui", ui.page)
    app.router.add_get("/ui/", ui.page)
    app.router.add_get("/ui/jobs/{job_id}", ui.page)
    app.router.add_get("/ui/hosts", ui.page)
    app.router.add_get("/ui/static/{name}", ui.static)
    app.router.add_post("/ui/login", ui.login)
    app.router.add_post("/ui/logout", ui.logout)
    return app


async def _end_streams(app: web.Application) -> None:
    """Shutdown: event streams end now instead of holding the server for its shutdown timeout."""
    app[EVENTS].close_all()


async def _store_ctx(app: web.Application) -> AsyncIterator[None]:
    store = app[STORE]
    if store.replica is not None:  # HA: the store opens when this replica is elected
        await store.replica.start()
        yield
        await store.replica.stop()
        await store.stop()
        return
    store.open()
    await store.start()
    yield
    await store.stop()


async def _audit_ctx(app: web.Application) -> AsyncIterator[None]:
    """Say what the audit log suppressed once its window is over, even if all went quiet."""
    audit = app[AUDIT]

    async def flush_every_second() -> None:
        while True:
            await asyncio.sleep(1.0)
            audit.flush()

    task = asyncio.create_task(flush_every_second(), name="rdzv-audit")
    yield
    await cancel_and_wait(task)
    audit.flush()
