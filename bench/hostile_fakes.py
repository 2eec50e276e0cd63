"""Probe 9 of bench/hostile.py: a real ``rdzv-agent --server-timeout 5`` against
servers that are broken on purpose (aiohttp apps in the bench's own loop, on
127.0.0.1), each speaking just enough of the agent channel to be one:

* ``closes``: accepts the WebSocket upgrade, then closes the connection;
* ``silent``: accepts the upgrade, reads the join, never answers;
* ``unavailable``: answers every join with an ``unavailable`` error frame and
  closes, as the real server refuses a new job (``--max-waiting-jobs``, a full disk).

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
            if mode == "unavailable" and frame.type == web.WSMsgType.TEXT and '"join"' in frame.data:
                err = {"op": "error", "code": "unavailable", "message": "too many jobs wait: retry later"}
                await ws.send_str(json.dumps(err))
                await ws.close()
                break
        return ws

    app = web.Application()
    app["upgrades"] = 0
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
    bound = SERVER_TIMEOUT_S + GRACE_S + EXTRA_WAIT_S
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
        "lines": text.count("\n"),
        "warnings": text.count("WARNING"),
    }


async def probe_broken(ctx: Ctx) -> Result:
    runs = await asyncio.gather(*(_one(ctx, m) for m in ("closes", "silent", "unavailable")))
    limit = SERVER_TIMEOUT_S + GRACE_S

    def cell(r: dict[str, Any]) -> str:
        how = (
            f"exit {r['rc']} after {r['s']:.1f} s"
            if r["rc"] is not None
            else f"still running after {SERVER_TIMEOUT_S + GRACE_S + EXTRA_WAIT_S:g} s (stopped)"
        )
        return f"{r['mode']}: {how}, {r['upgrades']} connections, {r['lines']} log lines"

    did = (
        f"broken servers: a real `rdzv-agent --server-timeout {SERVER_TIMEOUT_S:g}` against a fake server that "
        "closes after the upgrade / never answers the join / answers `unavailable` (three at once)"
    )
    met = all(r["rc"] is not None and r["s"] is not None and r["s"] <= limit for r in runs)
    return Result("9", did, "; ".join(cell(r) for r in runs), f"each exits within {limit:g} s", met, {"runs": runs})


PROBES = {"9": ("broken servers", probe_broken)}
