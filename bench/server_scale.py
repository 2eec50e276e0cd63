"""rdzv-server under load: simulated nodes against the real server process.

    python -m bench.server_scale [--quick] [--formation 8,64,256,1024] [--reps 3]
                                 [--storm 4096] [--live 1000,5000,10000] [--live-s 20]
                                 [--clients 2] [--out results.json]

The server is ``python -m rdzv_server --host 127.0.0.1 --port P --data-dir TMP``
(SQLite, as deployed). Nodes are bench/simagents.py: WebSocket clients on ``/v1/agent``
speaking the agent protocol (join, heartbeats at the ``heartbeat_s`` the server
sends, WebSocket pings every 15 s as the real agent's link does), spread over
``--clients`` separate client processes so that the clients' own work is not
one Python loop. What is measured:

formation
    one job N:N per repetition. Every node connects first (not timed); then
    all clients send their joins as fast as they can. Latency of a node =
    (time it received its ``assigned`` frame) - (time the LAST join of all
    was sent). p50/p99 over the nodes; repeated ``--reps`` times.
storm
    one job N:N; every node connects and joins at once (no warm-up).
    Reported: first join sent -> all nodes hold an assignment (and from the
    first connection attempt).
live
    jobs of 1000 nodes (N:N, default heartbeat timeout 6 s; the interval is the
    server's: 0.25 s while it is small, 2 s from 10,000 nodes, and the nodes
    told a faster one are told the new one as it grows) are added until the
    total is reached; after a settle time the server
    process's CPU (utime+stime from /proc/PID/stat over ``--live-s`` seconds)
    and RSS (VmRSS) are read, and evictions are checked (frames and REST).

The clients share the machine with the server: on a small machine their CPU
use inflates the latencies (a real node has its own machine). Client CPU is
reported alongside.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from rdzv_client.client import WS_PING_S

from . import _common as C
from .simagents import ASSIGN_TIMEOUT_S, Clients, node_specs

JOB_NODES = 1000  # nodes per job in the live test


class Server(C.BenchServer):
    @property
    def pid(self) -> int:
        return self.proc.pid

    def job(self, job_id: str) -> dict | None:
        body = C.http_get(f"{self.url}/v1/jobs/{job_id}", 30)
        return json.loads(body) if body else None

    def metrics(self) -> dict[str, float]:
        """Prometheus counters summed over their labels."""
        out: dict[str, float] = {}
        for line in (C.http_get(self.url + "/metrics", 30) or b"").decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                name = name.split("{")[0]
                try:
                    out[name] = out.get(name, 0.0) + float(value)
                except ValueError:
                    pass
        return out

    def stalls(self) -> int:
        """How often the server logged that its loop did not run for 1.5 s."""
        return self.proc.text().count("did not run for a while")

    def close_job(self, job_id: str) -> None:
        C.http_post(f"{self.url}/v1/jobs/{job_id}/close", 30)


def _merge(answers: list[dict], key: str) -> list:
    return [v for a in answers for v in a[key]]


def formation(server: Server, clients: Clients, n: int, reps: int, tag: str) -> dict:
    runs = []
    for rep in range(reps):
        job_id = f"{tag}-f{n}-r{rep}"
        clients.split("connect", node_specs(job_id, n))
        ans = clients.same({"cmd": "join"})
        sent, recv = _merge(ans, "sent"), _merge(ans, "recv")
        last = max(sent)
        lat = [r - last for r in recv if r is not None]
        missing = sum(r is None for r in recv)
        view = server.job(job_id) or {}
        hist = (view.get("history") or [{}])[0]
        form = (hist["completed_at"] - hist["started_at"]) if hist.get("completed_at") else None
        runs.append(
            {
                "p50": C.percentile(lat, 50),
                "p99": C.percentile(lat, 99),
                "max": max(lat) if lat else None,
                "missing": missing,
                "join_send_spread": last - min(sent),
                "server_first_to_complete": form,
            }
        )
        server.close_job(job_id)
        clients.same({"cmd": "close"})
        time.sleep(0.3)
    return {
        "n": n,
        "reps": runs,
        "p50": C.median(r["p50"] for r in runs),
        "p99": C.median(r["p99"] for r in runs),
        "p99_min": min(r["p99"] for r in runs),
        "p99_max": max(r["p99"] for r in runs),
        "missing": sum(r["missing"] for r in runs),
    }


def storm(server: Server, clients: Clients, n: int, tag: str) -> dict:
    job_id = f"{tag}-storm{n}"
    ans = clients.split("storm", node_specs(job_id, n))
    sent, recv, conn = _merge(ans, "sent"), _merge(ans, "recv"), _merge(ans, "connect")
    got = [r for r in recv if r is not None]
    first_sent = min(s for s in sent if s is not None)
    res = {
        "n": n,
        "assigned": len(got),
        "missing": n - len(got),
        "from_first_join_s": (max(got) - first_sent) if len(got) == n else None,
        "from_first_connect_s": (max(got) - min(conn)) if len(got) == n else None,
        "connect_retries": sum(a.get("retries", 0) for a in ans),
    }
    server.close_job(job_id)
    clients.same({"cmd": "close"})
    return res


def live(server: Server, clients: Clients, totals: list[int], measure_s: float, tag: str) -> list[dict]:
    results = []
    have = 0
    jobs: list[str] = []
    for total in totals:
        t0 = time.time()
        new_jobs = []
        while have < total:
            size = min(JOB_NODES, total - have)
            job_id = f"{tag}-live-j{len(jobs)}"
            clients.split("connect", node_specs(job_id, size, base=have))
            jobs.append(job_id)
            new_jobs.append(job_id)
            have += size
            ans = clients.same({"cmd": "join", "jobs": [job_id]})
            missing = sum(r is None for r in _merge(ans, "recv"))
            if missing:
                print(f"[server_scale] live: {missing} node(s) of {job_id} got no assignment", file=sys.stderr)
        ramp_s = time.time() - t0
        time.sleep(3.0)  # settle: connection setup and joins are not the steady state
        before = clients.same({"cmd": "stats"})
        c0 = [s["cpu_ticks"] for s in before]
        hb0 = sum(s.get("hb_sent", 0) for s in before)
        t_start, s0 = time.time(), C.cpu_ticks(server.pid)
        probe = []  # /healthz round trips: how long the server's loop makes a request wait
        while time.time() < t_start + measure_s:
            t = time.perf_counter()
            C.http_get(server.url + "/healthz", 10)
            probe.append(time.perf_counter() - t)
            time.sleep(0.2)
        s1, t_end = C.cpu_ticks(server.pid), time.time()
        stats = clients.same({"cmd": "stats"})
        wall = t_end - t_start
        rss = C.status_kb(server.pid, "VmRSS")
        hwm = C.status_kb(server.pid, "VmHWM")
        time.sleep(1.0)  # a drop is a loss only after the disconnect grace (0.5 s)
        metrics = server.metrics()
        bad_jobs = []
        for j in jobs:
            v = server.job(j) or {}
            if v.get("state") != "running" or v.get("round") != 0:
                bad_jobs.append(j)
        res = {
            "nodes": total,
            "jobs": len(jobs),
            "ramp_s": ramp_s,
            "measure_s": wall,
            "server_cpu": (s1 - s0) / C.CLK_TCK / wall,
            "server_rss_mb": rss / 1024,
            "server_hwm_mb": hwm / 1024,
            "evicted": sum(s["evicted"] for s in stats),
            "closed": sum(s["closed"] for s in stats),
            "errors": sum(s["errors"] for s in stats),
            "why_closed": [s["why"] for s in stats],
            "assigned": sum(s["assigned"] for s in stats),
            "jobs_not_running_round0": bad_jobs,
            "server_evictions": metrics.get("rdzv_evictions_total", 0.0),
            "server_rounds_opened": metrics.get("rdzv_rounds_opened_total", 0.0),
            "server_stall_warnings": server.stalls(),
            "healthz_p50_s": C.percentile(probe, 50),
            "healthz_max_s": max(probe),
            "client_cpu": sum(b["cpu_ticks"] - a for a, b in zip(c0, stats, strict=True)) / C.CLK_TCK / wall,
            # heartbeats sent a second, all nodes (their intervals are the server's: rdzv_server.rounds.pace)
            "hb_rate": (sum(s.get("hb_sent", 0) for s in stats) - hb0) / wall,
            "load": C.loadavg(),
        }
        results.append(res)
        print(
            f"[server_scale] live {total}: server {res['server_cpu'] * 100:.1f}% of a core, "
            f"RSS {res['server_rss_mb']:.0f} MB, evicted {res['evicted']}, load {res['load']}",
            file=sys.stderr,
        )
    for j in jobs:
        server.close_job(j)
    clients.same({"cmd": "close"})
    return results


def run(
    formation_ns: list[int],
    reps: int,
    storm_n: int | None,
    live_totals: list[int],
    live_s: float,
    n_clients: int = 2,
    ws_ping: float | None = WS_PING_S,
    log=print,
) -> dict:
    """All the server scale measurements; each part has its own fresh server."""
    C.raise_nofile()
    tmp = Path(tempfile.mkdtemp(prefix="rdzv-bench-scale-"))
    out: dict = {"load_before": C.loadavg(), "clients": n_clients, "formation": [], "storm": None, "live": []}
    tag = f"b{os.getpid()}"
    parts = [("formation", bool(formation_ns)), ("storm", bool(storm_n)), ("live", bool(live_totals))]
    try:
        for part, wanted in parts:
            if not wanted:
                continue
            sub = tmp / part
            sub.mkdir()
            server = Server(sub)
            clients = None
            try:
                clients = Clients(n_clients, server.url + "/v1/agent", ws_ping)
                if part == "formation":
                    for n in formation_ns:
                        r = formation(server, clients, n, reps, tag)
                        out["formation"].append(r)
                        log(
                            f"[server_scale] formation N={n}: p50 {r['p50'] * 1000:.1f} ms, "
                            f"p99 {r['p99'] * 1000:.1f} ms (load {C.loadavg()})"
                        )
                elif part == "storm":
                    out["storm"] = storm(server, clients, storm_n, tag)
                    log(f"[server_scale] storm {storm_n}: {out['storm']} (load {C.loadavg()})")
                else:
                    out["live"] = live(server, clients, live_totals, live_s, tag)
            finally:
                if clients is not None:
                    clients.stop()
                server.stop()
    finally:
        if os.environ.get("BENCH_KEEP_TMP"):
            log(f"[server_scale] kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    out["load_after"] = C.loadavg()
    return out


def table(res: dict) -> str:
    rows = []
    for f in res["formation"]:
        target = "p99 < 50 ms" if f["n"] == 256 else ""
        ok = ("yes" if f["p99"] < 0.050 else "NO") if f["n"] == 256 else ""
        miss = f", {f['missing']} missing" if f["missing"] else ""
        rows.append(
            [
                f"formation N={f['n']} (last join sent -> assigned, {len(f['reps'])} reps)",
                f"p50 {f['p50'] * 1000:.1f} ms, p99 {f['p99'] * 1000:.1f} ms "
                f"(p99 {f['p99_min'] * 1000:.1f}-{f['p99_max'] * 1000:.1f}){miss}",
                target,
                ok,
            ]
        )
    s = res.get("storm")
    if s:
        if s["from_first_join_s"] is None:
            val, ok = f"{s['missing']} of {s['n']} got no assignment in {ASSIGN_TIMEOUT_S:g} s", "NO"
        else:
            val = (
                f"{s['from_first_join_s']:.2f} s (from first connect attempt {s['from_first_connect_s']:.2f} s, "
                f"{s['connect_retries']} connect retries)"
            )
            ok = "yes" if s["from_first_join_s"] < 3.0 else "NO"
        rows.append([f"join storm {s['n']} nodes: first join -> all assigned", val, "< 3 s", ok])
    for lv in res["live"]:
        big = lv["nodes"] >= 10000
        ok = ""
        if big:
            ok = (
                "yes"
                if (
                    lv["server_cpu"] < 1.0
                    and lv["server_rss_mb"] < 500
                    and lv["evicted"] == 0
                    and not lv["server_evictions"]
                    and not lv["server_rounds_opened"]
                )
                else "NO"
            )
        rows.append(
            [
                f"{lv['nodes']} live nodes ({lv['jobs']} job(s)), {lv.get('hb_rate', 0):,.0f} heartbeats/s, "
                f"{lv['measure_s']:.0f} s",
                f"server CPU {lv['server_cpu'] * 100:.1f}% of a core, RSS {lv['server_rss_mb']:.0f} MB, "
                f"evicted {lv['evicted'] + int(lv['server_evictions'])}, dropped {lv['closed']}, rounds "
                f"restarted {int(lv['server_rounds_opened'])}, "
                f"server stalls >1.5 s {lv['server_stall_warnings']}, /healthz p50 "
                f"{lv['healthz_p50_s'] * 1000:.0f} ms max {lv['healthz_max_s'] * 1000:.0f} ms "
                f"(clients {lv['client_cpu'] * 100:.0f}% CPU, load {lv['load']})",
                "< 1 core, < 500 MB, 0 evicted" if big else "",
                ok,
            ]
        )
    return C.md_table(["server scale (rdzv only)", "result", "target", "met"], rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.server_scale", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--no-ws-ping", action="store_true", help=f"clients send no WebSocket pings (the agent does, {WS_PING_S:g} s)"
    )
    p.add_argument("--quick", action="store_true", help="a small subset in well under a minute")
    p.add_argument("--formation", default=None, help="comma-separated N (default 8,64,256,1024)")
    p.add_argument("--reps", type=int, default=None, help="formation repetitions (default 3)")
    p.add_argument("--storm", type=int, default=None, help="join storm size (default 4096; 0 skips)")
    p.add_argument("--live", default=None, help="comma-separated live node totals (default 1000,5000,10000)")
    p.add_argument("--live-s", type=float, default=None, help="seconds of steady state measured (default 20)")
    p.add_argument("--clients", type=int, default=2, help="client processes")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args(argv)
    q = a.quick

    def ints(text, default):
        return [int(x) for x in text.split(",") if x.strip() and int(x)] if text is not None else default

    res = run(
        formation_ns=ints(a.formation, [8, 64, 256] if q else [8, 64, 256, 1024]),
        reps=a.reps or (2 if q else 3),
        storm_n=a.storm if a.storm is not None else (1024 if q else 4096),
        live_totals=ints(a.live, [1000] if q else [1000, 5000, 10000]),
        live_s=a.live_s or (5.0 if q else 20.0),
        n_clients=a.clients,
        ws_ping=None if a.no_ws_ping else WS_PING_S,
        log=lambda s: print(s, file=sys.stderr),
    )
    print(table(res))
    print(
        f"\nload average before/after: {res['load_before']} / {res['load_after']}; "
        f"{a.clients} client process(es); {os.cpu_count()} CPU(s)"
    )
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
