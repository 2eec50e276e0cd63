"""A Hugging Face accelerate script that keeps its processes: ``rdzv-agent --restart-mode in-place``.

    rdzv-agent --standalone --restart-mode in-place --nproc-per-node 2 examples/train_accelerate_inplace.py

A plain accelerate training loop (``Accelerator``, ``prepare``,
``accelerator.backward``) with its set-up moved into the round loop (docs/inplace.md,
"An accelerate script, in place", shows the diff): per round a fresh gloo
group, an ``InPlaceAccelerator`` on it (accelerate's state set up again for
the round's world), ``prepare`` as usual (a DDP whose gradient all-reduce the
agent can interrupt, the dataloader sharded for the new world) and the state
of the most advanced rank (``accelerator.sync_state``). On a round change
``accelerator.backward(loss)`` raises ``MembershipChanged``, the ``with``
block ends and the next round begins in the same process. Without
``--restart-mode in-place`` it trains once per process.

Every rank prints, per round, ``round C world W rank R batches B pid P`` (``B``:
its shard of the dataloader) and, per step, ``step S rank R world W round C pid P sum X t T``
(``X``: a checksum of the parameters, the same on every rank after a step).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from rdzv_client import inplace, worker
from rdzv_client.inplace_accelerate import InPlaceAccelerator

N_IN, N_OUT = 16, 4


def say(line: str) -> None:
    sys.stdout.write(line + "\n")  # one write per line: ranks never split each other's lines
    sys.stdout.flush()


def train(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(N_IN, 32), nn.ReLU(), nn.Linear(32, N_OUT))
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    x = torch.randn(4096, N_IN)
    data = TensorDataset(x, x @ torch.linspace(-1, 1, N_IN * N_OUT).reshape(N_IN, N_OUT))
    dl = DataLoader(data, batch_size=16, shuffle=True)
    step = 0
    for world in worker.rounds():
        with inplace.group(world) as pg:
            accelerator = InPlaceAccelerator(pg, cpu=True)
            model, opt, dl = accelerator.prepare(model, opt, dl)
            step = accelerator.sync_state(world, step)
            say(f"round {world.round} world {accelerator.num_processes} rank {accelerator.process_index} "
                f"batches {len(dl)} pid {os.getpid()}")  # fmt: skip
            while step < args.steps:
                for x, y in dl:
                    opt.zero_grad()
                    accelerator.backward(nn.functional.mse_loss(model(x), y))
                    opt.step()
                    step += 1
                    check = sum(float(p.detach().double().sum()) for p in model.parameters())
                    say(f"step {step} rank {accelerator.process_index} world {accelerator.num_processes} "
                        f"round {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')} pid {os.getpid()} "
                        f"sum {check:.10f} t {time.time():.4f}")  # fmt: skip
                    time.sleep(args.step_sleep)
                    if step >= args.steps:
                        break
    inplace.exit(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-sleep", type=float, default=0.05, help="seconds to sleep per step")
    train(p.parse_args())


if __name__ == "__main__":
    main()
