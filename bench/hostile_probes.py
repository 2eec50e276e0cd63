"""Probes 1-8 and 10 of bench/hostile.py: each attacks its own real rdzv-server
and returns one row (see bench/hostile.py for what each does and the targets)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sqlite3
import time
from typing import Any

from . import _common as C
from .hostile import (
    ANSWER_S,
    MAX_TIMEOUT_S,
    OTHER_ADDR,
    TARGET_RSS_MB,
    Ctx,
    Result,
    Watch,
    hz,
    hz_ok,
    join_text,
    never_reading,
    refused,
    session,
    until,
)

RSS_CAP_MB = 2048.0  # the bench stops an attack when the server grows past this (a shared machine)
WINDOW = 16  # failure reports a client sends ahead of the server's answers
EMOJI = "\U0001f600"  # 4 bytes of UTF-8, 12 once JSON-escaped (\ud83d\ude00)


def _failed_frame(round_no: int, records: int = 8) -> str:
    """A ``failed`` report as big as a frame allows: ``records`` exit records
    (what an event keeps) whose messages are 4-byte characters."""
    from rdzv_common.wire import MAX_BODY_BYTES, MAX_ERROR_MESSAGE

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
    from rdzv_common.wire import MAX_RESTARTS

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
    """Bytes the job takes in the server's SQLite database (read-only): its row and its blobs."""
    try:
        db = sqlite3.connect(f"file:{server.data / 'rdzv.db'}?mode=ro", uri=True, timeout=5)
        try:
            row = db.execute(
                "SELECT length(CAST(record AS BLOB)) + (SELECT coalesce(sum(length(CAST(data AS BLOB))), 0)"
                " FROM job_data WHERE job_id = ?) FROM jobs WHERE job_id = ?",
                (job, job),
            ).fetchone()
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
            s = never_reading(server.port, req)
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


async def probe_heartbeats(ctx: Ctx) -> Result:
    from rdzv_common.wire import HEARTBEAT_FRAME

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
    "10": ("heartbeat flood", probe_heartbeats),
}
