"""python -m bench [--quick] [--runs K] [--out FILE.json] [--only KEY,...] [--no-server-scale]

rdzv against torchrun (torch's c10d rendezvous) on this machine, printed as
one markdown table; see bench/compare.py for what each row measures and
bench/server_scale.py and bench/finished_jobs.py for the rdzv-only server
rows (8, 9), bench/ui_events.py for the event stream and /ui rows (11, 12),
bench/slow_rank.py for the lock-step straggler row (15: about 25 s per
factor, 44 s for 5x and 1.5x; --quick 5x only, not in --smoke). The whole benchmark runs
in a private network namespace with only loopback when it can (root and
``unshare -n``): torch's TCPStore listens on every interface.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from . import _common as C
from . import compare, compare_table, finished_jobs, progress_cost, server_scale, slow_rank, ui_events


def server_rows(res: dict) -> list[list[str]]:
    rows = []
    for f in res.get("formation", []):
        rows.append(
            [
                f"8. Server: formation N={f['n']} simulated nodes, last join sent -> `assigned` "
                f"(p50 / p99 over nodes, median of {len(f['reps'])})",
                f"p50 {f['p50'] * 1000:.1f} ms / p99 {f['p99'] * 1000:.1f} ms "
                f"(p99 {f['p99_min'] * 1000:.1f}-{f['p99_max'] * 1000:.1f})",
                "n/a",
                "-",
            ]
        )
    s = res.get("storm")
    if s:
        v = (
            f"{s['from_first_join_s']:.2f} s"
            if s["from_first_join_s"] is not None
            else f"{s['missing']} of {s['n']} not assigned"
        )
        rows.append([f"8. Server: join storm {s['n']} nodes, first join -> all assigned", v, "n/a", "-"])
    for lv in res.get("live", []):
        ev = lv["evicted"] + int(lv["server_evictions"])
        rows.append(
            [
                f"8. Server: {lv['nodes']:,} live nodes heartbeating every 2 s, {lv['measure_s']:.0f} s",
                f"{lv['server_cpu'] * 100:.1f}% of a core, RSS {lv['server_rss_mb']:.0f} MB, {ev} evicted, "
                f"{int(lv['server_rounds_opened'])} restarts",
                "n/a",
                "-",
            ]
        )
    return rows


def finished_rows(res: dict) -> list[list[str]]:
    fp = res["first_page"]
    failed = f", {res['failed']} not made" if res["failed"] else ""
    return [
        [
            f"9. Server: {res['jobs']:,} finished jobs present, idle CPU over {res['idle_s']:.0f} s",
            f"{res['idle_cpu'] * 100:.2f}% of a core, RSS {res['rss_mb']:.0f} MB{failed}",
            "n/a",
            "-",
        ],
        [
            f"9. Server: {res['jobs']:,} finished jobs present, GET /v1/jobs one page ({fp['size']} jobs), "
            f"p50 / p99 over {fp['n']} requests",
            f"p50 {fp['p50'] * 1000:.1f} ms / p99 {fp['p99'] * 1000:.1f} ms",
            "n/a",
            "-",
        ],
    ] + (
        [
            [
                f"9. Server: ... and {w['waiting_now']:,} jobs waiting for nodes that left, "
                f"idle CPU over {w['idle_s']:.0f} s",
                f"{w['idle_cpu'] * 100:.2f}% of a core",
                "n/a",
                "-",
            ]
        ]
        if (w := res.get("waiting"))
        else []
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 run, small N, tight bounds (2-3 minutes)")
    p.add_argument(
        "--runs",
        type=int,
        default=None,
        help="runs per row and launcher (default 3, and 2 for the rows where torchrun waits out "
        "long timeouts: 3, 4a, 4b, 5; --quick 1)",
    )
    p.add_argument("--out", default=None, help="write all results as JSON here")
    p.add_argument(
        "--only",
        default=None,
        help="comma-separated row keys (join_sent, rdzv_n2, wall_n2, elastic_2_4, "
        "node_loss, host_loss, scale_up, worker_crash, footprint)",
    )
    p.add_argument("--no-server-scale", action="store_true", help="skip rows 8, 9, 11 and 12")
    p.add_argument("--smoke", action="store_true", help="rdzv only, one tiny row and a tiny server scale run")
    a = p.parse_args(argv)
    C.reexec_in_netns("bench", argv)
    C.raise_nofile()
    runs = a.runs or (1 if (a.quick or a.smoke) else 3)
    slow_runs = a.runs or (1 if (a.quick or a.smoke) else 2)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    started, load0 = time.time(), C.loadavg()
    log(
        f"[bench] {'private network namespace' if C.in_private_netns() else 'plain loopback'}; "
        f"{os.cpu_count()} CPU(s); load {load0}"
    )

    rows = compare.plan(quick=a.quick, smoke=a.smoke)
    if a.only:
        keep = set(a.only.split(","))
        rows = [r for r in rows if r.key in keep]
    import shutil
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="rdzv-bench-"))
    try:
        results = compare.measure(
            rows, runs, tmp, log=log, launchers=("rdzv",) if a.smoke else compare.LAUNCHERS, slow_runs=slow_runs
        )
    finally:
        if os.environ.get("BENCH_KEEP_TMP"):
            log(f"[bench] kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    scale = None
    if not a.no_server_scale:
        if a.smoke:
            scale = server_scale.run([8], 1, None, [20], 1.0, n_clients=1, log=log)
        elif a.quick:
            scale = server_scale.run([256], 2, None, [], 0, log=log)
        else:
            scale = server_scale.run([256, 1024], 3, None, [10000], 20.0, log=log)

    finished = None
    if not a.no_server_scale:
        if a.smoke:
            finished = finished_jobs.run(30, 1.0, 20, waiting=5, log=log)
        elif a.quick:
            finished = finished_jobs.run(2000, 5.0, 200, waiting=200, log=log)
        else:
            finished = finished_jobs.run(10_000, 20.0, 500, waiting=1000, log=log)

    progress = progress_cost.run(*((20_000, 1) if a.smoke else (200_000, 3) if a.quick else (1_000_000, 5)))
    ui = None if a.no_server_scale else ui_events.run(*(ui_events.SMOKE if a.smoke else (100, 50, 1000, 5)))
    slow = None if a.smoke else slow_rank.run([5.0] if a.quick else [5.0, 1.5], log=log)

    text = compare_table.table(rows, results)
    if scale:
        text += "\n" + "\n".join("| " + " | ".join(r) + " |" for r in server_rows(scale))
    if finished:
        text += "\n" + "\n".join("| " + " | ".join(r) + " |" for r in finished_rows(finished))
    text += "\n" + "\n".join("| " + " | ".join(r) + " |" for r in progress_cost.rows(progress))
    if ui:
        text += "\n" + "\n".join("| " + " | ".join(r) + " |" for r in ui_events.rows(ui))
    if slow:
        text += "\n" + "\n".join("| " + " | ".join(r) + " |" for r in slow_rank.rows(slow))
    print(text)
    notes = compare_table.info_lines(results)
    print()
    for line in notes:
        print(line)
    print(
        f"- {runs} run(s) per row and launcher ({slow_runs} for rows 3-5), interleaved; {os.cpu_count()} CPU(s); "
        f"load average {load0} at start, {C.loadavg()} at end; {time.time() - started:.0f} s in all; "
        f"{'private network namespace' if C.in_private_netns() else 'plain loopback'}"
    )
    if a.out:
        Path(a.out).write_text(
            json.dumps(
                {
                    "rows": compare_table.to_json(rows, results),
                    "server_scale": scale,
                    "finished_jobs": finished,
                    "progress_cost": progress,
                    "ui_events": ui,
                    "slow_rank": slow,
                    "runs": runs,
                    "slow_runs": slow_runs,
                    "load_start": load0,
                    "load_end": C.loadavg(),
                    "table": text,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
