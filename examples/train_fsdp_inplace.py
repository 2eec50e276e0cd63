"""A plain FSDP2 training loop that keeps its processes: ``rdzv-agent --restart-mode in-place``.

    rdzv-agent --standalone --restart-mode in-place --nproc-per-node 2 examples/train_fsdp_inplace.py

docs/inplace.md, "An FSDP2 script, in place", shows the diff against the plain FSDP2
loop it was: per round the model is built and sharded anew on a ``DeviceMesh``
over the round's group (``inplace_fsdp.mesh``: FSDP2's all-gathers and
reduce-scatters, which the agent can interrupt), and the state comes back from
the last ``torch.distributed.checkpoint`` save (``inplace_fsdp.resume``,
resharded for the new world size); ``inplace_fsdp.save`` every
``--save-every`` steps bounds what a round change costs. On a round change
``model(x)`` or ``loss.backward()`` raises ``MembershipChanged``, the ``with``
block ends and the next round begins in the same process.

Every rank prints ``resumed S rank R world W round C pid P sum X`` after the
load and, per step, ``step S rank R world W round C pid P sum X`` (``X``: a
checksum of the full parameters, all-gathered), then ``saved S ...`` once
that step's save returned (a save can be complete on disk without it: the
kill may come between DCP's last write and the rank's return).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from rdzv_client import inplace, inplace_fsdp, worker

N_IN, N_OUT = 16, 4


def say(line: str) -> None:
    sys.stdout.write(line + "\n")  # one write per line: ranks never split each other's lines
    sys.stdout.flush()


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1009 + rank)
    x = torch.randn(32, N_IN, generator=g)
    return x, x @ torch.linspace(-1, 1, N_IN * N_OUT).reshape(N_IN, N_OUT)


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(N_IN, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, N_OUT))


@torch.no_grad()
def checksum(model: nn.Module) -> float:
    return sum(float(p.full_tensor().double().sum()) for p in model.parameters())  # type: ignore[operator]


def where(step: int) -> str:
    return (f"{step} rank {dist.get_rank()} world {dist.get_world_size()} "
            f"round {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')} pid {os.getpid()}")  # fmt: skip


def train(args: argparse.Namespace) -> None:
    for world in worker.rounds():
        with inplace.group(world) as pg:
            mesh = inplace_fsdp.mesh(pg)
            model = build()
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            step = inplace_fsdp.resume(args.ckpt, model, opt)
            say(f"resumed {where(step)} sum {checksum(model):.10f}")
            while step < args.steps:
                x, y = batch(step, dist.get_rank())
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                step += 1
                total = checksum(model)
                say(f"step {where(step)} sum {total:.10f} t {time.time():.4f}")
                if step % args.save_every == 0:
                    inplace_fsdp.save(args.ckpt, model, opt, step)
                    say(f"saved {where(step)} sum {total:.10f}")
                time.sleep(args.step_sleep)
    inplace.exit(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-sleep", type=float, default=0.05, help="seconds to sleep per step")
    p.add_argument("--ckpt", default="checkpoints/fsdp", help="a directory every rank reads and writes")
    p.add_argument("--save-every", type=int, default=10, help="steps between two saves (what a round change costs)")
    train(p.parse_args())


if __name__ == "__main__":
    main()
