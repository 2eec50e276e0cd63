"""A stand-in rendezvous endpoint that timestamps an agent's first word (row 0
of bench/compare.py), and what a bare import costs beside it."""

from __future__ import annotations

import json
import sys
import time

from . import _common as C


class FirstContact:
    """A stand-in for the rendezvous endpoint that only timestamps the first
    contact, on its own thread: for rdzv, the first WebSocket text frame whose
    op is ``join`` (on the real agent path); for torchrun, the first bytes a
    connection sends (its c10d store client, ``is_host=0``)."""

    def __init__(self, port: int, ws: bool) -> None:
        import asyncio
        import threading

        self.port, self.ws = port, ws
        self.at: float | None = None
        self.pid: int | None = None  # the agent's: its CPU time is read at the first contact
        self.cpu_s: float | None = None
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="first-contact", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("first-contact listener did not start")

    def _run(self) -> None:
        import asyncio

        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        self._ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self._stop())
        self.loop.close()

    async def _start(self) -> None:
        import asyncio

        if self.ws:
            from aiohttp import web

            from rdzv_common.protocol import AGENT_PATH

            app = web.Application()
            app.router.add_get(AGENT_PATH, self._on_ws)
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        else:
            self._server = await asyncio.start_server(self._on_raw, "127.0.0.1", self.port)

    async def _stop(self) -> None:
        if self.ws:
            await self._runner.cleanup()
        else:
            self._server.close()
            await self._server.wait_closed()

    async def _on_ws(self, request):
        from aiohttp import WSMsgType, web

        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for msg in ws:
            if msg.type == WSMsgType.TEXT:
                try:
                    op = json.loads(msg.data).get("op")
                except ValueError:
                    op = None
                if op == "join":
                    self._stamp()
                    break
        await ws.close()
        return ws

    async def _on_raw(self, reader, writer) -> None:
        try:
            if await reader.read(1):
                self._stamp()
        finally:
            writer.close()

    def _stamp(self) -> None:
        if self.at is None:
            self.at = time.time()
            ticks = C.cpu_ticks(self.pid) if self.pid else None
            self.cpu_s = ticks / C.CLK_TCK if ticks is not None else None

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def _floor_s(code: str, reps: int = 3) -> float:
    """Best wall time of ``python -c CODE`` (what an import costs by itself here)."""
    import subprocess

    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, cwd=C.ROOT)
        best = min(best, time.perf_counter() - t)
    return best
