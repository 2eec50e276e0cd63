"""Who may do what, on the real app (rdzv_server.auth): Origin on every
WebSocket upgrade and change, Host on a tokenless loopback server (DNS
rebinding), the /ui session (per login, revocable, expiring, never on the
agent channel), the operator role, and invalid ids in the path (422)."""

from __future__ import annotations

import pytest
from aiohttp import WSServerHandshakeError

from rdzv_common.protocol import AGENT_PATH
from rdzv_server.app import Settings
from rdzv_server.auth import COOKIE, SESSION_TTL_S
from rdzv_server.keys import AUTH

from .conftest import form, join_msg
from .test_hostile import stable

TOKEN = "agents-token-0123456789"
OPERATOR = "operators-token-9876543210"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
OP_BEARER = {"Authorization": f"Bearer {OPERATOR}"}
EVIL = "http://evil.example"


async def snapshot(client, headers=None) -> dict:
    """Everything REST shows: jobs, each job's view, host records."""
    headers = headers or {}
    listing = await (await client.get("/v1/jobs", headers=headers)).json()
    views = {}
    for job in listing["jobs"]:
        resp = await client.get(f"/v1/jobs/{job['job_id']}", headers=headers)
        assert resp.status == 200
        views[job["job_id"]] = stable(await resp.json())
    hosts = await (await client.get("/v1/hosts", headers=headers)).json()
    return {"jobs": listing["jobs"], "views": views, "hosts": hosts}


async def jobs(client, headers=None) -> list[str]:
    resp = await client.get("/v1/jobs", headers=headers or {})
    assert resp.status == 200, await resp.text()
    return [j["job_id"] for j in (await resp.json())["jobs"]]


# ------------------------------------------------------------------ Origin


@pytest.mark.parametrize("token", [None, TOKEN], ids=["tokenless", "token"])
async def test_an_agent_channel_upgrade_from_another_origin_is_refused_and_joins_nothing(make_client, token):
    """A page on another site (or another port of this host) opening /v1/agent:
    403 before the upgrade, with or without the bearer token; no job appears.
    The same upgrade without an Origin (a real agent) or with the server's own joins."""
    client = await make_client(Settings(token=token))
    auth = BEARER if token else {}
    own = f"http://{client.host}:{client.port}"
    for origin in (EVIL, f"http://{client.host}:{client.port + 1}", "null"):
        with pytest.raises(WSServerHandshakeError) as refused:
            await client.ws_connect(AGENT_PATH, headers={**auth, "Origin": origin})
        assert refused.value.status == 403, origin
    assert await jobs(client, auth) == []
    for headers in (auth, {**auth, "Origin": own}):
        ws = await client.ws_connect(AGENT_PATH, headers=headers)
        await ws.send_str(join_msg(f"real{len(headers)}", "node1", (1, 1)).model_dump_json())
        assert '"joined"' in (await ws.receive(timeout=3)).data
        await ws.close()


async def test_a_change_from_another_origin_is_refused_on_a_tokenless_server(client, connect):
    """No token: another site's POST close and DELETE are refused (403) and change nothing."""
    await form(connect, "o1", ["node1"])
    before = await snapshot(client)
    for method, path in (("POST", "/v1/jobs/o1/close"), ("DELETE", "/v1/jobs/o1"), ("POST", "/v1/hosts/h/cordon")):
        resp = await client.request(method, path, headers={"Origin": EVIL}, json={"reason": "x"})
        assert resp.status == 403 and "cross-site" in (await resp.json())["message"], (method, path)
    assert await snapshot(client) == before


# -------------------------------------------------------------------- Host


async def test_dns_rebinding_to_a_tokenless_loopback_server_is_refused_and_changes_nothing(client, connect):
    """A name that resolves to 127.0.0.1 (Host: evil.example, as a rebinding page
    sends it, with its own Origin): every request is 403 naming the rule, the
    job stays running, no agent joins. Loopback names and literals pass."""
    await form(connect, "rb", ["node1"])
    before = await snapshot(client)
    port = client.port
    for host in (f"evil.example:{port}", "evil.example", f"0.0.0.0:{port}", f"127.0.0.1.evil.example:{port}", ""):
        rebound = {"Host": host, "Origin": f"http://{host}"}
        resp = await client.post("/v1/jobs/rb/close", headers=rebound)
        assert resp.status == 403, host
        body = await resp.json()
        assert body["code"] == "forbidden" and "loopback" in body["message"] and "rebinding" in body["message"]
        assert (await client.get("/v1/jobs", headers=rebound)).status == 403
        with pytest.raises(WSServerHandshakeError) as refused:
            await client.ws_connect(AGENT_PATH, headers=rebound)
        assert refused.value.status == 403
    assert await snapshot(client) == before
    assert (await client.get("/healthz", headers={"Host": "evil.example"})).status == 200  # a probe's, counts only
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "127.0.0.2", "LOCALHOST"):
        assert (await client.get("/v1/jobs", headers={"Host": host})).status == 200, host


async def test_the_host_is_not_checked_with_a_token_or_off_loopback(make_client):
    """With a token the token guards (any Host); a tokenless server on all
    addresses (--insecure) answers any Host, as its operator chose."""
    with_token = await make_client(Settings(token=TOKEN))
    assert (await with_token.get("/v1/jobs", headers={**BEARER, "Host": "rdzv.example:1"})).status == 200
    insecure = await make_client(Settings(listen_host="0.0.0.0"))
    assert (await insecure.get("/v1/jobs", headers={"Host": "head-node:29400"})).status == 200


# ------------------------------------------------------------ /ui session


async def login(client, token: str = TOKEN) -> str:
    resp = await client.post("/ui/login", json={"token": token})
    assert resp.status == 200, await resp.text()
    return resp.cookies[COOKIE].value


def cookie(sid: str) -> dict[str, str]:
    return {"Cookie": f"{COOKIE}={sid}"}


async def test_the_ui_cookie_never_opens_the_agent_channel(make_client):
    """Signed in to /ui (the cookie works for REST), the same cookie cannot open
    /v1/agent: 401 saying the agent channel needs the bearer token; no job appears."""
    client = await make_client(Settings(token=TOKEN))
    sid = await login(client)
    client.session.cookie_jar.clear()
    assert (await client.get("/v1/jobs", headers=cookie(sid))).status == 200
    resp = await client.get(
        AGENT_PATH,
        headers={
            **cookie(sid),
            "Upgrade": "websocket",
            "Connection": "Upgrade",
            "Sec-WebSocket-Version": "13",
            "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
        },
    )
    assert resp.status == 401 and "bearer token" in (await resp.json())["message"]
    with pytest.raises(WSServerHandshakeError) as refused:
        await client.ws_connect(AGENT_PATH, headers=cookie(sid))
    assert refused.value.status == 401
    assert await jobs(client, BEARER) == []


async def test_every_login_gets_its_own_session_and_logout_revokes_only_it(make_client):
    """Two logins: two different cookie values, neither derived from the token;
    a logout revokes its own (that cookie value is refused after, even sent by
    hand) and leaves the other working."""
    client = await make_client(Settings(token=TOKEN))
    first = await login(client)
    client.session.cookie_jar.clear()  # another browser
    second = await login(client)
    assert first != second and TOKEN not in first and len(first) >= 40
    client.session.cookie_jar.clear()
    for sid in (first, second):
        assert (await client.get("/v1/jobs", headers=cookie(sid))).status == 200
    resp = await client.post("/ui/logout", headers=cookie(first))
    assert resp.status == 200 and resp.cookies[COOKIE].value == ""
    resp = await client.get("/v1/jobs", headers=cookie(first))
    assert resp.status == 401 and "sign in again" in (await resp.json())["message"]
    assert (await client.get("/v1/events", params={"since": "0"}, headers=cookie(first))).status == 401
    assert (await client.get("/v1/jobs", headers=cookie(second))).status == 200
    # signing in again in the same browser replaces that browser's session
    client.session.cookie_jar.update_cookies({COOKIE: second})
    third = await login(client)
    assert third != second and client.app[AUTH].sessions.role(second) is None
    client.session.cookie_jar.clear()
    assert (await client.get("/v1/jobs", headers=cookie(third))).status == 200
    # a made-up or overlong cookie is no session either
    for sid in ("x" * 43, "y" * 5000):
        assert (await client.get("/v1/jobs", headers=cookie(sid))).status == 401


async def test_a_session_expires(make_client):
    """The cookie says Max-Age 12 h; the server forgets the session after that too."""
    client = await make_client(Settings(token=TOKEN))
    sessions = client.app[AUTH].sessions
    now = [1000.0]
    sessions.clock = lambda: now[0]
    resp = await client.post("/ui/login", json={"token": TOKEN})
    assert f"Max-Age={int(SESSION_TTL_S)}" in resp.headers["Set-Cookie"]
    sid = resp.cookies[COOKIE].value
    client.session.cookie_jar.clear()
    now[0] += SESSION_TTL_S - 1
    assert (await client.get("/v1/jobs", headers=cookie(sid))).status == 200
    now[0] += 1
    assert (await client.get("/v1/jobs", headers=cookie(sid))).status == 401
    assert len(sessions) == 0


# ---------------------------------------------------------------- operator


OPERATOR_CALLS = [
    ("POST", "/v1/jobs/opjob/close", None),
    ("DELETE", "/v1/jobs/opjob", None),
    ("POST", "/v1/hosts/node1/cordon", {"reason": "ECC errors", "drain": True}),
    ("POST", "/v1/hosts/node1/uncordon", None),
]


async def test_operator_calls_refuse_the_ordinary_token_and_take_the_operator_token(make_client, connect):
    """With --operator-token: close, delete, cordon (with drain) and uncordon
    with the ordinary token are 403 forbidden naming the operator token and
    change nothing; agents (the ordinary token) join, read and report health;
    the operator token does all of it."""
    client = await make_client(Settings(token=TOKEN, operator_token=OPERATOR))
    await form(lambda: connect(on=client, headers=BEARER), "opjob", ["node1"])
    before = await snapshot(client, BEARER)
    for method, path, body in OPERATOR_CALLS:
        resp = await client.request(method, path, headers=BEARER, json=body)
        assert resp.status == 403, (method, path, await resp.text())
        got = await resp.json()
        assert got["code"] == "forbidden" and "operator token" in got["message"], got
    assert await snapshot(client, BEARER) == before
    assert (await client.get("/v1/hosts", headers=BEARER)).status == 200
    assert (await client.get("/metrics", headers=BEARER)).status == 200
    resp = await client.post("/v1/hosts/node9/health", headers=BEARER, json={"reason": "nvidia-smi failed"})
    assert resp.status == 200, await resp.text()
    # the operator token: reads, and every operator call
    assert await jobs(client, OP_BEARER) == ["opjob"]
    for method, path, body in OPERATOR_CALLS:
        resp = await client.request(method, path, headers=OP_BEARER, json=body)
        assert resp.status == 200, (method, path, await resp.text())
    assert await jobs(client, OP_BEARER) == []  # closed, then deleted


async def test_a_ui_session_keeps_the_role_it_signed_in_with(make_client, connect):
    """/ui login takes either token; a session of the ordinary token gets 403
    with a clear message from the close button's call, one of the operator token closes."""
    client = await make_client(Settings(token=TOKEN, operator_token=OPERATOR))
    await form(lambda: connect(on=client, headers=BEARER), "uijob", ["node1"])
    ui = {"X-Rdzv-UI": "1"}
    resp = await client.post("/ui/login", json={"token": TOKEN})
    assert (await resp.json()) == {"auth": True, "role": "agent"}
    assert (await client.get("/v1/jobs")).headers["X-Rdzv-Role"] == "agent"  # the page shows it
    assert "X-Rdzv-Role" not in (await client.get("/v1/jobs", headers=BEARER)).headers
    resp = await client.post("/v1/jobs/uijob/close", headers=ui)
    assert resp.status == 403 and "sign in to /ui with it" in (await resp.json())["message"]
    assert (await (await client.get("/v1/jobs/uijob")).json())["state"] == "running"
    resp = await client.post("/ui/login", json={"token": OPERATOR})
    assert (await resp.json()) == {"auth": True, "role": "operator"}
    resp = await client.post("/v1/jobs/uijob/close", headers=ui)
    assert resp.status == 200 and (await resp.json())["state"] == "closed"


async def test_without_an_operator_token_the_token_is_every_role(make_client, connect):
    client = await make_client(Settings(token=TOKEN))
    await form(lambda: connect(on=client, headers=BEARER), "opjob", ["node1"])
    for method, path, body in OPERATOR_CALLS:
        resp = await client.request(method, path, headers=BEARER, json=body)
        assert resp.status == 200, (method, path, await resp.text())


def test_an_operator_token_needs_a_different_token():
    from rdzv_server.app import create_app

    for token, operator in ((None, OPERATOR), (TOKEN, TOKEN)):
        with pytest.raises(ValueError):
            create_app(Settings(token=token, operator_token=operator))


# ------------------------------------------------------------ ids in paths


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/jobs/abc%0A"),
        ("DELETE", "/v1/jobs/abc%0A"),
        ("POST", "/v1/jobs/abc%0A/close"),
        ("GET", "/v1/jobs/abc%0A/events"),
        ("GET", "/v1/hosts/abc%0A"),
        ("POST", "/v1/hosts/abc%0A/uncordon"),
    ],
)
async def test_an_id_with_a_trailing_newline_is_a_validation_error(client, method, path):
    """``abc\\n`` is not a job id nor a host: 422 validation_error saying so, not
    404 (a regex's ``$`` matches before a final newline)."""
    resp = await client.request(method, path)
    assert resp.status == 422, (method, path, await resp.text())
    body = await resp.json()
    assert body["code"] == "validation_error" and "not valid" in body["message"] and "\\n" in body["message"]
