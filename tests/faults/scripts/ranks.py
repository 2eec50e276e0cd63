"""Worker for the fault tests: one gloo all_reduce per tick, an end the test controls.

Every tick all-reduces ``[1, stop]`` (``stop`` is 1 on a rank that sees
``--stop-file``), checks the first sum is the world size, and prints::

    tick round R rank r node N pid P step S world W

(``round`` is TORCHELASTIC_RESTART_COUNT, ``node`` the ``--label`` its
agent was started with). When any rank saw the stop file, every rank leaves
after the same tick and exits 0, so the test ends a job when it wants to,
without a step count that has to outlast the faults it injects. A collective
that fails (a peer died or was cut off) prints ``collective failed`` and
exits 1 at once; with ``--hang-on-error`` it hangs instead, as a worker stuck
in a collective does (NCCL's often do), so only its agent can end it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--label", required=True)
    p.add_argument("--stop-file", required=True)
    p.add_argument("--interval", type=float, default=0.1)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--hang-on-error", action="store_true")
    args = p.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    pid = os.getpid()
    step = 0
    while True:
        step += 1
        t = torch.tensor([1.0, 1.0 if os.path.exists(args.stop_file) else 0.0])
        try:
            dist.all_reduce(t)
        except RuntimeError as e:
            print(f"collective failed round {restart} rank {rank} node {args.label}: {e}", flush=True)
            while args.hang_on_error:
                time.sleep(1)
            os._exit(1)
        if int(t[0].item()) != world:
            raise RuntimeError(f"all_reduce sum {t[0].item()} != world size {world}")
        print(f"tick round {restart} rank {rank} node {args.label} pid {pid} step {step} world {world}", flush=True)
        if t[1].item() > 0:
            break
        time.sleep(args.interval)
    print(f"done round {restart} rank {rank} node {args.label} step {step}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
