"""Probes 1-8 and 10 of bench/hostile.py: each attacks its own real rdzv-server
and returns one row (see bench/hostile.py for what each does and the targets)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import sqlite3
import time
from typing import Any

from . import _common as C
from .hostile import (
    MAX_TIMEOUT_S,
    OTHER_ADDR,
    TARGET_RSS_MB,
    Ctx,
    Result,
    Watch,
    hz,
    hz_ok,
    join_text,
    refused,
    session,
    until,
)

RSS_CAP_MB = 2048.0  # the bench stops an attack when the server grows past this (a shared machine)
ANSWER_S = 10.0  # how long the bench waits for any one answer
WINDOW = 16  # failure reports a client sends ahead of the server's answers
EMOJI = "\U0001f600"  # 4 bytes of UTF-8, 12 once JSON-escaped (\ud83d\ude00)


def _failed_frame(round_no: int, records: int = 8) -> str:
    """A ``failed`` report as big as a frame allows: ``records`` exit records
    (what an event keeps) whose messages are 4-byte characters."""
    from rdzv_server.wire import MAX_BODY_BYTES, MAX_ERROR_MESSAGE

    def frame(n: int) -> str:
        recs = [
            {"local_rank": i, "rank": i, "pid": 1000 + i, "exit_code": 1, "message": EMOJI * n} for i in range(records)
        ]
        return json.dumps({"op": "failed", "round": round_no, "failures": recs}, ensure_ascii=False)

    lo, hi = 1, MAX_ERROR_MESSAGE
    while lo < hi:  # the longest message that keeps the frame under the limit (with room for the round)
        mid = (lo + hi + 1) // 2
        if len(frame(mid).encode()) <= MAX_BODY_BYTES - 32:
            lo = mid
        else:
            hi = mid - 1
    return frame(lo)


async def failure_loop(url: str, job: str, seconds: float, max_failures: int, watch: Watch | None) -> dict[str, Any]:
    """One joined node of a 1:1 job (a million restarts, no storm stop) reports
    a failure and rejoins the next round, again and again, pipelined (up to
    WINDOW reports ahead of the server's ``restart`` frames, as a script that
    knows round r+1 follows r): until ``seconds``, ``max_failures``, a refusal,
    or the server's RSS passes RSS_CAP_MB."""
    from rdzv_server.wire import MAX_RESTARTS

    spec = {"max_restarts": MAX_RESTARTS, "storm_restarts": 0}
    out: dict[str, Any] = {"failures": 0, "refused": None, "capped": False}
    t0 = time.monotonic()
    async with session() as s, s.ws_connect(url + "/v1/agent", max_msg_size=0) as ws:
        await ws.send_str(join_text(job, "n1", **spec))
        joined = await until(ws, {"joined"}, ANSWER_S)
        msg = await until(ws, {"assigned"}, ANSWER_S) if joined and joined["op"] == "joined" else joined
        if joined is None or msg is None or msg["op"] != "assigned":
            out["refused"] = refused(msg, ws)
            out["s"] = time.monotonic() - t0
            return out
        rejoin = join_text(job, "n1", node_secret=joined.get("node_secret"), run=joined.get("run"), **spec)
        template = _failed_frame(0).replace('"round": 0', '"round": {}', 1)
        first = msg["assignment"]["round"]
        acked = asyncio.Event()
        stop: list[str] = []

        async def read() -> None:
            while not stop:
                got = await until(ws, {"restart", "done"}, ANSWER_S)
                if got is None or got["op"] != "restart":
                    stop.append(refused(got, ws) if got is None or got["op"] == "error" else f"job {got['op']}")
                    acked.set()
                    break
                out["failures"] += 1
                acked.set()

        reader = asyncio.create_task(read())
        sent = 0
        try:
            while not stop and time.monotonic() - t0 < seconds and sent < max_failures:
                if watch is not None and watch.rss_peak / 1024 > RSS_CAP_MB:
                    out["capped"] = True
                    break
                if sent - out["failures"] >= WINDOW:
                    acked.clear()
                    try:
                        await asyncio.wait_for(acked.wait(), ANSWER_S)
                    except asyncio.TimeoutError:
                        stop.append("refused: no answer")
                    continue
                await ws.send_str(template.replace("{}", str(first + sent), 1))
                await ws.send_str(rejoin)
                sent += 1
            deadline = time.monotonic() + ANSWER_S
            while not stop and out["failures"] < sent and time.monotonic() < deadline:  # the reports in flight
                acked.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(acked.wait(), 0.1)
        except (ConnectionError, RuntimeError) as e:
            stop.append(f"refused: connection closed ({type(e).__name__})")
        finally:
            if not stop:
                stop.append("")
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        out["refused"] = stop[0] or None
    out["s"] = time.monotonic() - t0
    return out


def _record_size(server: C.BenchServer, job: str) -> int | None:
    """Bytes of the job's row in the server's SQLite database (read-only)."""
    try:
        db = sqlite3.connect(f"file:{server.data / 'rdzv.db'}?mode=ro", uri=True, timeout=5)
        try:
            row = db.execute("SELECT length(CAST(record AS BLOB)) FROM jobs WHERE job_id = ?", (job,)).fetchone()
        finally:
            db.close()
    except sqlite3.Error:
        return None
    return row[0] if row else None


def _mb(x: float) -> str:
    return f"{x:,.0f} MB"


def _stopped(loop: dict[str, Any]) -> str:
    if loop["capped"]:
        return f" (stopped at the bench's {RSS_CAP_MB:,.0f} MB safety cap)"
    return f", then {loop['refused']}" if loop["refused"] else ""


async def probe_failures(ctx: Ctx) -> Result:
    server = ctx.server("srv")
    try:
        watch = Watch(server)
        loop = await failure_loop(server.url, "fl", ctx.seconds, 100_000, watch)
        w = watch.stop()
        t = time.perf_counter()
        body = C.http_get(server.url + "/v1/jobs/fl", 30)
        view_s = time.perf_counter() - t
        await asyncio.sleep(0.5)  # the last save
        row = _record_size(server, "fl")
    finally:
        server.stop()
    did = (
        f"failure loop: one joined client reports `failed` (8 exit records of 4-byte characters, ~64 KiB "
        f"a frame) and rejoins, for {ctx.seconds:g} s"
    )
    row_text = f"{row / 1e6:.2f} MB" if row is not None else "not read"
    measured = (
        f"{loop['failures']:,} failures in {loop['s']:.1f} s{_stopped(loop)}; RSS peak {_mb(w['rss_peak_mb'])} "
        f"(from {_mb(w['rss_start_mb'])}); {hz(w)}; GET /v1/jobs/ID {len(body or b'') / 1e6:.2f} MB in "
        f"{C.fmt_s(view_s)}, SQLite row {row_text}"
    )
    met = w["rss_peak_mb"] < TARGET_RSS_MB and hz_ok(w)
    target = f"RSS < {TARGET_RSS_MB:g} MB, /healthz p99 < 100 ms"
    return Result("1", did, measured, target, met, {**loop, **w, "view_bytes": len(body or b""), "row_bytes": row})


def _never_reading(port: int, request: bytes) -> socket.socket | None:
    """A connected socket that sent ``request`` and will never read (a tiny receive buffer)."""
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(5)
        s.connect(("127.0.0.1", port))
        s.sendall(request)
        return s
    except OSError:
        s.close()
        return None


async def _hold(seconds: float, watch: Watch) -> bool:
    """Wait ``seconds`` (False: stopped early at the RSS safety cap)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if watch.rss_peak / 1024 > RSS_CAP_MB:
            return False
        await asyncio.sleep(0.05)
    return True


async def probe_replays(ctx: Ctx) -> Result:
    fill = 40 if ctx.quick else 400
    streams = 2 if ctx.quick else 8
    server = ctx.server("srv")
    socks: list[socket.socket] = []
    try:
        loop = await failure_loop(server.url, "fill", max(ctx.seconds, 30.0), fill, None)
        rss_filled = (C.status_kb(server.proc.pid, "VmRSS") or 0) / 1024
        watch = Watch(server)
        t = time.perf_counter()
        body = await asyncio.to_thread(C.http_get, server.url + "/v1/events?since=0", 60)
        since_s = time.perf_counter() - t
        req = f"GET /v1/events HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nLast-Event-ID: 0\r\n\r\n".encode()
        for _ in range(streams):
            s = _never_reading(server.port, req)
            if s is not None:
                socks.append(s)
        held = await _hold(ctx.seconds, watch)
        rss_held = watch.rss_mb()
        for s in socks:
            s.close()
        await asyncio.sleep(1.0 if ctx.quick else 3.0)
        rss_after = watch.rss_mb()
        w = watch.stop()
    finally:
        for s in socks:
            s.close()
        server.stop()
    did = (
        f"replays: the ring filled by {loop['failures']} failure reports as in 1 (server RSS then "
        f"{_mb(rss_filled)}); `GET /v1/events?since=0`; then {streams} streams with `Last-Event-ID: 0` whose "
        f"sockets never read, held {ctx.seconds:g} s, then closed"
    )
    since = f"{len(body) / 1e6:.1f} MB in {C.fmt_s(since_s)}" if body is not None else "no answer"
    cap = "" if held else f" (closed early: the bench's {RSS_CAP_MB:,.0f} MB safety cap)"
    measured = (
        f"since=0: {since}; {len(socks)} streams: RSS peak {_mb(w['rss_peak_mb'])}{cap}, {_mb(rss_held)} at the "
        f"end of the hold, {_mb(rss_after)} after they closed; {hz(w)}"
    )
    met = w["rss_peak_mb"] < TARGET_RSS_MB and rss_after < TARGET_RSS_MB and hz_ok(w)
    info = {**w, "fill": loop, "since_bytes": len(body) if body else None, "since_s": since_s}
    info.update(rss_filled_mb=rss_filled, rss_held_mb=rss_held, rss_after_mb=rss_after, streams=len(socks))
    return Result("2", did, measured, "RSS < 300 MB during and after, /healthz p99 < 100 ms", met, info)


async def _waiting_jobs(url: str, seconds: float, most: int, workers: int = 8) -> dict[str, Any]:
    """Jobs that wait for nodes, made as fast as one client can: join a 1:1 job
    with a 7-day join timeout, leave, next job (``workers`` connections)."""
    made, why = 0, []
    t0 = time.monotonic()
    counter = iter(range(most))

    async def worker(s: Any) -> None:
        nonlocal made
        async with s.ws_connect(url + "/v1/agent") as ws:
            for i in counter:
                if why or time.monotonic() - t0 > seconds:
                    return
                await ws.send_str(join_text(f"w{i}", "n1", join_timeout_s=MAX_TIMEOUT_S))
                msg = await until(ws, {"assigned"}, ANSWER_S)
                if msg is None or msg["op"] != "assigned":
                    why.append(refused(msg, ws))
                    return
                await ws.send_str('{"op":"leave","reason":"bye"}')
                msg = await until(ws, {"ack"}, ANSWER_S)
                if msg is None or msg["op"] != "ack":
                    why.append(refused(msg, ws))
                    return
                made += 1

    async with session() as s:
        await asyncio.gather(*(worker(s) for _ in range(workers)), return_exceptions=True)
    return {"made": made, "s": time.monotonic() - t0, "refused": why[0] if why else None}


async def probe_waiting(ctx: Ctx) -> Result:
    from rdzv_server.store import DEFAULT_MAX_WAITING_JOBS

    cap = 50 if ctx.quick else DEFAULT_MAX_WAITING_JOBS
    server = ctx.server("srv", *(["--max-waiting-jobs", str(cap)] if ctx.quick else []))
    try:
        atk = await _waiting_jobs(server.url, ctx.seconds if ctx.quick else max(30.0, ctx.seconds), cap + 20)
        waiting = json.loads(C.http_get(server.url + "/v1/jobs?state=waiting&limit=1000", 30) or b'{"jobs":[]}')
        async with session(OTHER_ADDR) as s, s.ws_connect(server.url + "/v1/agent") as ws:
            t = time.monotonic()
            await ws.send_str(join_text("legit", "n1"))
            msg = await until(ws, {"assigned"}, ANSWER_S)
            waited = time.monotonic() - t
    finally:
        server.stop()
    ok = msg is not None and msg["op"] == "assigned"
    legit = f"accepted, assigned after {C.fmt_s(waited)}" if ok else f"{refused(msg)} after {C.fmt_s(waited)}"
    did = (
        f"waiting-jobs lever (`--max-waiting-jobs {cap}`): one client makes jobs (join 1:1, 7-day join timeout, "
        f"leave) as fast as it can (8 connections); then a new job's join from {OTHER_ADDR}"
    )
    measured = (
        f"attacker: {atk['made']:,} jobs made in {atk['s']:.1f} s"
        + (f", then {atk['refused']}" if atk["refused"] else "")
        + f" ({len(waiting['jobs']):,} waiting); legitimate join: {legit}"
    )
    return Result("3", did, measured, "the new job is accepted at once", ok, {**atk, "waited_s": waited})


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
    met = not any(took for took, what in out.values()) and not any(w.startswith("setup") for _, w in out.values())
    return Result("4", did, measured, "refused without the previous run's credential", met, {})


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
    """POST each (url, json) until done, ``seconds``, or a 503: statuses counted."""
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
                full = full or r.status == 503

    await asyncio.gather(*(worker() for _ in range(workers)))
    return {"statuses": statuses, "states": states, "s": time.monotonic() - t0}


async def probe_hosts(ctx: Ctx) -> Result:
    from rdzv_server.hosts import DEFAULT_MAX_HOSTS

    server = ctx.server("srv")
    try:
        async with session() as s:
            health = [(server.url + f"/v1/hosts/madeup-h{i // 3}/health", {"reason": "made up"}) for i in range(30_000)]
            rep = await _posts(s, health, ctx.seconds)
            cordons = [
                (server.url + f"/v1/hosts/madeup-c{i}/cordon", {"reason": "made up"})
                for i in range(DEFAULT_MAX_HOSTS + 100)
            ]
            cor = await _posts(s, cordons, ctx.seconds if ctx.quick else max(60.0, ctx.seconds))
            hosts = len(json.loads(C.http_get(server.url + "/v1/hosts?limit=1000", 30) or b'{"hosts":[]}')["hosts"])
            async with s.post(server.url + "/v1/hosts/real-host-1/cordon", json={"reason": "maintenance"}) as r:
                op_status = r.status
    finally:
        server.stop()
    n = lambda d: sum(d.values())  # noqa: E731
    did = (
        "host records: health reports for made-up hosts (3 each) for the attack time; made-up cordons until "
        "refused or the table's 10,000 records + 100; then an operator's cordon of a real host"
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
            sock = _never_reading(server.port, req)
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
    did = "throttle: 20 wrong bearer tokens from 127.0.0.1, then the right token from the same address"
    measured = f"wrong tokens: {statuses}; right token: {right}; a server with `--token x`: {weak_text}"
    return Result("8", did, measured, "right token: 200", right == 200, {"wrong": statuses, "right": right})


async def probe_heartbeats(ctx: Ctx) -> Result:
    from rdzv_server.wire import HEARTBEAT_FRAME

    server = ctx.server("srv")
    sent, why = 0, None
    try:
        async with session() as s, s.ws_connect(server.url + "/v1/agent") as ws:
            await ws.send_str(join_text("hb", "n1"))
            msg = await until(ws, {"assigned"}, ANSWER_S)
            watch = Watch(server)
            if msg is None or msg["op"] != "assigned":
                why = f"setup: {refused(msg, ws)}"
            t0 = time.monotonic()
            while why is None and time.monotonic() - t0 < ctx.seconds:
                if ws.closed:
                    why = f"connection closed by the server (code {ws.close_code})"
                    break
                try:
                    for _ in range(100):
                        await ws.send_str(HEARTBEAT_FRAME)
                    sent += 100
                except (ConnectionError, RuntimeError) as e:
                    why = f"connection closed ({type(e).__name__})"
                await asyncio.sleep(0)
            w = watch.stop()
    finally:
        server.stop()
    did = f"heartbeat flood: one joined client sends heartbeat frames as fast as it can for {ctx.seconds:g} s"
    rate = sent / w["wall_s"] if w["wall_s"] else 0
    measured = (
        f"{sent:,} frames ({rate:,.0f}/s)"
        + (f", then {why}" if why else "")
        + f"; server CPU {w['cpu_share'] * 100:.0f}% of a core; {hz(w)}"
    )
    return Result("10", did, measured, "/healthz p99 < 100 ms", hz_ok(w), {**w, "sent": sent, "why": why})


PROBES = {
    "1": ("failure loop", probe_failures),
    "2": ("replays", probe_replays),
    "3": ("waiting-jobs lever", probe_waiting),
    "4": ("reused job id", probe_reused),
    "5": ("cross-origin", probe_origin),
    "6": ("host records", probe_hosts),
    "7": ("slots", probe_slots),
    "8": ("throttle", probe_throttle),
    "10": ("heartbeat flood", probe_heartbeats),
}
