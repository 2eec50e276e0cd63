"""A training loop written for Hugging Face accelerate (nothing rdzv-specific),
for a node-loss test under ``accelerate launch``.

A linear model through ``Accelerator.prepare`` (DDP over gloo on CPU): each
step's backward all-reduces the gradients. Prints, per step and process::

    step S rank R world W restart C pid P

(the same line as scripts/loop.py, so tests/helpers/torchrun.py reads it), and
``done rank R world W restart C`` at the end. A collective that fails because
a peer died raises, as a real script does.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from accelerate import Accelerator


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--interval", type=float, default=0.1)
    args = p.parse_args()
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    rank, world = acc.process_index, acc.num_processes
    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    for step in range(1, args.steps + 1):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        acc.backward(loss)  # DDP's all_reduce of the gradients
        opt.step()
        opt.zero_grad()
        os.write(1, f"step {step} rank {rank} world {world} restart {restart} pid {os.getpid()}\n".encode())
        time.sleep(args.interval)
    acc.wait_for_everyone()
    os.write(1, f"done rank {rank} world {world} restart {restart}\n".encode())
    acc.end_training()


if __name__ == "__main__":
    main()
