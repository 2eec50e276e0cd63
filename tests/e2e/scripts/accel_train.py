"""A tiny training script written for Hugging Face accelerate (nothing rdzv-specific).

Three SGD steps of a linear model through ``Accelerator.prepare`` (DDP over gloo on
CPU), then a gather of every process index. Prints one line per process::

    accel rank R world W gathered [0, 1, ..., W-1] role ROLE_NAME
"""

from __future__ import annotations

import os

import torch
from accelerate import Accelerator


def main() -> None:
    acc = Accelerator(cpu=True)
    torch.manual_seed(acc.process_index)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    for _ in range(3):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    gathered = acc.gather(torch.tensor([acc.process_index]))
    role = os.environ.get("ROLE_NAME")
    line = f"accel rank {acc.process_index} world {acc.num_processes} gathered {gathered.tolist()} role {role}\n"
    os.write(1, line.encode())  # one write: the node's workers share one stdout
    acc.wait_for_everyone()
    # Out without finalizing, every rank past the barrier: accelerate's DDP on gloo may otherwise
    # abort after the run (docs/torchrun.md, "A DDP script that aborts as it exits").
    os._exit(0)


if __name__ == "__main__":
    main()
