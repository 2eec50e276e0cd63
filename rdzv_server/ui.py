"""The dashboard: ``/ui`` (one page: plain HTML, CSS and JavaScript shipped in
the package, nothing fetched from elsewhere) and its login.

The page's files need no token (they hold no data); the data comes from the
REST API and the event stream. With ``--token`` the page asks for a token
once (the token or the operator token) and ``POST /ui/login`` starts a session
(:class:`rdzv_server.auth.Sessions`): a random id per login in a cookie
(HttpOnly, SameSite=Strict, Secure over TLS, Max-Age the session's 12 h),
which the auth middleware accepts in place of a bearer token (EventSource
cannot send an Authorization header), never on the agent channel. The session
keeps the role of the token it was started with; ``POST /ui/logout`` revokes
it. Requests that change something with the cookie as their only credential
must also carry ``X-Rdzv-UI: 1`` (a header a cross-site form cannot send, and
a cross-site script cannot without a CORS preflight the server never grants),
and any cookie request whose ``Origin`` is not the server's own is refused.
"""

from __future__ import annotations

import json
from importlib import resources

from aiohttp import web

from rdzv_common.protocol import ErrorCode, RequestError, UnauthorizedError

from .auth import COOKIE
from .keys import AUTH

MAX_LOGIN_BODY = 4096
_FILES = {
    "app.js": "text/javascript",
    "explain.js": "text/javascript",
    "workers.js": "text/javascript",
    "style.css": "text/css",
}
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
    return path in ("/", "/ui", "/ui/", "/ui/hosts", "/ui/login", "/ui/logout") or path.startswith(
        ("/ui/static/", "/ui/jobs/")
    )


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
    """``{"token": "..."}``: start a session if it is the server's token or operator token."""
    auth = request.app[AUTH]
    raw = await request.content.read(MAX_LOGIN_BODY + 1)
    if len(raw) > MAX_LOGIN_BODY:
        raise RequestError(f"a login body is at most {MAX_LOGIN_BODY} bytes", ErrorCode.VALIDATION_ERROR)
    try:
        given = json.loads(raw or b"{}").get("token")
    except (ValueError, AttributeError):
        given = None
    if not isinstance(given, str):
        raise RequestError('login takes {"token": "..."}', ErrorCode.VALIDATION_ERROR)
    if not auth.token:
        return web.json_response({"auth": False})
    remote = request.remote or "?"
    role = auth.role_of(given)
    if role is None:  # the same count as wrong bearer tokens (rdzv_server.throttle); the right token always passes
        if auth.throttle.blocked(remote):
            return auth.too_many(remote)
        auth.guessed(remote, "/ui login")
        raise UnauthorizedError("wrong token", ErrorCode.UNAUTHORIZED)
    old = request.cookies.get(COOKIE)
    if old:
        auth.sessions.revoke(old)
    resp = web.json_response({"auth": True, "role": role.value})
    resp.set_cookie(
        COOKIE,
        auth.sessions.create(role, remote),
        httponly=True,
        samesite="Strict",
        secure=request.secure,
        path="/",
        max_age=int(auth.sessions.ttl_s),
    )
    return resp


async def logout(request: web.Request) -> web.Response:
    """Revoke this browser's session (its cookie stops working at once) and drop the cookie."""
    request.app[AUTH].sessions.revoke(request.cookies.get(COOKIE, ""))
    resp = web.json_response({"auth": False})
    resp.del_cookie(COOKIE, path="/")
    return resp
