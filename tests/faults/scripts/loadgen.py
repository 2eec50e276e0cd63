"""Simulated nodes for the load test: WebSocket clients that speak the agent
protocol (join, heartbeat at the server's ``heartbeat_s``) and run no workers.

    python loadgen.py --endpoint HOST:PORT --jobs 2 --nodes 1000

starts ``jobs * nodes`` clients; job ``sim-J`` gets ``nodes`` of them, with
``--nnodes N:N`` so its round completes when all have joined. Once a second
it prints one JSON line of counters::

    {"t": 3.0, "connected": 2000, "joined": 2000, "assigned": 2000, "evicted": 0,
     "restart": 0, "errors": 0, "dropped": 0, "done": 0, "hb": 5321, "connect_s": 2.1}

A node that is evicted, told to restart, or whose connection drops is counted
and not replaced: the test wants those counters at 0. Runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time

import aiohttp

COUNTERS = ("connected", "joined", "assigned", "evicted", "restart", "errors", "dropped", "done", "hb")


async def node(session: aiohttp.ClientSession, url: str, job: str, i: int, n: int, stats: dict,
               gate: asyncio.Semaphore, stop: asyncio.Event) -> None:
    join = {"op": "join", "job_id": job, "node_id": f"{job}-n{i:05d}", "host": f"sim{i}", "addr": "127.0.0.1",
            "local_world_size": 1, "master_port": 20000 + i % 20000,
            "spec": {"min_nodes": n, "max_nodes": n}}
    async with gate:  # connect and join a bounded number at a time
        ws = await session.ws_connect(url, heartbeat=None, max_msg_size=4 << 20)
        stats["connected"] += 1
        await ws.send_str(json.dumps(join))
    hb_task = None
    try:
        async for frame in ws:
            if frame.type != aiohttp.WSMsgType.TEXT:
                continue
            msg = json.loads(frame.data)
            op = msg.get("op")
            if op == "joined":
                stats["joined"] += 1
                if hb_task is None:
                    hb_task = asyncio.ensure_future(heartbeat(ws, float(msg["heartbeat_s"]), stats))
            elif op == "assigned":
                stats["assigned"] += 1
            elif op in ("evicted", "restart", "done"):
                stats[op] += 1
                if op == "done":
                    break
            elif op == "error":
                stats["errors"] += 1
                print(json.dumps({"error": msg}), flush=True)
        if not stop.is_set() and op != "done":
            stats["dropped"] += 1
    finally:
        if hb_task is not None:
            hb_task.cancel()
        await ws.close()


async def heartbeat(ws, every: float, stats: dict) -> None:
    await asyncio.sleep(random.uniform(0, every))  # spread them out, as real agents are
    while not ws.closed:
        await ws.send_str('{"op":"hb"}')
        stats["hb"] += 1
        await asyncio.sleep(every)


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--endpoint", required=True)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--nodes", type=int, default=1000, help="nodes per job")
    p.add_argument("--concurrency", type=int, default=200)
    args = p.parse_args()
    url = f"http://{args.endpoint}/v1/agent"
    stats = dict.fromkeys(COUNTERS, 0)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    gate = asyncio.Semaphore(args.concurrency)
    start = time.monotonic()
    connect_s = None
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = [asyncio.ensure_future(node(session, url, f"sim-{j}", i, args.nodes, stats, gate, stop))
                 for j in range(args.jobs) for i in range(args.nodes)]
        total = len(tasks)
        while not stop.is_set():
            if connect_s is None and stats["assigned"] >= total:
                connect_s = round(time.monotonic() - start, 2)
            failed = sum(1 for t in tasks if t.done() and not t.cancelled() and t.exception() is not None)
            print(json.dumps({"t": round(time.monotonic() - start, 1), **stats, "failed": failed,
                              "connect_s": connect_s}), flush=True)
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


if __name__ == "__main__":
    asyncio.run(main())
    sys.exit(0)
