"""rdzv-server with many finished jobs: idle CPU and ``GET /v1/jobs`` latency.

    python -m bench.finished_jobs [--jobs 10000] [--idle-s 20] [--requests 500]
                                  [--waiting 1000] [--concurrency 32] [--out results.json]

The server is ``python -m rdzv_server --host 127.0.0.1 --port P --data-dir TMP``
(SQLite, as deployed; default flags, so finished jobs are retained 7 days).
Jobs are made as agents make them, over ``/v1/agent``: per job one simulated
node joins a 1:1 job, gets its assignment, reports success, hears ``done`` and
disconnects, ``--concurrency`` jobs at a time. Then, with every job finished
and nothing connected:

idle CPU
    the server process's utime+stime (/proc/PID/stat) over ``--idle-s``
    seconds, as a share of one core; RSS (VmRSS) at the end.
GET /v1/jobs
    ``--requests`` requests one after another, each on a new connection as
    ``curl`` would make it: the first page (the default 100 jobs); then the
    same number for a page deep in the list (``?state=succeeded&cursor=``
    from the middle). p50 / p99 / max of the round trip.
idle CPU with jobs waiting
    then ``--waiting`` more jobs (2:2) each get one node that joins and
    disconnects: they wait for nodes that never come (until their 600 s join
    timeout), the kind of job that used to cost the tick every 100 ms; the
    idle CPU is measured again (default 1000: the --max-waiting-jobs cap).

No torchrun side: torchrun has no server that keeps jobs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from . import _common as C

TARGET_CPU = 0.02  # of one core
TARGET_P99_S = 0.050


Server = C.BenchServer


async def _make_jobs(url: str, n: int, concurrency: int, tag: str, waiting: bool = False) -> dict:
    """n finished jobs through the agent protocol (or, ``waiting``, n jobs whose
    only node joined and left); returns counts and timing."""
    import aiohttp

    from rdzv_common.protocol import JobSpec, JoinMsg, SucceededMsg

    spec = JobSpec(min_nodes=2, max_nodes=2) if waiting else JobSpec(min_nodes=1, max_nodes=1)
    done_text = SucceededMsg(round=0).model_dump_json()
    failed: list[str] = []
    todo = iter(range(n))

    async def one(session, i: int) -> None:
        job_id = f"{tag}-{i:06d}"
        join = JoinMsg(
            job_id=job_id,
            node_id="node1",
            host="sim1",
            addr="127.0.0.1",
            local_world_size=1,
            master_port=29500,
            spec=spec,
        ).model_dump_json()
        async with session.ws_connect(url + "/v1/agent") as ws:
            await ws.send_str(join)
            seen = set()
            async for frame in ws:
                if frame.type != aiohttp.WSMsgType.TEXT:
                    break
                op = json.loads(frame.data)["op"]
                seen.add(op)
                if op == "assigned":
                    await ws.send_str(done_text)
                elif op in ("done", "error") or (waiting and op == "joined"):
                    break
            if ("joined" if waiting else "done") not in seen:
                failed.append(f"{job_id}: {sorted(seen)}")

    async def worker(session) -> None:
        for i in todo:
            try:
                await asyncio.wait_for(one(session, i), 30)
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
                failed.append(f"{i}: {e!r}"[:120])

    t0 = time.time()
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return {"made_s": time.time() - t0, "failed": len(failed), "failures": failed[:5]}


def _latencies(url: str, count: int) -> tuple[list[float], int, int]:
    """(round trips, errors, jobs on the last page) of ``count`` GETs of ``url``."""
    lat, errors, size = [], 0, 0
    for _ in range(count):
        t = time.perf_counter()
        body = C.http_get(url, 10)
        lat.append(time.perf_counter() - t)
        if body is None:
            errors += 1
        else:
            size = len(json.loads(body)["jobs"])
    return lat, errors, size


def _idle(pid: int, seconds: float) -> tuple[float, float]:
    """(share of a core, wall seconds) the process used over ``seconds``."""
    t_start, c0 = time.time(), C.cpu_ticks(pid)
    time.sleep(seconds)
    c1, wall = C.cpu_ticks(pid), time.time() - t_start
    return (c1 - c0) / C.CLK_TCK / wall, wall


def run(jobs: int, idle_s: float, requests: int, concurrency: int = 32, waiting: int = 0, log=print) -> dict:
    C.raise_nofile()
    tmp = Path(tempfile.mkdtemp(prefix="rdzv-bench-finished-"))
    server = None
    try:
        server = Server(tmp)
        made = asyncio.run(_make_jobs(server.url, jobs, concurrency, f"f{os.getpid()}"))
        health = json.loads(C.http_get(server.url + "/healthz", 10) or b"{}")
        log(
            f"[finished_jobs] {jobs} jobs made in {made['made_s']:.1f} s ({made['failed']} failed); "
            f"server holds {health.get('jobs')} (load {C.loadavg()})"
        )
        time.sleep(2.0)  # settle: the last connections close
        idle_cpu, wall = _idle(server.proc.pid, idle_s)
        rss_mb = (C.status_kb(server.proc.pid, "VmRSS") or 0) / 1024
        first, first_err, first_size = _latencies(server.url + "/v1/jobs", requests)
        # a page in the middle of the list, with a state filter
        cursor = None
        page = json.loads(C.http_get(server.url + f"/v1/jobs?limit={max(1, jobs // 2)}", 30) or b"{}")
        cursor = page.get("next_cursor")
        deep_url = server.url + "/v1/jobs?state=succeeded" + (f"&cursor={cursor}" if cursor else "")
        deep, deep_err, deep_size = _latencies(deep_url, requests)
        res = {
            "jobs": jobs,
            "held": health.get("jobs"),
            **made,
            "idle_s": wall,
            "idle_cpu": idle_cpu,
            "rss_mb": rss_mb,
            "first_page": {
                "n": len(first),
                "errors": first_err,
                "size": first_size,
                "p50": C.percentile(first, 50),
                "p99": C.percentile(first, 99),
                "max": max(first),
            },
            "deep_page": {
                "n": len(deep),
                "errors": deep_err,
                "size": deep_size,
                "p50": C.percentile(deep, 50),
                "p99": C.percentile(deep, 99),
                "max": max(deep),
            },
            "stall_warnings": server.proc.text().count("did not run for a while"),
            "load": C.loadavg(),
        }
        log(
            f"[finished_jobs] idle {idle_cpu * 100:.2f}% of a core, RSS {rss_mb:.0f} MB; /v1/jobs p99 "
            f"{res['first_page']['p99'] * 1000:.1f} ms (load {res['load']})"
        )
        if waiting:
            made_w = asyncio.run(_make_jobs(server.url, waiting, concurrency, f"w{os.getpid()}", waiting=True))
            time.sleep(2.0)  # their nodes are lost after the 0.5 s disconnect grace
            waiting_now = len(
                json.loads(C.http_get(server.url + "/v1/jobs?state=waiting&limit=1000", 30) or b'{"jobs": []}')["jobs"]
            )
            cpu_w, wall_w = _idle(server.proc.pid, idle_s)
            res["waiting"] = {
                "jobs": waiting,
                "failed": made_w["failed"],
                "waiting_now": waiting_now,
                "idle_cpu": cpu_w,
                "idle_s": wall_w,
            }
            log(f"[finished_jobs] with {waiting_now} jobs waiting for nodes: idle {cpu_w * 100:.2f}% of a core")
        return res
    finally:
        if server is not None:
            server.stop()
        if os.environ.get("BENCH_KEEP_TMP"):
            log(f"[finished_jobs] kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def rows(res: dict) -> list[list[str]]:
    """Table rows: what, result, target, met."""
    fp, dp = res["first_page"], res["deep_page"]
    made = f"{res['held']:,} held, made in {res['made_s']:.0f} s"
    made += f", {res['failed']} failed" if res["failed"] else ""
    return [
        [
            f"{res['jobs']:,} finished jobs present ({made}): idle server CPU over {res['idle_s']:.0f} s",
            f"{res['idle_cpu'] * 100:.2f}% of a core, RSS {res['rss_mb']:.0f} MB",
            f"< {TARGET_CPU * 100:g}% of a core",
            "yes" if res["idle_cpu"] < TARGET_CPU and not res["failed"] else "NO",
        ],
        [
            f"GET /v1/jobs, first page ({fp['size']} jobs), {fp['n']} requests one after another",
            f"p50 {fp['p50'] * 1000:.1f} ms, p99 {fp['p99'] * 1000:.1f} ms, max {fp['max'] * 1000:.1f} ms"
            + (f", {fp['errors']} errors" if fp["errors"] else ""),
            f"p99 < {TARGET_P99_S * 1000:g} ms",
            "yes" if fp["p99"] < TARGET_P99_S and not fp["errors"] else "NO",
        ],
        [
            f"GET /v1/jobs?state=succeeded&cursor= (a page from the middle, {dp['size']} jobs), {dp['n']} requests",
            f"p50 {dp['p50'] * 1000:.1f} ms, p99 {dp['p99'] * 1000:.1f} ms, max {dp['max'] * 1000:.1f} ms"
            + (f", {dp['errors']} errors" if dp["errors"] else ""),
            "",
            "",
        ],
    ] + (
        [
            [
                f"... and {w['waiting_now']:,} jobs waiting for nodes that left: "
                f"idle server CPU over {w['idle_s']:.0f} s",
                f"{w['idle_cpu'] * 100:.2f}% of a core" + (f", {w['failed']} not made" if w["failed"] else ""),
                f"< {TARGET_CPU * 100:g}% of a core",
                "yes" if w["idle_cpu"] < TARGET_CPU else "NO",
            ]
        ]
        if (w := res.get("waiting"))
        else []
    )


def table(res: dict) -> str:
    return C.md_table(["finished jobs (rdzv only)", "result", "target", "met"], rows(res))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.finished_jobs", description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=10_000, help="finished jobs to make (default 10000)")
    p.add_argument("--idle-s", type=float, default=20.0, help="seconds of idle CPU measured (default 20)")
    p.add_argument("--requests", type=int, default=500, help="GET /v1/jobs requests per kind (default 500)")
    p.add_argument(
        "--waiting",
        type=int,
        default=1000,
        help="then this many jobs waiting for nodes, idle CPU again (default 1000; 0 skips)",
    )
    p.add_argument("--concurrency", type=int, default=32, help="jobs made at a time (default 32)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args(argv)
    if a.jobs < 1 or a.requests < 1 or a.idle_s <= 0 or a.concurrency < 1 or a.waiting < 0:
        p.error("--jobs, --requests, --concurrency must be >= 1, --waiting >= 0 and --idle-s > 0")
    res = run(
        a.jobs, a.idle_s, a.requests, a.concurrency, a.waiting, log=lambda s: print(s, file=sys.stderr, flush=True)
    )
    print(table(res))
    print(
        f"\nload average at the end: {res['load']}; {os.cpu_count()} CPU(s); "
        f"server stall warnings: {res['stall_warnings']}"
    )
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
