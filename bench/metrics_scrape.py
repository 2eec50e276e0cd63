"""python -m bench.metrics_scrape [--jobs 100,1000,10000] [--nodes 4] [--runs 20] [--out FILE.json]

What one /metrics scrape costs the server with many jobs: ``Metrics.refresh``
(on the event loop: per-job gauges of jobs that have not finished, jobs by
state, host gauges) and ``Metrics.render`` (in a worker thread), for N running
jobs of ``--nodes`` nodes each (real round-machine jobs, no network), with the
size of the text and its number of series. Prints one markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from rdzv_common.protocol import JobSpec, JoinMsg
from rdzv_server import rounds
from rdzv_server.hosts import Hosts
from rdzv_server.metrics import Metrics


def _jobs(n: int, nodes: int, metrics: Metrics) -> list[rounds.Job]:
    spec = JobSpec(min_nodes=nodes, max_nodes=nodes)
    jobs = []
    for j in range(n):
        job = rounds.new_job(f"job-{j}", spec, 0.0)
        for k in range(nodes):
            msg = JoinMsg(
                job_id=job.job_id,
                node_id=f"n{k}",
                host=f"h{k}",
                addr=f"10.0.0.{k}",
                local_world_size=1,
                master_port=29500,
                spec=spec,
            )
            metrics.observe(job, rounds.join(job, msg, 0.0))
        jobs.append(job)
    return jobs


def measure(n: int, nodes: int, runs: int) -> dict:
    metrics = Metrics()
    jobs = _jobs(n, nodes, metrics)
    hosts = Hosts()
    refresh, render = [], []
    text = b""
    for _ in range(runs):
        t0 = time.perf_counter()
        metrics.refresh(jobs, hosts, 1.0)
        t1 = time.perf_counter()
        text = metrics.render()
        t2 = time.perf_counter()
        refresh.append(t1 - t0)
        render.append(t2 - t1)
    series = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
    return {
        "jobs": n,
        "nodes_per_job": nodes,
        "runs": runs,
        "refresh_median_s": statistics.median(refresh),
        "refresh_max_s": max(refresh),
        "render_median_s": statistics.median(render),
        "render_max_s": max(render),
        "bytes": len(text),
        "series": series,
    }


def table(results: list[dict]) -> str:
    lines = [
        "| running jobs | refresh on the loop, median (max) | render in a thread, median (max) | body | series |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['jobs']:,} x {r['nodes_per_job']} nodes "
            f"| {r['refresh_median_s'] * 1000:.2f} ms ({r['refresh_max_s'] * 1000:.2f}) "
            f"| {r['render_median_s'] * 1000:.1f} ms ({r['render_max_s'] * 1000:.1f}) "
            f"| {r['bytes'] / 1024:.0f} KiB | {r['series']:,} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.metrics_scrape", description=__doc__.split("\n\n")[1])
    p.add_argument("--jobs", default="100,1000,10000", help="comma-separated numbers of running jobs")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    results = [measure(int(n), args.nodes, args.runs) for n in args.jobs.split(",")]
    print(table(results))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
