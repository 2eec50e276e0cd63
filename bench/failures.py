"""Rows 11 and 12: failures that do not crash, rdzv against torchrun.

    python -m bench.failures [--runs K] [--bound S] [--hang-timeout S] [--out FILE.json] [--only hang,bad_host]

Same machinery and table as bench/compare.py (a real rdzv-server per row and
run; torchrun with its c10d rendezvous; one worker per agent, all on this
host over loopback; workers are ``bench/scripts/stamp.py``, the same file for
both launchers; runs interleave the launchers).

13. Worker hangs: 2 nodes (``--nnodes 2``) train (gloo all_reduce every 0.1 s,
    ``progress()`` after each; torchrun: a no-op); rank 1's worker is
    SIGSTOPped 1 s into training. Measured: SIGSTOP -> every worker of the
    next round has reported progress. rdzv (``--hang-timeout``): from the REST
    job view, the server time at which each node's step of the new round
    arrived (``since_progress_s``); torchrun: the ``step1`` line each worker
    of the next attempt writes after its first all_reduce. torchrun has no
    hang detection: the peer's all_reduce times out after the script's gloo
    timeout (60 s), it exits 1 and torchrun restarts the group. Bound: a side
    that has not recovered within it prints "> BOUND s (not recovered)".

14. A host that fails on every join: 2 nodes + 1 spare (``--nnodes 2:2``,
    three agents), the first agent's worker exits 1 at start in every
    attempt. Measured: the first failure -> both workers of a round without
    that host did their first all_reduce; and the rounds that took. rdzv: the
    server's bad-host record (default ``--host-failures 3``) cools the host
    down and the spare takes its place. torchrun cannot exclude a host: it
    restarts until ``--max-restarts 3`` is spent ("never: the budget runs
    out", with the seconds until its agents gave up).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from . import _common as C
from .compare import LAUNCHERS, Cluster, Outcome, Row, _all_started, measure

BAD_ENV = "RDZV_BENCH_BAD_HOST"


def _job_view(cl: Cluster) -> dict | None:
    body = C.http_get(f"http://{cl.endpoint}/v1/jobs/{cl.job}", 2)
    return json.loads(body) if body else None


def _rdzv_progress_at(cl: Cluster, round_no: int, world: int) -> float | None:
    """When the server had a step from every node of round ``round_no``
    (or later), in its clock (this host's): None until then."""
    t_poll = time.time()
    view = _job_view(cl)
    if not view or view.get("round", -1) < round_no or view.get("state") != "running":
        return None
    nodes = view["nodes"]
    if len(nodes) != world or any(n.get("since_progress_s") is None or n.get("step") is None for n in nodes):
        return None
    formed = (view["history"] or [{}])[-1].get("completed_at")
    if formed is None:
        return None
    at = [t_poll - n["since_progress_s"] for n in nodes]
    return max(at) if min(at) >= formed else None  # every step arrived after the round formed


def row_hang(cl: Cluster, bound: float, hang_timeout: float, setup_bound: float = 90.0) -> Outcome:
    """2 nodes train; SIGSTOP rank 1's worker -> every worker of the next round reported progress."""
    flags = ("--hang-timeout", f"{hang_timeout:g}")
    for _ in range(2):
        cl.launch("2", cl.stamp_cmd("--loop", "--progress"), rdzv_flags=flags)
    t, why = _wait(cl, lambda: _all_started(cl, 2, what="step1"), setup_bound)
    if t is None:
        return Outcome(None, f"setup failed: {why or f'no world 2 in {setup_bound:g} s'}")
    time.sleep(1.0)
    victim = next((ln for ln in cl.lines() if ln.what == "step1" and ln.rank == 1 and ln.world == 2), None)
    if victim is None:
        return Outcome(None, "setup failed: no rank 1")
    t_stop = time.time()
    os.kill(victim.pid, signal.SIGSTOP)
    after_steps = lambda: _all_started(cl, 2, after=t_stop, what="step1")  # noqa: E731
    if cl.launcher == "rdzv":
        t, why = _wait(cl, lambda: _rdzv_progress_at(cl, 1, 2), bound)
    else:
        t, why = _wait(cl, after_steps, bound)
    if t is None:
        return Outcome(None, why or f"> {bound:g} s (not recovered)")
    info: dict = {}
    t_step = C.wait_until(after_steps, 10)
    if t_step:
        info["stop_to_first_step"] = t_step - t_stop  # the script's own line, for both launchers
    if cl.launcher == "rdzv":
        hist = (_job_view(cl) or {}).get("history", [])
        info["hang_reported_s"] = next(
            (h["started_at"] - t_stop for h in hist if h["round"] == 1 and "hung" in h["reason"]), None
        )
    return Outcome(t - t_stop, info=info)


def row_bad_host(cl: Cluster, bound: float, setup_bound: float = 90.0) -> Outcome:
    """2 nodes (one on host "bad") train and a spare waits; then the bad
    host's worker fails, and fails at every start after -> a round without it
    trains (both workers' first all_reduce)."""
    marker = cl.dir / "host-is-bad"
    cmd = cl.stamp_cmd("--loop", "--fail-if-env", BAD_ENV)
    bad = cl.launch("2:2", cmd, env={BAD_ENV: str(marker)}, rdzv_flags=_host("bad"))
    cl.launch("2:2", cmd, rdzv_flags=_host("good1"))
    t, why = _wait(cl, lambda: _all_started(cl, 2, what="step1"), setup_bound)
    if t is None:
        return Outcome(None, f"setup failed: {why or f'no world 2 in {setup_bound:g} s'}")
    cl.launch("2:2", cmd, rdzv_flags=_host("spare"))
    joined = lambda: len((_job_view(cl) or {}).get("spares", [])) == 1  # noqa: E731
    if cl.launcher == "rdzv" and not C.wait_until(joined, setup_bound, 0.1):
        return Outcome(None, "setup failed: the spare did not join")
    time.sleep(5.0)  # torchrun: the spare's agent waits in the rendezvous (it may restart the group)
    members = {a.name for a in (cl.agent_of(p) for p in _current_pids(cl)) if a is not None}
    if bad.name not in members:
        return Outcome(None, f"setup: the bad host is not in the running round (members {sorted(members)})")
    marker.touch()
    if not C.wait_until(lambda: [ln for ln in cl.lines() if ln.what == "crash"], 30):
        return Outcome(None, "setup failed: no failure in 30 s")
    t_first = min(ln.t for ln in cl.lines() if ln.what == "crash")

    def trained() -> tuple[float, str] | None:
        """Both ranks' first all_reduce after the first failure: a round without
        the bad host (its worker fails at start). Its restart count(s): rdzv's
        are the round number; torchrun's are per agent, and may differ."""
        t = _all_started(cl, 2, after=t_first, what="step1")
        if t is None:
            return None
        last = {ln.rank: ln.restart for ln in cl.lines() if ln.what == "step1" and ln.t > t_first and ln.t <= t}
        return t, "/".join(sorted(set(last.values())))

    got, _ = _wait(cl, trained, bound)
    crashes = sum(1 for ln in cl.lines() if ln.what == "crash")
    if got is None:
        if all(a.poll() is not None for a in cl.agents):
            gone = max(a.exited_at or time.time() for a in cl.agents)
            codes = ",".join(str(a.popen.returncode) for a in cl.agents)
            return Outcome(
                None,
                f"never: the budget runs out (--max-restarts 3; {crashes} failures, agents exited {codes}), "
                f"job failed {gone - t_first:.0f} s in",
                info={"failures": crashes},
            )
        alive = sum(a.poll() is None for a in cl.agents)
        return Outcome(
            None,
            f"> {bound:g} s (not recovered; {crashes} failures, {alive} of {len(cl.agents)} agents still running)",
            info={"failures": crashes},
        )
    t, restart = got
    info = {"failures": crashes, "round": restart}
    if cl.launcher == "rdzv":
        host = C.http_get(f"http://{cl.endpoint}/v1/hosts/bad", 2)
        info["bad_host_state"] = json.loads(host).get("state") if host else None
    return Outcome(t - t_first, info=info)


def _current_pids(cl: Cluster) -> list[int]:
    """The workers of the latest round that did a collective: per rank, the
    latest ``step1`` line's pid (torchrun's restart counts differ per agent)."""
    latest: dict[int, tuple[float, int]] = {}
    for ln in cl.lines():
        if ln.what == "step1" and (ln.rank not in latest or ln.t > latest[ln.rank][0]):
            latest[ln.rank] = (ln.t, ln.pid)
    return [pid for _, pid in latest.values()]


def _host(name: str) -> tuple[str, ...]:
    return ("--host-name", name)


def _wait(cl: Cluster, fn, bound: float) -> tuple[float | None, str | None]:
    """fn's first value within ``bound`` (None, why: every agent exited / None, None: the bound)."""
    deadline = time.time() + bound
    while time.time() < deadline:
        v = fn()
        if v is not None:
            return v, None
        if cl.agents and all(a.poll() is not None for a in cl.agents):
            v = fn()
            if v is not None:
                return v, None
            codes = ",".join(str(a.popen.returncode) for a in cl.agents)
            return None, f"job died: every agent exited ({codes})"
        time.sleep(0.05)
    return None, None


def plan(bound: float, hang_timeout: float, smoke: bool = False) -> list[Row]:
    return [
        Row(
            "hang",
            f"13. Worker hangs (rank 1 of 2 SIGSTOPped mid-training; rdzv `--hang-timeout {hang_timeout:g}`, "
            f"torchrun: the script's 60 s gloo timeout) -> every worker of the next round reported progress "
            f"(bound {bound:g} s)",
            lambda cl: row_hang(cl, bound, hang_timeout),
            launchers=("rdzv",) if smoke else LAUNCHERS,
        ),
        Row(
            "bad_host",
            f"14. A host whose worker fails at every start, 2 nodes + 1 spare: first failure -> a round "
            f"without it trains (bound {bound:g} s)",
            lambda cl: row_bad_host(cl, bound),
            launchers=("rdzv",) if smoke else LAUNCHERS,
        ),
    ]


def _cell(outs: list[Outcome], key: str) -> str:
    if not outs:
        return "n/a"
    vals = [o.value for o in outs if o.value is not None]
    parts = []
    if vals:
        text = f"{C.median(vals):.2f} s" + (f" ({min(vals):.2f}-{max(vals):.2f})" if len(vals) > 1 else "")
        if key == "hang":
            steps = [o.info["stop_to_first_step"] for o in outs if o.info.get("stop_to_first_step") is not None]
            if steps:
                text += f" [1st all_reduce {C.median(steps):.1f} s]"
        if key == "bad_host":
            rounds = [o.info["round"] for o in outs if o.value is not None]
            fails = [o.info["failures"] for o in outs if o.value is not None]
            text += f" [restart count {', '.join(rounds)}; after {', '.join(str(f) for f in fails)} failures]"
        parts.append(text)
    parts += [o.failure or "" for o in outs if o.value is None]
    return "; ".join(parts)


def table(rows: list[Row], results: dict) -> str:
    body = []
    for row in rows:
        r = results[row.key]
        body.append([row.title, _cell(r.get("rdzv", []), row.key), _cell(r.get("torchrun", []), row.key)])
    return C.md_table(["row", "rdzv median (min-max)", "torchrun median (min-max)"], body)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.failures", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=1, help="runs per row and launcher (default 1)")
    p.add_argument("--bound", type=float, default=120.0, help="seconds a side may take to recover (default 120)")
    p.add_argument("--hang-timeout", type=float, default=5.0, help="rdzv's --hang-timeout (default 5)")
    p.add_argument("--only", default=None, help="comma-separated row keys (hang, bad_host)")
    p.add_argument("--smoke", action="store_true", help="rdzv only, bound 60 s")
    p.add_argument("--out", default=None, help="write all results as JSON here")
    a = p.parse_args(argv)
    C.reexec_in_netns("bench.failures", argv)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    started, load0 = time.time(), C.loadavg()
    rows = plan(60.0 if a.smoke else a.bound, a.hang_timeout, smoke=a.smoke)
    if a.only:
        rows = [r for r in rows if r.key in set(a.only.split(","))]
    import shutil
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="rdzv-bench-failures-"))
    try:
        launchers = ("rdzv",) if a.smoke else LAUNCHERS
        results = measure(rows, a.runs, tmp, log=log, launchers=launchers)
    finally:
        if os.environ.get("BENCH_KEEP_TMP"):
            log(f"[bench] kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    text = table(rows, results)
    print(text)
    print()
    print(
        f"- {a.runs} run(s) per row and launcher, interleaved; {os.cpu_count()} CPU(s); load average {load0} "
        f"at start, {C.loadavg()} at end; {time.time() - started:.0f} s in all; "
        f"{'private network namespace' if C.in_private_netns() else 'plain loopback'}"
    )
    if a.out:
        Path(a.out).write_text(
            json.dumps(
                {
                    row.key: {
                        "title": row.title,
                        **{
                            name: [{"value": o.value, "failure": o.failure, "info": o.info} for o in outs]
                            for name, outs in results[row.key].items()
                        },
                    }
                    for row in rows
                }
                | {"table": text},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
