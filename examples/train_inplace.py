"""Elastic training that keeps its processes: ``rdzv-agent --restart-mode in-place``.

On a round change (a node lost, a node joined, a worker failed elsewhere) the
agent does not restart this process: :func:`rdzv_client.worker.rounds` hands
it the next round (``os.environ`` updated), the script makes a fresh gloo
group, takes the model and optimizer of the most advanced rank (a broadcast,
no checkpoint read) and trains on. New nodes start it as usual; it gets its
state the same way.

    rdzv-agent --standalone --restart-mode in-place --nproc-per-node 2 examples/train_inplace.py

Without ``--restart-mode in-place`` it trains the same way, once per process.
Every rank prints, per step, ``step S rank R world W round C pid P sum X``
(``X``: a checksum of the parameters, the same on every rank after a step),
and once per round ``synced round C rank R world W step S fresh F t T``
(``T``: the wall time its first all_reduce of that round returned).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
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
    for world in worker.rounds():  # once per round, the first included
        try:
            pg = inplace.process_group(world)  # fresh store and gloo group for this round
            step = inplace.sync_state(pg, world, model, opt, step)  # from the most advanced rank
            say(f"synced round {world.round} rank {world.rank} world {world.world_size} "
                f"step {step} fresh {int(world.fresh)} t {time.time():.4f}")  # fmt: skip
            while step < args.steps:
                x, y = batch(step, world.rank)
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
                inplace.all_reduce(grads, pg)  # waits in slices: a lost peer ends the step at once
                torch.nn.utils.vector_to_parameters(grads / world.world_size, [p.grad for p in model.parameters()])
                opt.step()
                step += 1
                worker.progress(step)  # raises MembershipChanged when the agent says the round is over
                check = sum(float(p.detach().double().sum()) for p in model.parameters())
                say(f"step {step} rank {world.rank} world {world.world_size} round {world.round} "
                    f"pid {os.getpid()} sum {check:.10f}")  # fmt: skip
                time.sleep(args.step_sleep)
                chaos(args, world, step)
            break
        except worker.MembershipChanged as e:
            say(f"membership changed at step {step} rank {world.rank}: {e}")
    say(f"done step {step} rank {world.rank}")
    inplace.exit(0)  # skip abandoned groups' destructors (a pending gloo op blocks them)


def chaos(args: argparse.Namespace, world: worker.World, step: int) -> None:
    """Test knobs: a worker exception, or a worker that ignores the agent."""
    if args.fail_at_step == step and world.rank == args.fail_rank and world.round == 0:
        raise RuntimeError(f"chaos: rank {world.rank} fails at step {step}")
    if args.ignore_at_step == step and world.rank == args.ignore_rank and world.round == 0:
        say(f"ignoring the agent from step {step} rank {world.rank}")
        while True:
            time.sleep(1)  # never checks in: the agent escalates


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-sleep", type=float, default=0.05, help="seconds to sleep per step")
    p.add_argument("--fail-at-step", type=int, default=-1, help="test: raise at this step (round 0)")
    p.add_argument("--fail-rank", type=int, default=0)
    p.add_argument("--ignore-at-step", type=int, default=-1, help="test: ignore the agent from this step (round 0)")
    p.add_argument("--ignore-rank", type=int, default=0)
    train(p.parse_args())


if __name__ == "__main__":
    main()
