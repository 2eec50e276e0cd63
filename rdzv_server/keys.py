"""Every aiohttp AppKey of the server, in one place."""

from aiohttp import web

from .audit import Audit
from .auth import Auth
from .events import EventLog
from .guesses import GuessThrottle
from .metrics import Metrics
from .quotas import AddressBuckets
from .store import Store

STORE = web.AppKey("store", Store)
METRICS = web.AppKey("metrics", Metrics)
OPENAPI = web.AppKey("openapi", dict)
AUTH = web.AppKey("auth", Auth)  # tokens, roles, /ui sessions, the wrong-token throttle (rdzv_server.auth)
JOIN_DEADLINE = web.AppKey("join_deadline", float)  # seconds a new agent WebSocket has to join
AUDIT = web.AppKey("audit", Audit)
EVENTS = web.AppKey("events", EventLog)  # the event log behind /v1/events
EVENTS_KEEPALIVE = web.AppKey("events_keepalive", float)  # seconds between keep-alive comments on a quiet stream
GUESSES = web.AppKey("guesses", GuessThrottle)  # wrong job secrets per job id and address (joins slowed past the limit)
IDLE_TIMEOUT = web.AppKey("idle_timeout", float)  # seconds a joined agent WebSocket may send nothing
HEALTH_REPORTS = web.AppKey("health_reports", AddressBuckets)  # health reports per client address
