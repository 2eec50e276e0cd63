"""Row 10: the cost of ``rdzv_client.worker.progress()`` per call, measured in
a fresh worker-like process against a real agent-side socket
(:class:`rdzv_client.channel.WorkerChannel`, served by an asyncio loop in
another process, as the agent does), and of the step timing's bookkeeping
(:mod:`rdzv_client.steptime`): a ``with worker.compute():`` block and one
timed collective wait (``wait_begin``/``wait_end``, what the library's group
adds to each wait). torchrun has no equivalent (n/a).

``python -m bench.progress_cost [--calls N] [--reps K]`` prints the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

_WORKER = r"""
import json, sys, time
from rdzv_client import steptime
from rdzv_client.worker import compute, progress
calls, reps = int(sys.argv[1]), int(sys.argv[2])
per, blocks, waits = [], [], []
for _ in range(reps):
    t0 = time.perf_counter()
    for i in range(calls):
        progress(i)
    per.append((time.perf_counter() - t0) / calls)
    t0 = time.perf_counter()
    for i in range(calls):
        steptime.wait_end(steptime.wait_begin())
    waits.append((time.perf_counter() - t0) / calls)
    t0 = time.perf_counter()
    for i in range(calls):
        with compute():
            pass
    blocks.append((time.perf_counter() - t0) / calls)
print(json.dumps([per, blocks, waits]))
"""


async def _measure(calls: int, reps: int) -> dict[str, Any]:
    from rdzv_client.channel import WorkerChannel

    ch = WorkerChannel(nproc=1)
    await ch.start()
    ch.new_round(0)
    try:
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "RDZV_AGENT_SOCKET": ch.path,
            "TORCHELASTIC_RESTART_COUNT": "0",
            "LOCAL_RANK": "0",
        }
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _WORKER, str(calls), str(reps), env=env, stdout=subprocess.PIPE
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 300)
        per, blocks, waits = json.loads(out)
        await asyncio.sleep(0.2)
        seen = ch.ranks[0].step if 0 in ch.ranks else None
    finally:
        ch.close()
    return {
        "calls": calls,
        "reps": reps,
        "per_call_s": per,
        "median_s": statistics.median(per),
        "min_s": min(per),
        "max_s": max(per),
        "agent_saw_step": seen,
        "compute_block_median_s": statistics.median(blocks),
        "timed_wait_median_s": statistics.median(waits),
    }


def run(calls: int = 1_000_000, reps: int = 5) -> dict[str, Any]:
    return asyncio.run(_measure(calls, reps))


def rows(res: dict[str, Any]) -> list[list[str]]:
    def us(s: float) -> str:
        return f"{s * 1e6:.2f} µs"

    return [
        [
            f"10. Worker: `rdzv_client.worker.progress()` per call ({res['calls']:,} calls, median of {res['reps']})",
            f"{us(res['median_s'])} ({us(res['min_s'])}-{us(res['max_s'])})",
            "n/a",
            "-",
        ],
        [
            "10b. Worker: step timing, per `with worker.compute():` block / per timed collective wait "
            f"(`rdzv_client.steptime`, median of {res['reps']})",
            f"{us(res['compute_block_median_s'])} / {us(res['timed_wait_median_s'])}",
            "n/a",
            "no system call, nothing sent per collective",
        ],
    ]


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m bench.progress_cost")
    p.add_argument("--calls", type=int, default=1_000_000)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    res = run(a.calls, a.reps)
    print(json.dumps(res, indent=1))
    print("\n".join("| " + " | ".join(r) + " |" for r in rows(res)))
