"""A tiny PyTorch Lightning script (nothing rdzv-specific): a linear model,
random data, the ddp strategy on CPU (gloo), one short epoch. Lightning finds
torchrun's environment (TorchElasticEnvironment) and sets up the process group
itself. Prints one line per process, in one write::

    lightning rank R world W node N local L step S sum X env ENV

S is the trainer's global step at the end, X an all_reduce sum of every rank's
``rank + 1`` through Lightning's strategy, ENV the cluster environment's class.

Usage: lightning_train.py NUM_NODES DEVICES ROOT_DIR
"""

from __future__ import annotations

import os
import sys

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    num_nodes, devices, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        strategy="ddp",
        max_epochs=1,
        limit_train_batches=4,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    trainer.fit(Tiny(), DataLoader(data, batch_size=8))
    total = trainer.strategy.reduce(torch.tensor(float(trainer.global_rank + 1)), reduce_op="sum")
    env = type(trainer.strategy.cluster_environment).__name__
    line = (
        f"lightning rank {trainer.global_rank} world {trainer.world_size} node {trainer.node_rank} "
        f"local {trainer.local_rank} step {trainer.global_step} sum {float(total):g} env {env}\n"
    )
    os.write(1, line.encode())
    torch.distributed.destroy_process_group()
    # out without finalizing: Lightning's DDP on gloo may otherwise abort after the run
    # (docs/torchrun.md, "A DDP script that aborts as it exits")
    os._exit(0)


if __name__ == "__main__":
    main()
