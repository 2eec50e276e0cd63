"""Who may do what: the tokens and their roles, the /ui sessions, and the
checks every request passes before its handler (:func:`middleware`).

In order, on every request:

1. **Host** (DNS rebinding). A server without a token that listens on loopback
   only answers requests whose ``Host`` is a loopback name or literal
   (``localhost``, ``127.x.y.z``, ``[::1]``, any port; ``/healthz`` excepted,
   it shows counts only); anything else is 403
   ``forbidden``: a page on another name that resolves to 127.0.0.1 reaches the
   port but is refused. (With a token, the token is the guard; a non-loopback
   server without one was started with ``--insecure``.)
2. **Origin** (another site's page). A request whose ``Origin`` is not this
   server's own is refused (403) when it changes something (any method but
   GET/HEAD/OPTIONS), opens a WebSocket (the agent channel), or is authorized
   by the /ui cookie. A request *without* ``Origin`` comes from a client that
   is not a browser (agents, the ``rdzv`` CLI, curl): browsers send ``Origin``
   on every WebSocket upgrade and every cross-origin request that changes
   something, and a page cannot remove it. Such a client is judged by its
   token like any other.
3. **Credentials** (with ``--token``): a bearer token, or the /ui session
   cookie (:class:`Sessions`), which is never accepted on the agent channel
   (only a bearer token authorizes an agent). Wrong ones are counted per
   address (:mod:`rdzv_server.throttle`); an address past the limit is answered
   429 for wrong ones, while the right token still passes: a guesser behind
   the same NAT never locks the real agents out. (What makes guessing hopeless
   is the token's strength, :data:`MIN_TOKEN_LEN` at least, checked at start.)
4. **Role**. With ``--operator-token``, the calls that stop or change other
   people's jobs and hosts (:data:`OPERATOR_ROUTES`) need the operator token
   (or a /ui session signed in with it): 403 ``forbidden`` for the ordinary
   token, which keeps agents, reads and health reports. Without one, the one
   token is every role.

An agent's upgrade the server answers itself (rdzv_server.upgrade) passes the
checks above that apply to it there (:func:`loopback_host_header`,
:meth:`Auth.role_of`; it carries no ``Origin`` and no cookie); whatever fails
one comes here.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import hmac
import ipaddress
import secrets
import time
from collections.abc import Callable
from enum import Enum

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from rdzv_common.protocol import AGENT_PATH, MAX_ERROR_MESSAGE, ErrorBody, ErrorCode, printable

from .audit import Audit
from .throttle import AuthThrottle

MIN_TOKEN_LEN = 16  # characters, for --token and --operator-token (the server refuses to start otherwise)
SESSION_TTL_S = 12 * 3600.0  # a /ui login lasts this long (cookie Max-Age and the server's table)
MAX_SESSIONS = 1000  # /ui sessions held at once; beyond it the oldest is dropped (it logs in again)
MAX_SESSIONS_PER_ADDR = 16  # of them one client address holds; beyond it that address's oldest is dropped
MAX_SESSION_ID = 100  # characters of a cookie value looked at (ours are 43)
COOKIE = "rdzv_session"
UI_HEADER = "X-Rdzv-UI"
ROLE_HEADER = "X-Rdzv-Role"  # on answers to the /ui session: the role it signed in with
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

# What stops or changes other people's jobs and hosts: (method, route) as registered in app.py.
OPERATOR_ROUTES = frozenset(
    {
        ("POST", "/v1/jobs/{job_id}/close"),
        ("DELETE", "/v1/jobs/{job_id}"),
        ("POST", "/v1/hosts/{host}/cordon"),
        ("POST", "/v1/hosts/{host}/uncordon"),
    }
)


class Role(str, Enum):
    AGENT = "agent"  # the ordinary token when an operator token is set: join, read, report health
    OPERATOR = "operator"  # everything


def token_problem(flag: str, value: str | None) -> str | None:
    """Why ``value`` cannot be the server's ``flag`` (one line), or None."""
    if value is None:
        return None
    if len(value) < MIN_TOKEN_LEN:
        return (
            f"{flag} is {len(value)} characters; at least {MIN_TOKEN_LEN} are needed "
            "(e.g. python3 -c 'import secrets; print(secrets.token_hex(32))')"
        )
    if not value.isascii() or not value.isprintable() or value != value.strip():
        return f"{flag} must be printable ASCII without leading or trailing spaces"
    return None


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address literal (a name may resolve to anything: not loopback)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


@functools.lru_cache(maxsize=64)  # an agent's every connection names the same Host (bounded: a client may vary it)
def loopback_host_header(value: str) -> bool:
    """A Host header naming loopback: ``localhost``, ``127.0.0.1``, ``[::1]``, each with any port."""
    v = value.strip()
    if v.startswith("["):
        name, sep, rest = v[1:].partition("]")
        if not sep or (rest and not (rest[:1] == ":" and rest[1:].isdigit())):
            return False
        return ":" in name and is_loopback(name)
    name, _, port = v.partition(":")
    if port and not port.isdigit():
        return False
    return bool(name) and is_loopback(name)


def own_origin(request: web.Request) -> str:
    return f"{request.scheme}://{request.host}"


def foreign_origin(request: web.Request) -> str | None:
    """The request's Origin when it names another origin than this server's (``null`` included)."""
    origin = request.headers.get("Origin")
    return origin if origin is not None and origin != own_origin(request) else None


class Sessions:
    """/ui logins: a random id per login (the cookie's value), its role,
    expiry and client address; only a hash of each id is held. Bounded in
    count (the oldest go first), per client address (one address's logins
    drop its own oldest: a token holder logging in over and over cannot sign
    everyone else out) and in time; a logout revokes its id; a restart
    forgets them all."""

    def __init__(
        self,
        ttl_s: float = SESSION_TTL_S,
        max_sessions: int = MAX_SESSIONS,
        clock: Callable[[], float] = time.monotonic,
        max_per_addr: int = MAX_SESSIONS_PER_ADDR,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.max_per_addr = max_per_addr
        self.clock = clock
        # by creation: key -> (role, expiry, address)
        self._held: collections.OrderedDict[bytes, tuple[Role, float, str]] = collections.OrderedDict()
        self._per_addr: collections.Counter[str] = collections.Counter()

    def _drop(self, key: bytes) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            self._per_addr[held[2]] -= 1
            if self._per_addr[held[2]] <= 0:
                del self._per_addr[held[2]]

    @staticmethod
    def _key(sid: str) -> bytes:
        return hashlib.sha256(sid.encode("utf-8", "surrogateescape")).digest()

    def _sweep(self, now: float) -> None:
        while self._held:
            key, (_, expires, _addr) = next(iter(self._held.items()))
            if expires > now:
                return
            self._drop(key)

    def create(self, role: Role, addr: str = "?") -> str:
        now = self.clock()
        self._sweep(now)
        if self._per_addr[addr] >= self.max_per_addr:  # this address's oldest goes (at most max_sessions looked at)
            self._drop(next(k for k, held in self._held.items() if held[2] == addr))
        sid = secrets.token_urlsafe(32)
        self._held[self._key(sid)] = (role, now + self.ttl_s, addr)
        self._per_addr[addr] += 1
        while len(self._held) > self.max_sessions:
            self._drop(next(iter(self._held)))
        return sid

    def role(self, sid: str) -> Role | None:
        """The role of a live session ``sid``, or None (unknown, expired, revoked)."""
        if not sid or len(sid) > MAX_SESSION_ID:
            return None
        key = self._key(sid)
        held = self._held.get(key)
        if held is None:
            return None
        if held[1] <= self.clock():
            self._drop(key)
            return None
        return held[0]

    def revoke(self, sid: str) -> bool:
        if not sid or len(sid) > MAX_SESSION_ID or self._key(sid) not in self._held:
            return False
        self._drop(self._key(sid))
        return True

    def __len__(self) -> int:
        return len(self._held)


class Auth:
    """The server's credentials and what goes with them (one per app)."""

    def __init__(
        self,
        token: str | None,
        operator_token: str | None = None,
        listen_host: str = "127.0.0.1",
        audit: Audit | None = None,
        throttle: AuthThrottle | None = None,
        sessions: Sessions | None = None,
    ) -> None:
        if operator_token and not token:
            raise ValueError("an operator token needs a token (--token) for agents and readers")
        if operator_token and operator_token == token:
            raise ValueError("the operator token must differ from the token")
        self.token = token or ""
        self.operator_token = operator_token or ""
        self.check_host = not self.token and is_loopback(listen_host)
        self.audit = audit or Audit()
        self.throttle = throttle or AuthThrottle()
        self.sessions = sessions or Sessions()

    def role_of(self, given: str) -> Role | None:
        """The role ``given`` proves, or None. Both comparisons always run (constant time)."""
        raw = given.encode("utf-8", "surrogateescape")
        operator = hmac.compare_digest(raw, self.operator_token.encode()) and bool(self.operator_token)
        ordinary = hmac.compare_digest(raw, self.token.encode()) and bool(self.token)
        if operator or (ordinary and not self.operator_token):
            return Role.OPERATOR
        return Role.AGENT if ordinary else None

    def guessed(self, remote: str, what: str) -> None:
        """A wrong credential from ``remote``: counted and audited."""
        if self.throttle.failed(remote):
            self.audit.event(
                "throttle", f"{printable(remote, 64)} sent {self.throttle.limit} wrong tokens: refused for a while"
            )
        self.audit.event("token", f"token rejected: {what} from {printable(remote)}")

    def too_many(self, remote: str) -> web.Response:
        return error(
            ErrorCode.RATE_LIMITED,
            f"too many wrong tokens from {printable(remote, 64)}; retry after the window",
            429,
            {"Retry-After": self.throttle.retry_after(remote)},
        )


def error_text(code: ErrorCode, message: str) -> str:
    """An error's JSON body, its message cut to MAX_ERROR_MESSAGE."""
    return ErrorBody(code=code, message=message[:MAX_ERROR_MESSAGE]).model_dump_json()


def error(code: ErrorCode, message: str, status: int, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(text=error_text(code, message), status=status, headers=headers)


def bearer(authorization: str) -> str | None:
    """The token of an ``Authorization`` header's value when it is a bearer token, else None."""
    scheme, _, value = authorization.partition(" ")
    return value.strip() if scheme.lower() == "bearer" else None


def _cross_site(origin: str) -> web.Response:
    why = f"cross-site request refused: Origin {printable(origin, 100)} is not this server"
    return error(ErrorCode.FORBIDDEN, why, 403)


def _operator_only(request: web.Request) -> bool:
    resource = request.match_info.route.resource
    return resource is not None and (request.method, resource.canonical) in OPERATOR_ROUTES


def middleware(auth: Auth, public: Callable[[str], bool]) -> Middleware:
    """The checks of this module's docstring; ``public(path)``: served without a token."""

    @web.middleware
    async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        # /healthz: a probe may name the host anyhow, and it shows counts only
        if auth.check_host and request.path != "/healthz" and not loopback_host_header(request.headers.get("Host", "")):
            return error(
                ErrorCode.FORBIDDEN,
                f"Host {printable(request.headers.get('Host', ''), 100)!r} refused: this server has no token and "
                "listens on loopback, so it answers only localhost, 127.0.0.1 or [::1] (another name that "
                "resolves here is a web page's DNS rebinding)",
                403,
            )
        channel = request.path == AGENT_PATH or request.headers.get("Upgrade", "").lower() == "websocket"
        foreign = foreign_origin(request)
        if foreign is not None and (channel or request.method not in SAFE_METHODS):
            return _cross_site(foreign)
        if not auth.token or request.path == "/healthz" or public(request.path):
            return await handler(request)
        remote = request.remote or "?"
        given = bearer(request.headers.get("Authorization", ""))
        role = auth.role_of(given) if given is not None else None
        by_cookie = False
        cookie = request.cookies.get(COOKIE, "")
        if given is None and cookie and not channel:  # a bearer token, right or wrong, is what counts
            role = auth.sessions.role(cookie)
            by_cookie = role is not None
        if role is None:
            if auth.throttle.blocked(remote):  # too many wrong ones from here lately: no more guesses for now
                return auth.too_many(remote)
            auth.guessed(remote, f"{request.method} {printable(request.path, 200)}")
            if not given:  # the client knows whether it sent one: naming which tells it nothing new
                why = "no bearer token was sent (Authorization: Bearer ...; RDZV_TOKEN): this server requires one"
            else:
                why = "the bearer token sent is not this server's (check RDZV_TOKEN)"
            if channel and cookie and given is None:
                why = "the agent channel needs the bearer token (the /ui session cookie does not authorize it)"
            elif cookie and given is None:
                why = "the /ui session has expired or was signed out: sign in again"
            return error(ErrorCode.UNAUTHORIZED, why, 401, {"WWW-Authenticate": "Bearer"})
        if by_cookie:
            if foreign is not None:
                return _cross_site(foreign)
            if request.method not in SAFE_METHODS and request.headers.get(UI_HEADER) != "1":
                why = f"a change made with the /ui cookie needs the header {UI_HEADER}: 1"
                return error(ErrorCode.FORBIDDEN, why, 403)
        if role is not Role.OPERATOR and _operator_only(request):
            how = "sign in to /ui with it" if by_cookie else "send it as the bearer token"
            return error(
                ErrorCode.FORBIDDEN,
                f"{request.method} {printable(request.path, 200)} needs the operator token "
                f"(the server's --operator-token; {how}): the ordinary token may join, read and report health, "
                "not close, delete or cordon",
                403,
            )
        resp = await handler(request)
        if by_cookie and not resp.prepared:  # the page shows "sign out" and its role (not on a stream)
            resp.headers[ROLE_HEADER] = role.value
        return resp

    return auth_middleware
