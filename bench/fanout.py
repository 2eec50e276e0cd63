"""What the server's CPU pays per message it writes to agent connections (issue 24).

    python -m bench.fanout [--nodes 4096,16384] [--rounds 5] [--out results.json]

N real WebSocket connections to an in-process aiohttp server, each with the
server's own channel (rdzv_server.ws_channel.WsChannel); the peers are raw
sockets in a separate process that read and discard (as cheap a reader as can
be, so the machine's cores go to the server). Measured: the server process's
CPU time (time.process_time, so other load on the machine counts less than in
wall time) to hand every connection one message and have it written, for

broadcast
    one text object for every connection, as the store hands a ``restart`` to
    every survivor;
per node
    a distinct ~300-byte text per connection, as an ``assigned``;

each by the two ways a channel writes: ``direct`` (framed in the channel and
written to the transport at once, when the connection is idle) and ``queued``
(the channel's queue and writer task, then aiohttp's ``send_str``: every
message before this path existed). The median of ``--rounds`` rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import selectors
import socket
import subprocess
import sys
import time

from aiohttp import web

from rdzv_server.ws_channel import WsChannel

from . import _common as C


def _client(port: int, n: int) -> None:
    """The peers: ``n`` raw WebSocket connections that read and discard until stdin closes."""
    C.raise_nofile()
    sel = selectors.DefaultSelector()
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        key = base64.b64encode(os.urandom(16)).decode()
        s.sendall(
            (
                f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = s.recv(4096)
            if not chunk:
                raise SystemExit("the server closed a connection during the handshake")
            head += chunk
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    sel.register(sys.stdin, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            if key.fileobj is sys.stdin:
                return
            try:
                if not key.fileobj.recv(1 << 20):  # type: ignore[union-attr]
                    sel.unregister(key.fileobj)
            except BlockingIOError:
                pass


async def _measure(n: int, rounds: int) -> dict:
    channels: list[WsChannel] = []
    all_in = asyncio.Event()

    async def handler(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        channels.append(WsChannel(ws, request.transport, "bench"))
        if len(channels) == n:
            all_in.set()
        async for _ in ws:
            pass
        return ws

    app = web.Application()
    app.router.add_get("/ws", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = C.free_port()
    site = web.TCPSite(runner, "127.0.0.1", port, backlog=4096)
    await site.start()
    peers = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.fanout", "--client", str(port), str(n), stdin=subprocess.PIPE
    )
    try:
        await asyncio.wait_for(all_in.wait(), 600)
        out: dict = {"nodes": n}
        broadcast = json.dumps({"op": "restart", "round": 1, "reason": "node n9 (sim9) connection lost"})
        per_node = [
            json.dumps({"op": "assigned", "assignment": {"job_id": "big", "group_rank": i, "pad": "x" * 200}})
            for i in range(n)
        ]
        for path in ("direct", "queued"):
            for chan in channels:
                chan.direct = path == "direct"
            for kind in ("broadcast", "per node"):
                spent = []
                for _ in range(rounds):
                    await asyncio.sleep(0.2)  # the peers drain what came before
                    t = time.process_time()
                    for i, chan in enumerate(channels):
                        chan.deliver(broadcast if kind == "broadcast" else per_node[i])
                    for _ in range(100_000):  # the writers' turn (queued), a bounded wait
                        if not any(c.queued() for c in channels):
                            break
                        await asyncio.sleep(0)
                    await asyncio.sleep(0)
                    spent.append(time.process_time() - t)
                    assert not any(c.killed for c in channels), "a peer fell behind: the bench is wrong"
                out[f"{path} {kind} us"] = C.median(spent) / n * 1e6
        out["load"] = C.loadavg()
        return out
    finally:
        if peers.stdin is not None:
            peers.stdin.close()
        await asyncio.wait_for(peers.wait(), 30)
        await runner.cleanup()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="4096,16384")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None)
    p.add_argument("--client", nargs=2, type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.client:
        _client(*a.client)
        return
    C.raise_nofile()
    results = [asyncio.run(_measure(int(n), a.rounds)) for n in a.nodes.split(",")]
    rows = []
    for r in results:
        for kind in ("broadcast", "per node"):
            q, d = r[f"queued {kind} us"], r[f"direct {kind} us"]
            rows.append([f"{r['nodes']:,}", kind, f"{q:.1f} us", f"{d:.1f} us", f"{(q - d) * r['nodes'] / 1e6:.2f} s"])
    print(
        C.md_table(
            ["N", "message", "queued (aiohttp send_str)", "direct", "server CPU saved per round of N messages"], rows
        )
    )
    print(f"\nload average: {', '.join(r['load'] for r in results)}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
