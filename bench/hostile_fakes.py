"""Probe 9 of bench/hostile.py: a real ``rdzv-agent --server-timeout 5`` against
servers that are broken on purpose (aiohttp apps in the bench's own loop, on
127.0.0.1), each speaking just enough of the agent channel to be one:

* ``closes``: accepts the WebSocket upgrade, then closes the connection;
* ``silent``: accepts the upgrade, reads the join, never answers;
* ``unavailable``: answers every join with an ``unavailable`` error frame and
  closes, as the real server refuses a new job (``--max-waiting-jobs``, a full disk);
* ``evicts`` (not judged: how often the agent rejoins): answers every join with ``evicted``.

The agent (``--no-python true``: it never gets as far as a worker) has
``--server-timeout`` + 5 s to exit; then the bench waits 5 s more, to tell
"late" from "never", and kills what is left by pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from typing import Any

from . import _common as C
from .hostile import Ctx, Result

SERVER_TIMEOUT_S = 5.0
GRACE_S = 5.0  # the target: exit within --server-timeout + GRACE_S
EXTRA_WAIT_S = 5.0  # after the target, to tell a late exit from none
JUDGED = ("closes", "silent", "unavailable")


def _app(mode: str) -> Any:
    from aiohttp import web

    async def agent(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        request.app["upgrades"] += 1
        if mode == "closes":
            await ws.close()
            return ws
        async for frame in ws:  # silent: read, never answer
            if frame.type != web.WSMsgType.TEXT or '"join"' not in frame.data:
                continue
            request.app["joins"] += 1
            if mode == "unavailable":
                err = {"op": "error", "code": "unavailable", "message": "too many jobs wait: retry later"}
                await ws.send_str(json.dumps(err))
                await ws.close()
                break
            if mode == "evicts":
                await ws.send_str(json.dumps({"op": "evicted", "reason": "evicted by a broken server"}))
        return ws

    app = web.Application()
    app["upgrades"] = 0
    app["joins"] = 0
    app.router.add_get("/v1/agent", agent)
    return app


async def _one(ctx: Ctx, mode: str) -> dict[str, Any]:
    from aiohttp import web

    app = _app(mode)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    port = C.free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    log = ctx.tmp / f"agent-{mode}.log"
    argv = [
        sys.executable,
        "-m",
        "rdzv_client.agent",
        "--endpoint",
        f"127.0.0.1:{port}",
        "--job-id",
        f"broken-{mode}",
        "--server-timeout",
        f"{SERVER_TIMEOUT_S:g}",
        "--no-python",
        "true",
    ]
    env = dict(os.environ, TMPDIR=str(ctx.tmp))  # its run directory goes with the bench's
    proc = C.Proc(f"agent-{mode}", argv, log, env=env, cwd=C.ROOT)
    bound = bound_s()
    try:
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(proc.popen.wait, bound)
        rc = proc.poll()
        took = (proc.exited_at - proc.launched_at) if proc.exited_at is not None else None
    finally:
        proc.stop(1.0)
        await runner.cleanup()
    text = proc.text()
    return {
        "mode": mode,
        "rc": rc,
        "s": took,
        "upgrades": app["upgrades"],
        "joins": app["joins"],
        "lines": text.count("\n"),
        "warnings": text.count("WARNING"),
    }


async def probe_broken(ctx: Ctx) -> Result:
    runs = await asyncio.gather(*(_one(ctx, m) for m in (*JUDGED, "evicts")))
    evicts = runs.pop()
    limit = SERVER_TIMEOUT_S + GRACE_S

    def cell(r: dict[str, Any]) -> str:
        how = (
            f"exit {r['rc']} after {r['s']:.1f} s"
            if r["rc"] is not None
            else f"still running after {bound_s():g} s (stopped)"
        )
        return f"{r['mode']}: {how}, {r['upgrades']} connections, {r['joins']} joins, {r['lines']} log lines"

    did = (
        f"broken servers: a real `rdzv-agent --server-timeout {SERVER_TIMEOUT_S:g}` against a fake server that "
        "closes after the upgrade / never answers the join / answers `unavailable` (at once; not judged: one "
        "that answers every join with `evicted`)"
    )
    rejoins = f"; evicts (not judged): {evicts['joins']:,} joins in {evicts['s'] or bound_s():.0f} s"
    met = all(r["rc"] is not None and r["s"] is not None and r["s"] <= limit for r in runs)
    measured = "; ".join(cell(r) for r in runs) + rejoins
    return Result("9", did, measured, f"each exits within {limit:g} s", met, {"runs": runs, "evicts": evicts})


def bound_s() -> float:
    """How long an agent is given before it is stopped."""
    return SERVER_TIMEOUT_S + GRACE_S + EXTRA_WAIT_S


PROBES = {"9": ("broken servers", probe_broken)}
