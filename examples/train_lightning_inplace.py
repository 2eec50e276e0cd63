"""A PyTorch Lightning script that keeps its processes: ``rdzv-agent --restart-mode in-place``.

    rdzv-agent --standalone --restart-mode in-place --nproc-per-node 2 examples/train_lightning_inplace.py

A plain Lightning script (LightningModule, DataLoader, ``Trainer.fit``) with
three lines of rdzv: the import, ``strategy=InPlaceDDPStrategy()`` in place of
``strategy="ddp"`` (no ``num_nodes``: the world size is the round's) and
``inplace.exit(0)`` at the end (it skips the destructors of the abandoned
groups). On a round change ``fit`` goes on in the same process from the
highest ``global_step`` any rank reached (docs/inplace.md, "A Lightning script, in
place"). Without ``--restart-mode in-place`` it trains once per process.

Every rank prints, per step, ``step S rank R world W round C pid P sum X t T``
(``X``: a checksum of the parameters, the same on every rank after a step).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from rdzv_client import inplace
from rdzv_client.inplace_lightning import InPlaceDDPStrategy

N_IN, N_OUT = 16, 4


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(N_IN, 32), nn.ReLU(), nn.Linear(32, N_OUT))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True)  # a reduce over the round's group each step
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)


class Report(pl.Callback):
    """One line per step, in one write (ranks never split each other's lines)."""

    def __init__(self, step_sleep: float) -> None:
        self.step_sleep = step_sleep

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        check = sum(float(p.detach().double().sum()) for p in pl_module.parameters())
        sys.stdout.write(
            f"step {trainer.global_step} rank {trainer.global_rank} world {trainer.world_size} "
            f"round {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')} pid {os.getpid()} "
            f"sum {check:.10f} t {time.time():.4f}\n"
        )
        sys.stdout.flush()
        time.sleep(self.step_sleep)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=200, help="max_steps")
    p.add_argument("--step-sleep", type=float, default=0.05, help="seconds to sleep per step")
    p.add_argument("--root", default=None, help="Lightning's default_root_dir")
    args = p.parse_args()
    torch.manual_seed(0)
    x = torch.randn(4096, N_IN)
    data = TensorDataset(x, x @ torch.linspace(-1, 1, N_IN * N_OUT).reshape(N_IN, N_OUT))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=InPlaceDDPStrategy(),
        max_steps=args.steps,
        callbacks=[Report(args.step_sleep)],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.root,
    )
    trainer.fit(Regression(), DataLoader(data, batch_size=16, shuffle=True))
    sys.stdout.write(f"done rank {trainer.global_rank} global_step {trainer.global_step} pid {os.getpid()}\n")
    inplace.exit(0)


if __name__ == "__main__":
    main()
