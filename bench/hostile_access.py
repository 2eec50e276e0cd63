"""Probes 4-8 of bench/hostile.py, who may do what: a reused job id, cross-origin
requests, host records, connection and stream slots, the token throttle. Each
attacks its own real rdzv-server and returns one row (see bench/hostile.py)."""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import time
from typing import Any

from . import _common as C
from .hostile import (
    ANSWER_S,
    MAX_TIMEOUT_S,
    OTHER_ADDR,
    Ctx,
    Result,
    join_text,
    never_reading,
    refused,
    session,
    until,
)

GUESS_BURST = 20  # wrong-secret joins sent at once on one connection (the server closes after 20 errors)


async def _team_run(s: Any, url: str, job: str, secret: str | None) -> str | None:
    """Run 1 of ``job``: one node joins, succeeds, hears ``done``; None when it went so."""
    async with s.ws_connect(url + "/v1/agent") as ws:
        await ws.send_str(join_text(job, "team-n1", job_secret=secret))
        msg = await until(ws, {"assigned"}, ANSWER_S)
        if msg is None or msg["op"] != "assigned":
            return f"setup: run 1 {refused(msg, ws)}"
        await ws.send_str(json.dumps({"op": "succeeded", "round": msg["assignment"]["round"]}))
        msg = await until(ws, {"done"}, ANSWER_S)
        return None if msg is not None and msg["op"] == "done" else f"setup: no done ({refused(msg, ws)})"


async def _stranger(s: Any, url: str, job: str) -> tuple[bool, str]:
    """A fresh join with no secret and its own settings: (took it, what happened)."""
    async with s.ws_connect(url + "/v1/agent") as ws:
        await ws.send_str(join_text(job, "stranger", nnodes=(1, 2), host="10.66.66.66"))
        msg = await until(ws, {"joined"}, ANSWER_S)
        if msg is None or msg["op"] != "joined":
            return False, refused(msg, ws)
        return True, f"took it: run {msg.get('run')} started with its settings"


async def probe_reused(ctx: Ctx) -> Result:
    server = ctx.server("srv")
    out: dict[str, Any] = {}
    try:
        async with session() as s:
            for case, secret in (("with a job secret", "team-" + secrets.token_hex(16)), ("without", None)):
                job = "nightly" if secret else "nightly-nosecret"
                setup = await _team_run(s, server.url, job, secret)
                out[case] = (False, setup) if setup else await _stranger(s, server.url, job)
    finally:
        server.stop()
    did = (
        'reused job id: run 1 of "nightly" (one node, succeeded, `done`); a stranger\'s fresh join without '
        "the secret, with other settings; run 1 with a job secret, and without one (the default)"
    )
    measured = "; ".join(f"{case}: {what}" for case, (_, what) in out.items())
    # a run without a job secret has no credential to prove: its id is anyone's (docs/security.md), reported only
    met = not out["with a job secret"][0] and not any(w.startswith("setup") for _, w in out.values())
    target = "with a job secret: refused (without one there is no credential: anyone's, as documented)"
    return Result("4", did, measured, target, met, {})


async def _upgrade(s: Any, url: str, headers: dict[str, str]) -> tuple[int, str]:
    """The agent WebSocket upgrade with ``headers``: (HTTP status, and after a 101 what a join got)."""
    import aiohttp

    try:
        async with s.ws_connect(url + "/v1/agent", headers=headers) as ws:
            await ws.send_str(join_text("xo-" + secrets.token_hex(4), "page", host="10.66.66.66"))
            msg = await until(ws, {"joined"}, ANSWER_S)
            return 101, "then joined" if msg and msg["op"] == "joined" else f"then {refused(msg, ws)}"
    except aiohttp.WSServerHandshakeError as e:
        return e.status, ""


async def probe_origin(ctx: Ctx) -> Result:
    evil = {"Origin": "http://evil.example"}
    server = ctx.server("srv")
    try:
        async with session() as s:
            ws_status, ws_then = await _upgrade(s, server.url, evil)
            async with s.ws_connect(server.url + "/v1/agent") as victim:  # a running job to close
                await victim.send_str(join_text("victim", "n1"))
                await until(victim, {"assigned"}, ANSWER_S)
                async with s.post(server.url + "/v1/jobs/victim/close", headers={"Host": "evil.example"}) as r:
                    close_status = r.status
    finally:
        server.stop()
    token = secrets.token_hex(16)
    server = ctx.server("tok", "--token", token)
    try:
        async with session() as s:
            async with s.post(server.url + "/ui/login", json={"token": token}) as r:
                login = r.status
                cookies = "; ".join(f"{k}={v.value}" for k, v in r.cookies.items())  # whatever the login set
            page = {"Origin": f"http://127.0.0.1:{C.free_port()}", "Cookie": cookies}
            cookie_status, cookie_then = await _upgrade(s, server.url, page) if cookies else (None, "")
    finally:
        server.stop()
    cookie_text = f"{cookie_status} {cookie_then}" if cookie_status else f"not measured (login {login}, no cookie)"
    did = (
        "cross-origin: `/v1/agent` upgrade with `Origin: http://evil.example` (no token); `POST "
        "/v1/jobs/ID/close` of a running job with `Host: evil.example` (no token); with `--token`, the /ui "
        "cookie on `/v1/agent` from a page on another port"
    )
    measured = (
        f"evil Origin upgrade: {ws_status} {ws_then}; close with evil Host: {close_status}; "
        f"cookie upgrade: {cookie_text}"
    )
    met = ws_status != 101 and not 200 <= close_status < 300 and cookie_status != 101
    info = {"ws_status": ws_status, "close_status": close_status, "cookie_status": cookie_status}
    return Result("5", did, measured, "no 101, no 2xx", met, info)


async def _posts(s: Any, urls: list[tuple[str, dict[str, Any]]], seconds: float, workers: int = 8) -> dict[str, Any]:
    """POST each (url, json) until done, ``seconds``, a 403 or a 503: statuses counted."""
    todo, statuses, states = iter(urls), {}, {}
    t0 = time.monotonic()
    full = False

    async def worker() -> None:
        nonlocal full
        for url, body in todo:
            if full or time.monotonic() - t0 > seconds:
                return
            async with s.post(url, json=body) as r:
                statuses[r.status] = statuses.get(r.status, 0) + 1
                if r.status == 200:
                    state = (await r.json()).get("state")
                    states[state] = states.get(state, 0) + 1
                full = full or r.status in (403, 503)  # refused outright, or the table is full

    await asyncio.gather(*(worker() for _ in range(workers)))
    return {"statuses": statuses, "states": states, "s": time.monotonic() - t0}


async def probe_hosts(ctx: Ctx) -> Result:
    from rdzv_server.hosts import DEFAULT_MAX_HOSTS

    token, operator = secrets.token_hex(16), secrets.token_hex(16)
    server = ctx.server("srv", "--token", token, "--operator-token", operator)
    try:
        # the attacker holds the agents' token; the operator token stays with the operator
        async with session(headers={"Authorization": f"Bearer {token}"}) as s:
            health = [(server.url + f"/v1/hosts/madeup-h{i // 3}/health", {"reason": "made up"}) for i in range(30_000)]
            rep = await _posts(s, health, ctx.seconds)
            cordons = [
                (server.url + f"/v1/hosts/madeup-c{i}/cordon", {"reason": "made up"})
                for i in range(DEFAULT_MAX_HOSTS + 100)
            ]
            cor = await _posts(s, cordons, ctx.seconds if ctx.quick else max(60.0, ctx.seconds))
            async with s.get(server.url + "/v1/hosts?limit=1000") as r:
                hosts = len((await r.json())["hosts"]) if r.status == 200 else 0
            op = {"Authorization": f"Bearer {operator}"}
            async with s.post(server.url + "/v1/hosts/real-host-1/cordon", json={"reason": "maint"}, headers=op) as r:
                op_status = r.status
    finally:
        server.stop()
    n = lambda d: sum(d.values())  # noqa: E731
    did = (
        "host records (`--token` and `--operator-token`; the attacker holds the agents' token): health reports for "
        "made-up hosts (3 each) for the attack time; made-up cordons until refused or the table's 10,000 records "
        "+ 100; then the operator's cordon of a real host"
    )
    measured = (
        f"{n(rep['statuses']):,} health reports in {rep['s']:.1f} s ({rep['statuses']}): "
        f"{rep['states'].get('cooled_down', 0):,} made-up hosts cooled down; {n(cor['statuses']):,} "
        f"cordons in {cor['s']:.1f} s ({cor['statuses']}); first page {hosts} records; operator's cordon: {op_status}"
    )
    return Result("6", did, measured, "operator's cordon: 200", op_status == 200, {"health": rep, "cordons": cor})


async def _hold_joined(s: Any, url: str, n: int) -> tuple[list[Any], int]:
    """``n`` WebSockets joined to one job (1:100000, 7-day heartbeat timeout): (sockets, how many joined)."""
    socks: list[Any] = []
    joined = 0
    sem = asyncio.Semaphore(32)

    async def one(i: int) -> None:
        nonlocal joined
        async with sem:
            try:
                ws = await s.ws_connect(url + "/v1/agent")
            except Exception:
                return
            socks.append(ws)
            await ws.send_str(join_text("slots", f"n{i}", nnodes=(1, 100_000), heartbeat_timeout_s=MAX_TIMEOUT_S))
            msg = await until(ws, {"joined"}, ANSWER_S)
            joined += bool(msg and msg["op"] == "joined")

    await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    return socks, joined


async def _real_join(url: str) -> str:
    import aiohttp

    try:
        async with session(OTHER_ADDR) as s, s.ws_connect(url + "/v1/agent") as ws:
            await ws.send_str(join_text("real", "n1"))
            msg = await until(ws, {"assigned"}, ANSWER_S)
            return "accepted" if msg and msg["op"] == "assigned" else refused(msg, ws)
    except (aiohttp.ClientError, OSError) as e:
        return f"refused: {type(e).__name__}"


async def probe_slots(ctx: Ctx) -> Result:
    import aiohttp

    server = ctx.server("srv", "--max-connections", "300")
    try:
        async with session() as s:
            socks, joined = await _hold_joined(s, server.url, 300)
            real = await _real_join(server.url)
            await asyncio.gather(*(ws.close() for ws in socks), return_exceptions=True)
    finally:
        server.stop()
    streams = 1000
    server = ctx.server("streams")
    raw: list[socket.socket] = []
    try:
        req = f"GET /v1/events HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n\r\n".encode()
        for _ in range(streams):
            sock = never_reading(server.port, req)
            if sock is not None:
                raw.append(sock)
        await asyncio.sleep(1.0)
        try:
            async with session(OTHER_ADDR) as s, s.get(server.url + "/v1/events") as r:
                dash = r.status
        except (aiohttp.ClientError, OSError) as e:
            dash = 0
            dash_why = type(e).__name__
    finally:
        for sock in raw:
            sock.close()
        server.stop()
    did = (
        f"slots: `--max-connections 300`, one address opens 300 WebSockets joined to one job (1:100000, "
        f"7-day heartbeat timeout), then a real join from {OTHER_ADDR}; {streams:,} event streams that never "
        "read (default flags), then a dashboard's stream"
    )
    dash_text = str(dash) if dash else f"no answer ({dash_why})"
    measured = f"{joined} joined; real join: {real}; {len(raw):,} streams open; dashboard's stream: {dash_text}"
    met = real == "accepted" and dash == 200
    return Result("7", did, measured, "real join accepted; dashboard 200", met, {"joined": joined, "dash": dash})


async def probe_throttle(ctx: Ctx) -> Result:
    token = secrets.token_hex(16)
    server = ctx.server("srv", "--token", token)
    statuses: dict[int, int] = {}
    try:
        guess = await _guess_secrets(server.url, token, min(ctx.seconds, 3.0))
        async with session() as s:
            for i in range(20):
                async with s.get(server.url + "/v1/jobs", headers={"Authorization": f"Bearer wrong{i}"}) as r:
                    statuses[r.status] = statuses.get(r.status, 0) + 1
            async with s.get(server.url + "/v1/jobs", headers={"Authorization": f"Bearer {token}"}) as r:
                right = r.status
    finally:
        server.stop()
    try:
        weak = ctx.server("weak", "--token", "x")
        weak.stop()
        weak_text = "starts"
    except RuntimeError:
        weak_text = "refused to start"
    did = (
        "throttle: a token holder guesses a job's secret (wrong-secret joins, reconnecting when closed) for "
        f"{guess['s']:.0f} s; 20 wrong bearer tokens from 127.0.0.1, then the right token from the same address"
    )
    measured = (
        f"{guess['guesses']:,} secret guesses answered ({guess['guesses'] / guess['s']:,.0f}/s, "
        f"{guess['connections']} connections{', ' + guess['other'] if guess['other'] else ''}); "
        f"wrong tokens: {statuses}; right token: {right}; a server with `--token x`: {weak_text}"
    )
    info = {"wrong": statuses, "right": right, "guess": guess, "weak_token": weak_text}
    return Result("8", did, measured, "right token: 200", right == 200, info)


async def _guess_secrets(url: str, token: str, seconds: float) -> dict[str, Any]:
    """Joins to a job with a secret, each with another wrong secret: on each
    connection a burst of GUESS_BURST (the server's error allowance) sent at
    once, their answers read, then a new connection. Counted: the guesses the
    server answered ``job_secret_mismatch``; any other answer ends it."""
    import aiohttp

    out: dict[str, Any] = {"guesses": 0, "connections": 0, "other": ""}
    auth = {"Authorization": f"Bearer {token}"}
    t0 = time.monotonic()
    async with session(headers=auth) as s, s.ws_connect(url + "/v1/agent") as team:
        await team.send_str(join_text("guarded", "team-n1", job_secret="team-" + secrets.token_hex(16)))
        msg = await until(team, {"assigned"}, ANSWER_S)
        if msg is None or msg["op"] != "assigned":
            out["other"] = f"setup: {refused(msg, team)}"
            out["s"] = time.monotonic() - t0
            return out
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds and not out["other"]:
            try:
                ws = await s.ws_connect(url + "/v1/agent")
            except (aiohttp.ClientError, OSError) as e:
                out["other"] = f"refused: {type(e).__name__}"
                break
            out["connections"] += 1
            async with ws:
                try:
                    for i in range(GUESS_BURST):
                        guess = f"guess-{out['guesses'] + i:012d}-padded-to-a-plausible-length"
                        await ws.send_str(join_text("guarded", f"g{out['guesses'] + i}", job_secret=guess))
                except (ConnectionError, RuntimeError):
                    pass
                for _ in range(GUESS_BURST):
                    msg = await until(ws, {"joined"}, ANSWER_S)
                    if msg is None:
                        break
                    if msg["op"] == "joined":
                        out["other"] = "a wrong secret joined"
                    elif msg.get("code") != "job_secret_mismatch":
                        out["other"] = refused(msg)
                    if out["other"]:
                        break
                    out["guesses"] += 1
    out["s"] = max(time.monotonic() - t0, 1e-3)
    return out


PROBES = {
    "4": ("reused job id", probe_reused),
    "5": ("cross-origin", probe_origin),
    "6": ("host records", probe_hosts),
    "7": ("slots", probe_slots),
    "8": ("throttle", probe_throttle),
}
