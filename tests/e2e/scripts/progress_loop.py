"""A gloo all_reduce loop that reports progress: ``rdzv_client.worker.progress(step)``
once per step, and prints ``step S rank R world W restart C pid P`` as loop.py
does (the tests parse it and SIGSTOP a worker by its pid).

* ``--stop-self-at S``: in the first attempt (restart 0), the worker of
  ``--stop-rank`` stops itself (SIGSTOP) after step S, as a frozen process.
  With ``--stay-stopped`` it stays frozen, as a process stuck for good: it
  ignores SIGTERM and stops itself again whenever it is continued (the
  agent's SIGCONT lets it write its stack, nothing more); only SIGKILL ends it.
* ``--sync-every N``: the all_reduce runs every N steps (default 1; 0: only a
  barrier at the end), so that ranks can progress at their own pace.
* ``--later-steps N``: attempts after the first (restart 1 and on) run N steps
  instead of ``--steps`` (a test that needs a long first round only).
* ``E2E_STEP_INTERVAL`` in the environment overrides ``--interval`` (one slow
  node: stragglers).
* ``--compute``: the step's sleep is its compute (``with worker.compute():``),
  so the ranks report timings (lock-step stragglers, issue 22).
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from rdzv_client.worker import compute, finished, progress


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--interval", type=float, default=0.1)
    p.add_argument("--stop-self-at", type=int, default=0)
    p.add_argument("--stop-rank", type=int, default=0)
    p.add_argument("--sync-every", type=int, default=1)
    p.add_argument("--later-steps", type=int, default=0)
    p.add_argument("--stay-stopped", action="store_true")
    p.add_argument("--compute", action="store_true")
    args = p.parse_args()
    interval = float(os.environ.get("E2E_STEP_INTERVAL", args.interval))

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    steps = args.later_steps if args.later_steps and restart != "0" else args.steps
    for step in range(1, steps + 1):
        t = torch.ones(1)
        if args.sync_every and step % args.sync_every == 0:
            dist.all_reduce(t)  # ALL_REDUCE_LINE
        print(f"step {step} rank {rank} world {world} restart {restart} pid {os.getpid()}", flush=True)
        progress(step)
        if step == args.stop_self_at and restart == "0" and rank == args.stop_rank:
            if args.stay_stopped:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                while True:
                    os.kill(os.getpid(), signal.SIGSTOP)
            os.kill(os.getpid(), signal.SIGSTOP)
        if args.compute:
            with compute():
                time.sleep(interval)
        else:
            time.sleep(interval)
    finished()  # teardown is not a hang
    print(f"done rank {rank} world {world} restart {restart}", flush=True)
    if not args.sync_every:
        dist.barrier()  # nobody tears gloo down while a slower peer still runs
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
