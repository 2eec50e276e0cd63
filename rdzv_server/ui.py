"""The dashboard: ``/ui`` (one page: plain HTML, CSS and JavaScript shipped in
the package, nothing fetched from elsewhere) and its login.

The page's files need no token (they hold no data); the data comes from the
REST API and the event stream. With ``--token`` the page asks for the token
once and ``POST /ui/login`` sets a cookie (HttpOnly, SameSite=Strict; Secure
over TLS) whose value is derived from the token (an HMAC, not the token
itself), which :func:`cookie_ok` accepts as auth: EventSource cannot send an
Authorization header. Requests that change something with the cookie as their
only credential must also carry ``X-Rdzv-UI: 1`` (a header a cross-site form
cannot send, and a cross-site script cannot without a CORS preflight the
server never grants); any such request whose ``Origin`` is not the server's
own is refused (:func:`cross_site`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from importlib import resources

from aiohttp import web

from .keys import AUDIT, THROTTLE, TOKEN
from .protocol import ErrorCode, RequestError, UnauthorizedError, printable

COOKIE = "rdzv_session"
UI_HEADER = "X-Rdzv-UI"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
MAX_LOGIN_BODY = 4096
_FILES = {"app.js": "text/javascript", "style.css": "text/css"}
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
_HEADERS = {
    "Content-Security-Policy": _CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def public(path: str) -> bool:
    """Paths served without a token: the page's own files and its login."""
    return path in ("/", "/ui", "/ui/", "/ui/login", "/ui/logout") or path.startswith(("/ui/static/", "/ui/jobs/"))


def session_value(token: str) -> str:
    """The cookie's value for ``token``: changing the token logs every browser out."""
    return hmac.new(token.encode(), b"rdzv ui session v1", hashlib.sha256).hexdigest()


def cookie_ok(request: web.Request, token: str) -> bool:
    given = request.cookies.get(COOKIE, "")
    return bool(given) and hmac.compare_digest(given.encode("utf-8", "surrogateescape"), session_value(token).encode())


def cross_site(request: web.Request) -> bool:
    """A request that changes something and names an Origin other than this server's."""
    origin = request.headers.get("Origin")
    if request.method in SAFE_METHODS or origin is None:
        return False
    return origin != f"{request.scheme}://{request.host}"


def _file(name: str) -> bytes:
    return resources.files("rdzv_server").joinpath("ui_files").joinpath(name).read_bytes()


async def root(request: web.Request) -> web.Response:
    raise web.HTTPFound("/ui")


async def page(request: web.Request) -> web.Response:
    return web.Response(body=_file("index.html"), content_type="text/html", charset="utf-8", headers=_HEADERS)


async def static(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in _FILES:
        raise web.HTTPNotFound()
    return web.Response(body=_file(name), content_type=_FILES[name], charset="utf-8", headers=_HEADERS)


async def login(request: web.Request) -> web.Response:
    """``{"token": "..."}``: set the session cookie if it is the server's token."""
    token = request.app[TOKEN]
    raw = await request.content.read(MAX_LOGIN_BODY + 1)
    if len(raw) > MAX_LOGIN_BODY:
        raise RequestError(f"a login body is at most {MAX_LOGIN_BODY} bytes", ErrorCode.VALIDATION_ERROR)
    try:
        given = json.loads(raw or b"{}").get("token")
    except (ValueError, AttributeError):
        given = None
    if not isinstance(given, str):
        raise RequestError('login takes {"token": "..."}', ErrorCode.VALIDATION_ERROR)
    if not token:
        return web.json_response({"auth": False})
    throttle, remote = request.app[THROTTLE], request.remote or "?"
    if throttle.blocked(remote):  # the same count as wrong bearer tokens (rdzv_server.throttle)
        body = {"code": ErrorCode.RATE_LIMITED.value, "message": f"too many wrong tokens from {printable(remote, 64)}"}
        return web.json_response(body, status=429, headers={"Retry-After": throttle.retry_after(remote)})
    if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), token.encode()):
        throttle.failed(remote)
        request.app[AUDIT].event("token", f"token rejected: /ui login from {printable(request.remote)}")
        raise UnauthorizedError("wrong token", ErrorCode.UNAUTHORIZED)
    resp = web.json_response({"auth": True})
    resp.set_cookie(COOKIE, session_value(token), httponly=True, samesite="Strict", secure=request.secure, path="/")
    return resp


async def logout(request: web.Request) -> web.Response:
    resp = web.json_response({"auth": False})
    resp.del_cookie(COOKIE, path="/")
    return resp
