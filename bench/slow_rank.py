"""Lock-step stragglers (issue 22): how long from a rank turning slow to its
flag and to its replacement.

    python -m bench.slow_rank [--factors 5,1.5] [--window S] [--runs N] [--out FILE.json]
    python -m bench.slow_rank --soak MINUTES [--window S] [--hogs N]

A real rdzv-server, three real rdzv-agents in lock-step (``--nnodes 3``, one
gloo worker each: ``bench/scripts/slow_rank_worker.py``, an all_reduce and a
``worker.compute()`` block of 50 ms every step) and a fourth agent waiting as
a spare, ``--straggler-policy replace --straggler-window-s S`` (default 5).
Once every member's timings show in the job view, one worker computes
``factor`` times longer (a file appears: T0). Flag: when the round that
replaces it opened (the server's clock: ``replace`` opens it at the check
that flags); replaced: when that round completed with the spare in it. Both
in seconds after T0 and in windows. Prints one table.

``--soak M``: no rank turns slow; three equal lock-step nodes (``warn``) run
for M minutes and every flag is a false one (the server's
``rdzv_stragglers_flagged_total`` and its "is a straggler" lines), with the
load average; ``--hogs N`` busy Python loops load the machine meanwhile.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from . import _common as C
from .compare import Cluster

WORKER = C.SCRIPTS / "slow_rank_worker.py"
SETUP_S = 120.0


def _view(cl: Cluster) -> dict:
    body = C.http_get(f"http://{cl.endpoint}/v1/jobs/{cl.job}", 5)
    return json.loads(body) if body else {}


def run_one(factor: float, window: float, tmp: Path, log=print) -> dict:
    cl = Cluster("rdzv", tmp, "slowrank")
    trigger = cl.dir / "slow-now"
    flags = ("--straggler-policy", "replace", "--straggler-window-s", f"{window:g}", "--host-name")
    try:
        for i in range(4):  # the 4th: a spare
            env = {"BENCH_SLOW_FILE": str(trigger), "BENCH_SLOW_FACTOR": f"{factor:g}" if i == 1 else "1"}
            cl.launch("3:3", [str(WORKER)], rdzv_flags=(*flags, f"h{i}"), env=env)
            if i == 2:
                ok = C.wait_until(lambda: _view(cl).get("state") == "running", SETUP_S, 0.2)
                if not ok:
                    raise RuntimeError("the job did not start:\n" + cl.agents[0].text()[-2000:])

        def timed() -> bool:
            v = _view(cl)
            running = [n for n in v.get("nodes", []) if n["state"] == "running"]
            return len(v.get("spares", [])) == 1 and len(running) == 3 and all(n["timings"] for n in running)

        if not C.wait_until(timed, SETUP_S, 0.2):
            raise RuntimeError("no timings:\n" + cl.agents[0].text()[-2000:])
        t0 = time.time()
        trigger.write_text("now")

        def replaced() -> dict | None:
            v = _view(cl)
            hist = v.get("history", [])
            done = len(hist) >= 2 and hist[-1]["completed_at"] is not None
            return v if done else None

        v = C.wait_until(replaced, 10 * window + 60, 0.2)
        if not v:
            raise RuntimeError("not replaced:\n" + (cl.server.text()[-3000:] if cl.server else ""))
        rec = v["history"][-1]
        flagged, swapped = rec["started_at"] - t0, rec["completed_at"] - t0
        members = sorted(n["host"] for n in v["nodes"])
        log(f"[slow_rank] {factor:g}x: flagged {flagged:.1f}s, replaced {swapped:.1f}s; members {members}")
        return {
            "factor": factor,
            "window_s": window,
            "flag_s": round(flagged, 2),
            "replaced_s": round(swapped, 2),
            "flag_windows": round(flagged / window, 2),
            "members": members,
            "reason": rec["reason"],
            "restarts": v["restarts"],
        }
    finally:
        cl.close()


def soak(minutes: float, window: float, hogs: int, tmp: Path, log=print) -> dict:
    cl = Cluster("rdzv", tmp, "slowsoak")
    flags = ("--straggler-policy", "warn", "--straggler-window-s", f"{window:g}", "--host-name")
    load0 = C.loadavg()
    hog_procs: list[C.Proc] = []
    try:
        hog_procs = [
            C.Proc(f"hog{i}", [sys.executable, "-c", "while True: pass"], cl.dir / f"hog{i}.log") for i in range(hogs)
        ]
        for i in range(3):
            cl.launch("3:3", [str(WORKER)], rdzv_flags=(*flags, f"h{i}"))

        def timed() -> bool:
            running = [n for n in _view(cl).get("nodes", []) if n["state"] == "running"]
            return len(running) == 3 and all(n["timings"] for n in running)

        if not C.wait_until(timed, SETUP_S, 0.2):
            raise RuntimeError("no timings:\n" + cl.agents[0].text()[-2000:])
        log(f"[slow_rank] soak: 3 equal lock-step nodes for {minutes:g} min, window {window:g} s")
        ratios: list[float] = []
        end = time.time() + minutes * 60
        while time.time() < end:
            v = _view(cl)
            fr = [t["compute_s"] / t["window_s"] for n in v.get("nodes", []) for t in (n["timings"] or [])]
            if len(fr) >= 3:
                mid = sorted(fr)[len(fr) // 2]
                ratios += [mid / f for f in fr if f > 0]
            time.sleep(1.0)
        metrics = (C.http_get(f"http://{cl.endpoint}/metrics", 5) or b"").decode()
        series = f'rdzv_stragglers_flagged_total{{job_id="{cl.job}"}}'
        flagged = sum(float(ln.split()[-1]) for ln in metrics.splitlines() if ln.startswith(series))
        lines = cl.server.text().count("is a straggler") if cl.server else -1
        v = _view(cl)
        return {
            "minutes": minutes,
            "window_s": window,
            "flags": flagged,
            "straggler_lines": lines,
            "min_score_seen": round(min(ratios), 3) if ratios else None,
            "steps": min((n["step"] or 0) for n in v["nodes"]),
            "hogs": hogs,
            "load": f"{load0} -> {C.loadavg()}",
        }
    finally:
        for h in hog_procs:
            h.stop(1.0)
        cl.close()


def rows(results: list[dict]) -> list[list[str]]:
    """Row 15 of ``python -m bench``: one per slow factor (rdzv only: torchrun has no straggler detection)."""
    return [
        [
            f"15. Lock-step straggler: 3 gloo nodes + 1 spare, `--straggler-policy replace --straggler-window-s "
            f"{r['window_s']:g}`; one rank's compute turns {r['factor']:g}x longer -> flagged / replaced",
            f"{r['flag_s']:.1f} s ({r['flag_windows']:.2f} windows) / {r['replaced_s']:.1f} s, "
            f"{r['restarts']} restart(s) charged",
            "n/a",
            "no straggler detection",
        ]
        for r in results
    ]


def run(factors: list[float], window: float = 5.0, runs: int = 1, log=print) -> list[dict]:
    tmp = Path(tempfile.mkdtemp(prefix="rdzv-slow-rank-"))
    try:
        return [run_one(f, window, tmp, log) for f in factors for _ in range(runs)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--factors", default="5,1.5")
    p.add_argument("--window", type=float, default=5.0)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--soak", type=float, default=0.0, help="minutes of equal ranks: false flags")
    p.add_argument("--hogs", type=int, default=0, help="--soak: busy processes loading the machine")
    p.add_argument("--out")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="rdzv-slow-rank-"))
    log = functools.partial(print, file=sys.stderr, flush=True)
    if a.soak:
        res = soak(a.soak, a.window, a.hogs, tmp, log)
        print(json.dumps(res))
        return
    rows = [run_one(float(f), a.window, tmp, log) for f in a.factors.split(",") for _ in range(a.runs)]
    header = ["slow rank", "window", "to flag", "to replaced", "flag (windows)", "restarts charged", "members after"]
    print(
        C.md_table(
            header,
            [
                [
                    f"{r['factor']:g}x compute",
                    f"{r['window_s']:g} s",
                    f"{r['flag_s']:.1f} s",
                    f"{r['replaced_s']:.1f} s",
                    f"{r['flag_windows']:.2f}",
                    str(r["restarts"]),
                    ", ".join(r["members"]),
                ]
                for r in rows
            ],
        )
    )
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
