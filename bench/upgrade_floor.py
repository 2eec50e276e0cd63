"""What an agent's WebSocket upgrade costs the server, against the floor.

    python -m bench.upgrade_floor [--nodes 16384] [--clients 2] [--reps 2]

N simulated nodes (bench/bigagents.py, ``--clients`` processes, as
bench/big_job.py's connect phase) each open a WebSocket and send nothing, first
to a real ``rdzv-server`` (its agent path: aiohttp's request handling, the
middlewares, ``WebSocketResponse.prepare``, the channel's setup), then to the
floor: a bare uvloop protocol (this module, :class:`Floor`) that answers the
same upgrade request with the RFC 6455 handshake and nothing else (no HTTP
framework, no checks, no frames read). The table gives the server's CPU per
upgrade (utime+stime from /proc, from the first connect to 1 s after the
last), the wall time and the clients' CPU, for each, alternating ``--reps``
times. What lies between the two rows is what a path of the server's own for
the agent's upgrade could save at most; the kernel's share (accept, the
reads, the 101's write) is in both.

Runs in a network namespace of its own with the accept queue raised, as
bench/big_job.py does.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rdzv_server.conns import LISTEN_BACKLOG

from . import _common as C
from .big_job import JOIN_DEADLINE_S, BigClients, BigServer
from .rawws import accept_key

SETTLE_S = 1.0  # after the last connect: what the server defers past the storm counts too
_HEAD_MAX = 8192


class Floor(asyncio.Protocol):
    """The least a server can do for an upgrade: read the request head, answer 101 with the
    accept key, then ignore the connection (kept open until the client closes it)."""

    __slots__ = ("transport", "head", "done")

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.head = b""
        self.done = False

    def data_received(self, data: bytes) -> None:
        if self.done:
            return
        self.head += data
        end = self.head.find(b"\r\n\r\n")
        if end < 0:
            if len(self.head) > _HEAD_MAX:
                self.transport.close()
            return
        key = b""
        for line in self.head[:end].split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"sec-websocket-key":
                key = value.strip()
        accept = accept_key(key)
        self.transport.write(  # type: ignore[attr-defined]
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n"
        )
        self.done = True


async def _serve_floor(port: int) -> None:
    loop = asyncio.get_running_loop()
    await loop.create_server(Floor, "127.0.0.1", port, backlog=LISTEN_BACKLOG, reuse_address=True)
    print("ready", flush=True)
    await asyncio.Event().wait()


def floor_main(port: int) -> None:
    try:
        import uvloop
    except ImportError:  # the server's loop where it has uvloop; plain asyncio else
        asyncio.run(_serve_floor(port))
    else:
        uvloop.run(_serve_floor(port))


class FloorServer:
    def __init__(self) -> None:
        self.port = C.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.upgrade_floor", "--serve-floor", str(self.port)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            self.stop()
            raise RuntimeError("the floor server did not start")
        self.pid = self.proc.pid

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def measure(server, n: int, n_clients: int) -> dict:
    """N WebSockets opened to ``server`` (a BigServer or a FloorServer), none joined."""
    clients = BigClients(n_clients, server.url + "/v1/agent")
    try:
        ids = [[f"n{i}", i] for i in range(n)]
        t0, cpu, ccpu = time.time(), C.cpu_ticks(server.pid) or 0, clients.cpu()
        clients.all(
            [{"cmd": "connect", "job": "floor", "spec": {}, "nodes": ids[i::n_clients]} for i in range(n_clients)]
        )
        wall = time.time() - t0
        client_cpu = (clients.cpu() - ccpu) / C.CLK_TCK
        time.sleep(SETTLE_S)
        server_cpu = ((C.cpu_ticks(server.pid) or 0) - cpu) / C.CLK_TCK
    finally:
        clients.stop()
    return {
        "wall_s": wall,
        "server_cpu_s": server_cpu,
        "client_cpu_s": client_cpu,
        "us_per_upgrade": server_cpu / n * 1e6,
    }


def run(n: int, n_clients: int, reps: int, log=print) -> list[dict]:
    C.raise_nofile()
    out = []
    for rep in range(reps):
        for kind in ("rdzv-server", "floor"):
            tmp = Path(tempfile.mkdtemp(prefix="rdzv-bench-floor-"))
            try:
                rdzv = kind == "rdzv-server"
                server = BigServer(tmp, extra=["--join-deadline", str(JOIN_DEADLINE_S)]) if rdzv else FloorServer()
                try:
                    r = {"kind": kind, "rep": rep, "nodes": n, **measure(server, n, n_clients)}
                finally:
                    server.stop()
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            log(f"[upgrade_floor] {kind}: {r['us_per_upgrade']:.0f} us of server CPU per upgrade")
            out.append(r)
    return out


def table(results: list[dict]) -> str:
    rows = [
        [
            f"{r['kind']} (rep {r['rep'] + 1})",
            f"{r['us_per_upgrade']:.0f} us",
            f"{r['wall_s']:.2f} s",
            f"{r['client_cpu_s']:.2f} s",
        ]
        for r in results
    ]
    n = results[0]["nodes"]
    return C.md_table(
        [f"{n} agent WebSockets opened, none joined", "server CPU per upgrade", "wall", "clients' CPU"], rows
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.upgrade_floor", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=16384)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--serve-floor", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.serve_floor is not None:
        floor_main(a.serve_floor)
        return
    if a.nodes < 1 or a.reps < 1:
        p.error("--nodes and --reps: at least 1")
    C.reexec_in_netns("bench.upgrade_floor", sys.argv[1:] if argv is None else argv, backlog=LISTEN_BACKLOG)
    results = run(a.nodes, a.clients, a.reps, lambda s: print(s, file=sys.stderr))
    print(table(results))
    print(f"\nload average: {C.loadavg()}")


if __name__ == "__main__":
    main()
