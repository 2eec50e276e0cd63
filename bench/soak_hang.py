"""The hang-detection soak: no false hang under full CPU load.

    python -m bench.soak_hang [--minutes M] [--hang-timeout S] [--hogs N] [--out FILE.json]

A real rdzv-server and two real rdzv-agents (``--nnodes 2``, one gloo worker
each, ``--hang-timeout S``, default 5) run ``bench/scripts/soak_worker.py``:
an all_reduce and ``rdzv_client.worker.progress(step)`` every step (about 50
steps/s) for M minutes (default 10), while N CPU hogs (default: one busy
Python loop per core, normal priority) load the machine. No hang is injected,
so every hang the agents report is a false one.

Prints one table: false hangs (expected 0), restarts, steps done, the longest
gap between two progress() calls of one worker (measured by the worker) and
how many gaps were over 1 s, with the load average. rdzv only: torchrun has no
hang detection.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from . import _common as C
from .compare import Cluster

WORKER = C.SCRIPTS / "soak_worker.py"
SETUP_S = 90.0  # agents start and the round forms before the soak's clock starts


def _hog(tmp: Path, i: int) -> C.Proc:
    return C.Proc(f"hog{i}", [sys.executable, "-c", "while True: pass"], tmp / f"hog{i}.log")


def run(minutes: float, hang_timeout: float, hogs: int, tmp: Path, log=print) -> dict:
    cl = Cluster("rdzv", tmp, "soak")
    stats = cl.dir / "stats"
    stats.mkdir()
    hog_procs: list[C.Proc] = []
    load0 = C.loadavg()
    try:
        hog_procs = [_hog(cl.dir, i) for i in range(hogs)]
        end_file = cl.dir / "end"
        cmd = [str(WORKER), str(stats), str(end_file)]
        for _ in range(2):
            cl.launch("2", cmd, rdzv_flags=("--hang-timeout", f"{hang_timeout:g}"))
        if not C.wait_until(lambda: len(list(stats.glob("*.json"))) >= 2, SETUP_S, 0.2):
            raise RuntimeError("the job did not start:\n" + cl.agents[0].text()[-2000:])
        started = time.time()
        end = started + minutes * 60
        tmp_end = cl.dir / "end.tmp"
        tmp_end.write_text(f"{end:.3f}")
        tmp_end.replace(end_file)
        log(f"[soak] {hogs} CPU hog(s), hang timeout {hang_timeout:g} s, until {time.ctime(end)}")
        while time.time() < end + 60 and not all(a.poll() is not None for a in cl.agents):
            time.sleep(1.0)
        load_end = C.loadavg()
        view = cl.history()
        body = C.http_get(f"http://{cl.endpoint}/v1/jobs/{cl.job}", 5)
        job = json.loads(body) if body else {}
        codes = [a.poll() for a in cl.agents]
        hung_lines = sum(a.text().count(" hung: ") for a in cl.agents)
    finally:
        for h in hog_procs:
            h.stop(1.0)
        cl.close()
    per = [json.loads(p.read_text()) for p in sorted(stats.glob("*.json"))]
    return {
        "minutes": minutes,
        "hang_timeout_s": hang_timeout,
        "hogs": hogs,
        "cpus": os.cpu_count(),
        "soak_s": round(max((p["t"] for p in per), default=started) - started, 1),
        "false_hangs": sum(1 for h in view if "hung" in h.get("reason", "")),
        "hang_lines_in_agent_logs": hung_lines,
        "restarts": job.get("restarts"),
        "state": job.get("state"),
        "agent_exit_codes": codes,
        "steps": sum(p["steps"] for p in per),
        "steps_per_rank": {f"rank {p['rank']} restart {p['restart']}": p["steps"] for p in per},
        "worst_gap_s": max((p["worst_gap_s"] for p in per), default=None),
        "gaps_over_1s": sum(p["gaps_over_1s"] for p in per),
        "load_start": load0,
        "load_end": load_end,
    }


def table(r: dict) -> str:
    gap = r["worst_gap_s"]
    rows = [
        [
            "soak",
            f"{r['soak_s'] / 60:.1f} min, 2 nodes x 1 gloo worker, progress() every step, "
            f"--hang-timeout {r['hang_timeout_s']:g} s, {r['hogs']} CPU hog(s) on {r['cpus']} CPU(s)",
        ],
        ["false hangs (expected 0)", f"{r['false_hangs']} (agent log lines ' hung: ' {r['hang_lines_in_agent_logs']})"],
        ["restarts", f"{r['restarts']} (job {r['state']}, agents exited {r['agent_exit_codes']})"],
        [
            "steps done (all ranks)",
            f"{r['steps']:,} ({', '.join(f'{k}: {v:,}' for k, v in r['steps_per_rank'].items())})",
        ],
        [
            "worst gap between two progress() calls of a worker",
            (f"{gap * 1000:.0f} ms" if gap is not None else "-") + f"; gaps over 1 s: {r['gaps_over_1s']}",
        ],
        ["load average (1, 5, 15 min)", f"{r['load_start']} at start, {r['load_end']} at end"],
    ]
    return C.md_table(["hang soak (rdzv only)", "result"], rows)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.soak_hang", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="how long the job runs (default 10)")
    p.add_argument("--hang-timeout", type=float, default=5.0, help="the agents' --hang-timeout (default 5)")
    p.add_argument("--hogs", type=int, default=os.cpu_count() or 1, help="busy processes (default: one per core)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args(argv)
    C.reexec_in_netns("bench.soak_hang", argv)
    import shutil
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="rdzv-soak-"))
    try:
        res = run(a.minutes, a.hang_timeout, a.hogs, tmp, log=lambda s: print(s, file=sys.stderr, flush=True))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(table(res))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
