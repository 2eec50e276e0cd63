"""Rows 11 and 12: the event stream and the /ui page (issue 10), rdzv only.

11. Event delivery: ``clients`` Server-Sent Events clients on ``/v1/events``
    (aiohttp, in 4 processes) and a real rdzv-server; ``rounds`` one-node jobs
    are formed one after another by a simulated agent (bench/simagents.py);
    latency = when a client read the ``round_completed`` event minus the
    event's own ``time`` (stamped by the server when it published it, after
    the round was written to disk; one clock). p50 / p99 / max over every
    (round, client).
12. Page load: a job of ``nodes`` simulated nodes (all joined, heartbeating);
    ``/ui/jobs/<id>`` opened ``loads`` times in headless Chromium (Debian's,
    through Playwright): time from navigation start until the page has drawn
    the job: the first 500 node rows by rank and the counts of all (``window.rdzvReadyMs``, the page's own
    ``performance.now()`` at its first complete render), and a live refresh
    (refetch the job and redraw the whole table, as on an event).

``python -m bench.ui_events [--smoke]`` prints the JSON and the rows.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import _common as C
from .simagents import Clients, node_specs

_CLIENTS = r"""
import asyncio, json, sys, time
import aiohttp

async def one(url, got, opened, refused, local):
    timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
    conn = aiohttp.TCPConnector(local_addr=(local, 0))  # the server holds 16 streams per client address
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as s, s.get(url + "/v1/events") as r:
        opened.append(1)
        if r.status != 200:
            refused.append(r.status)
            return
        data = None
        async for raw in r.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("data: "):
                data = line[6:]
            elif not line and data:
                now = time.time()
                ev = json.loads(data)
                data = None
                if ev["type"] == "round_completed":
                    got.setdefault(ev["job"], []).append(now - ev["time"])

async def main(url, n, proc):
    got, opened, refused = {}, [], []
    tasks = [asyncio.create_task(one(url, got, opened, refused, f"127.1.{proc}.{k // 8 + 1}")) for k in range(n)]
    while len(opened) < n:
        await asyncio.sleep(0.01)
    print(json.dumps({"ready": n, "refused": refused}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    print(json.dumps(got), flush=True)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""


# --smoke: more event streams than one client address may hold, so that the row's spread is checked
SMOKE = (20, 3, 50, 1)


def _delivery(url: str, clients: int, rounds: int, procs: int = 4) -> dict[str, Any]:
    """``clients`` SSE clients spread over ``procs`` processes (so that reading
    100 streams is not one Python loop's queue); one-node jobs formed in turn."""
    per = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
    readers = [
        subprocess.Popen(
            [sys.executable, "-c", _CLIENTS, url, str(n), str(i)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for i, n in enumerate(per)
        if n
    ]
    agents = Clients(1, url + "/v1/agent", None)
    got: dict[str, list[float]] = {}
    try:
        for r in readers:
            assert r.stdout is not None
            ready = json.loads(r.stdout.readline())
            if ready["refused"]:  # every client must hold a stream, or the row measures fewer
                raise RuntimeError(f"{len(ready['refused'])} event stream(s) refused: HTTP {ready['refused'][0]}")
        time.sleep(0.2)  # every stream's handler is subscribed
        for i in range(rounds):
            agents.split("storm", node_specs(f"lat{i}", 1))
            time.sleep(0.2)
        time.sleep(1.0)
        for r in readers:
            assert r.stdin is not None and r.stdout is not None
            r.stdin.write("dump\n")
            r.stdin.flush()
            for job, vs in json.loads(r.stdout.readline()).items():
                got.setdefault(job, []).extend(vs)
    finally:
        agents.stop()
        for r in readers:
            try:
                r.wait(10)
            except subprocess.TimeoutExpired:
                C.kill_tree(r.pid)
                r.wait(2)
            for pipe in (r.stdin, r.stdout):
                if pipe is not None:
                    pipe.close()
    lat = sorted(v for vs in got.values() for v in vs)
    return {
        "clients": clients,
        "client_procs": len(readers),
        "rounds": rounds,
        "deliveries": len(lat),
        "missing": clients * rounds - len(lat),
        "p50_s": C.percentile(lat, 50) if lat else None,
        "p99_s": C.percentile(lat, 99) if lat else None,
        "max_s": lat[-1] if lat else None,
    }


def _page_load(url: str, nodes: int, loads: int) -> dict[str, Any]:
    sys.path.insert(0, str(C.ROOT))
    from tests.helpers import browser as chromium

    if not chromium.available():
        return {"skipped": chromium.HOW_TO_GET}
    from playwright.sync_api import sync_playwright

    agents = Clients(max(1, min(4, nodes // 250)), url + "/v1/agent", None)
    try:
        answers = agents.split("storm", node_specs("big", nodes))
        assigned = sum(1 for a in answers for t in a["recv"] if t is not None)
        ready, refresh, rows = [], [], 0
        with sync_playwright() as pw:
            b = chromium.launch(pw)
            try:
                for _ in range(loads):
                    ctx = b.new_context(viewport={"width": 1400, "height": 900})
                    page = ctx.new_page()
                    page.goto(f"{url}/ui/jobs/big")
                    page.wait_for_selector("body[data-ready='1']", state="attached", timeout=30_000)
                    ready.append(page.evaluate("window.rdzvReadyMs") / 1000)
                    rows = page.locator("#nodes-body .row").count()
                    ms = page.evaluate(
                        "(async () => { const t = performance.now(); await render(); return performance.now() - t; })()"
                    )
                    refresh.append(ms / 1000)
                    ctx.close()
            finally:
                b.close()
    finally:
        agents.stop()
    return {
        "nodes": nodes,
        "assigned": assigned,
        "rows": rows,
        "loads": loads,
        "ready_s": ready,
        "ready_p50_s": C.median(ready),
        "ready_max_s": max(ready),
        "refresh_p50_s": C.median(refresh),
        "refresh_max_s": max(refresh),
    }


def run(clients: int = 100, rounds: int = 50, nodes: int = 1000, loads: int = 5) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="rdzv-bench-ui-"))
    server = C.BenchServer(tmp)
    try:
        delivery = _delivery(server.url, clients, rounds)
    finally:
        server.stop()
    (tmp / "page").mkdir()
    server = C.BenchServer(tmp / "page")
    try:
        page = _page_load(server.url, nodes, loads)
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return {"delivery": delivery, "page": page}


def rows(res: dict[str, Any]) -> list[list[str]]:
    d, p = res["delivery"], res["page"]
    ms = lambda s: f"{s * 1000:.1f} ms"  # noqa: E731
    out = [
        [
            f"11. Events: round completed -> `round_completed` read by {d['clients']} SSE clients "
            f"in {d['client_procs']} processes (p50 / p99 / max over {d['rounds']} rounds x {d['clients']} clients)",
            f"p50 {ms(d['p50_s'])} / p99 {ms(d['p99_s'])} / max {ms(d['max_s'])}"
            + (f", {d['missing']} not delivered" if d["missing"] else ""),
            "n/a",
            "-",
        ]
    ]
    if "skipped" in p:
        out.append(["12. /ui: page load, 1,000-node job", f"not measured: {p['skipped']}", "n/a", "-"])
    else:
        out.append(
            [
                f"12. /ui: `/ui/jobs/<id>` of a {p['nodes']:,}-node job in headless Chromium, navigation -> "
                f"the job drawn, its first {p['rows']:,} node rows and the counts of all "
                f"(median / max of {p['loads']} loads); "
                "a live refresh (refetch + redraw)",
                f"{ms(p['ready_p50_s'])} / {ms(p['ready_max_s'])} ({p['rows']:,} rows); "
                f"refresh {ms(p['refresh_p50_s'])} / {ms(p['refresh_max_s'])}",
                "n/a",
                "-",
            ]
        )
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m bench.ui_events")
    ap.add_argument("--smoke", action="store_true", help="20 clients, 3 rounds, a 50-node job, 1 load")
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--loads", type=int, default=5)
    a = ap.parse_args()
    res = run(*SMOKE) if a.smoke else run(a.clients, a.rounds, a.nodes, a.loads)
    print(json.dumps(res, indent=1))
    for r in rows(res):
        print("| " + " | ".join(r) + " |")
