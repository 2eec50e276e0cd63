"""A worker for torchrun --rdzv-backend=rdzv: one gloo all_reduce per step.

Each step all-reduces a tensor of ones, checks the sum equals the world size,
and prints ``step S rank R world W restart C`` (tests/e2e/test_torchrun_plugin.py
parses it). A collective that fails because a peer died exits 1 at once, so
torchrun sees the failure without a slow traceback and teardown.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--interval", type=float, default=0.1)
    args = p.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    for step in range(1, args.steps + 1):
        t = torch.ones(1)
        try:
            dist.all_reduce(t)
        except RuntimeError as e:
            print(f"collective failed: {e}", flush=True)
            os._exit(1)
        if int(t.item()) != world:
            print(f"all_reduce sum {t.item()} != world size {world}", flush=True)
            os._exit(2)
        print(f"step {step} rank {rank} world {world} restart {restart}", flush=True)
        time.sleep(args.interval)
    print(f"done rank {rank} world {world} restart {restart}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
