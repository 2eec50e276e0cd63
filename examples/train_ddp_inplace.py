"""A plain DDP training loop that keeps its processes: ``rdzv-agent --restart-mode in-place``.

    rdzv-agent --standalone --restart-mode in-place --nproc-per-node 2 examples/train_ddp_inplace.py

Five lines of the plain DDP loop it was differ, plus the import (docs/inplace.md, "A
plain DDP script, in place", shows the diff; the loop body moves two levels
in): per round a fresh gloo group (the default
group, so ``dist.get_rank()`` works), the state of the most advanced rank
(``sync_state``), and a DDP whose gradient all-reduce the agent can interrupt
(``inplace.ddp``): on a round change ``loss.backward()`` raises
``MembershipChanged``, the ``with`` block ends and the next round begins in the
same process. Without ``--restart-mode in-place`` it trains once per process.

Every rank prints, per step, ``step S rank R world W round C pid P sum X``
(``X``: a checksum of the parameters, the same on every rank after a step).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from rdzv_client import inplace, worker

N_IN, N_OUT = 16, 4


def say(line: str) -> None:
    sys.stdout.write(line + "\n")  # one write per line: ranks never split each other's lines
    sys.stdout.flush()


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1009 + rank)
    x = torch.randn(32, N_IN, generator=g)
    return x, x @ torch.linspace(-1, 1, N_IN * N_OUT).reshape(N_IN, N_OUT)


def train(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(N_IN, 32), nn.ReLU(), nn.Linear(32, N_OUT))
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    step = 0
    for world in worker.rounds():
        with inplace.group(world) as pg:
            step = inplace.sync_state(pg, world, model, opt, step)
            ddp = inplace.ddp(model, pg)
            while step < args.steps:
                x, y = batch(step, dist.get_rank())
                opt.zero_grad()
                nn.functional.mse_loss(ddp(x), y).backward()
                opt.step()
                step += 1
                check = sum(float(p.detach().double().sum()) for p in model.parameters())
                say(f"step {step} rank {dist.get_rank()} world {dist.get_world_size()} "
                    f"round {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')} pid {os.getpid()} "
                    f"sum {check:.10f} t {time.time():.4f}")  # fmt: skip
                time.sleep(args.step_sleep)
    inplace.exit(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-sleep", type=float, default=0.05, help="seconds to sleep per step")
    train(p.parse_args())


if __name__ == "__main__":
    main()
