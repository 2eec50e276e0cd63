"""A broken rdzv server for the give-up tests: an aiohttp WebSocket server on
127.0.0.1, in a thread, that misbehaves in one named way at every connection.

* ``close``: accepts the upgrade, then closes at once.
* ``silent``: accepts and reads, answers nothing (pings only: aiohttp's autoping).
* ``joined_close``: answers the join with ``joined``, then closes.
* ``refuse:CODE``: answers each join with ``error CODE`` and, like the real
  server, each heartbeat of the unjoined connection with ``not_joined``.
* ``evict``: answers each join with ``evicted``.

Counts connections and joins (for the backoff's assertions)."""

from __future__ import annotations

import asyncio
import json
import threading

from aiohttp import WSMsgType, web

HEARTBEAT = '{"op":"hb"}'


class BrokenServer:
    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.connections = 0
        self.joins = 0
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.port = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(10), "broken server did not start"

    async def _agent(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        self.connections += 1
        if self.mode == "close":
            await ws.close()
            return ws
        async for frame in ws:
            if frame.type != WSMsgType.TEXT:
                continue
            if frame.data == HEARTBEAT:
                if self.mode.startswith("refuse:"):
                    await ws.send_str(json.dumps({"op": "error", "code": "not_joined", "message": "join first"}))
                continue
            msg = json.loads(frame.data)
            if msg.get("op") != "join":
                continue
            self.joins += 1
            if self.mode == "joined_close":
                await ws.send_str(
                    json.dumps({"op": "joined", "round": 0, "node_id": msg["node_id"], "heartbeat_s": 2.0})
                )
                await ws.close()
            elif self.mode.startswith("refuse:"):
                code = self.mode.split(":", 1)[1]
                await ws.send_str(json.dumps({"op": "error", "code": code, "message": "try later"}))
            elif self.mode == "evict":
                await ws.send_str(json.dumps({"op": "evicted", "reason": "go away"}))
        return ws

    def _run(self) -> None:
        async def start() -> None:
            app = web.Application()
            app.router.add_get("/v1/agent", self._agent)
            self.runner = web.AppRunner(app, access_log=None)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self.ready.set()

        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(start())
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.close()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
