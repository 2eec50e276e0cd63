"""A training-shaped loop for the e2e tests: one gloo all_reduce per step.

Every step all-reduces a tensor of ones and checks the sum is the world size,
then prints ``step S rank R world W restart C pid P`` (the tests parse it).
Options inject failures:

* ``--fail-once MARKER --fail-rank R``: rank R raises once, after step 1 of the
  first attempt that finds no MARKER (it creates MARKER first);
* ``--fail-if-env NAME``: every worker whose environment has NAME raises after
  step 1, in every attempt (a node whose workers always fail);
* ``--on-collective-error raise|exit|hang``: what a worker does when a
  collective fails (a peer died): raise (the default: a traceback, then a slow
  interpreter teardown), exit 1 at once, or hang as if stuck in the collective
  (what NCCL does without async error handling) until the agent stops it.

Failures go through torch's ``@record``, so the agent finds the message in
``TORCHELASTIC_ERROR_FILE``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--interval", type=float, default=0.1)
    p.add_argument("--fail-once", default=None)
    p.add_argument("--fail-rank", type=int, default=0)
    p.add_argument("--fail-if-env", default=None)
    p.add_argument("--on-collective-error", choices=["raise", "exit", "hang"], default="raise")
    args = p.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    for step in range(1, args.steps + 1):
        t = torch.ones(1)
        try:
            dist.all_reduce(t)
        except RuntimeError as e:
            if args.on_collective_error == "raise":
                raise
            print(f"collective failed: {str(e).splitlines()[0]}", flush=True)
            if args.on_collective_error == "exit":
                os._exit(1)
            while True:
                time.sleep(1)
        if int(t.item()) != world:
            raise RuntimeError(f"all_reduce sum {t.item()} != world size {world}")
        print(f"step {step} rank {rank} world {world} restart {restart} pid {os.getpid()}", flush=True)
        if step == 1 and args.fail_if_env and os.environ.get(args.fail_if_env):
            raise RuntimeError(f"injected failure on rank {rank} (restart {restart})")
        if step == 1 and args.fail_once and rank == args.fail_rank and not os.path.exists(args.fail_once):
            open(args.fail_once, "w").close()
            raise RuntimeError(f"injected one-time failure on rank {rank}")
        time.sleep(args.interval)
    print(f"done rank {rank} world {world} restart {restart}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
