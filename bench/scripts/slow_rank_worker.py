"""Lock-step worker for bench.slow_rank: an all_reduce every step and a
``worker.compute()`` block of ``BENCH_COMPUTE_S`` seconds (a sleep); once the
file ``BENCH_SLOW_FILE`` exists, a worker with ``BENCH_SLOW_FACTOR`` computes
that many times longer. Runs until ``BENCH_STEPS`` steps."""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

from rdzv_client.worker import compute, finished, progress


def main() -> None:
    base = float(os.environ.get("BENCH_COMPUTE_S", "0.05"))
    factor = float(os.environ.get("BENCH_SLOW_FACTOR", "1"))
    trigger = os.environ.get("BENCH_SLOW_FILE", "")
    steps = int(os.environ.get("BENCH_STEPS", "100000"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    slow = False
    for step in range(1, steps + 1):
        if factor != 1 and not slow and trigger and os.path.exists(trigger):
            slow = True
        with compute():
            time.sleep(base * (factor if slow else 1.0))
        dist.all_reduce(torch.ones(1))
        progress(step)
    finished()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
