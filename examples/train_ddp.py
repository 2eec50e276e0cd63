"""A small but real elastic DDP training script, for torchrun or rdzv-agent.

It reads the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT, TORCHELASTIC_RESTART_COUNT), trains an MLP on a deterministic
synthetic regression (y = W x + noise), checkpoints atomically every
``--ckpt-every`` steps, and resumes from the latest checkpoint with whatever
world size the new round has. Kill it at any time: a checkpoint is either the
old one or the new one, never half of one.

    torchrun --standalone --nproc-per-node 2 examples/train_ddp.py --steps 100
    rdzv-agent --standalone --nproc-per-node 2 examples/train_ddp.py --steps 100

Lines it prints (rank 0, except ``started`` which every rank prints)::

    started rank 0/2 local_rank 0 restart_count 0 resumed_from_step 0
    step 10 loss 0.4321 world_size 2 rank 0 restart 0
    done step 100
"""

from __future__ import annotations

import argparse
import datetime
import glob
import io
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

CKPT_NAME = "checkpoint.pt"
N_SAMPLES = 4096
N_IN, N_OUT = 16, 4


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="total optimizer steps (default 200)")
    p.add_argument("--step-sleep", type=float, default=0.05, help="seconds to sleep per step (default 0.05)")
    p.add_argument("--ckpt-every", type=int, default=10, help="checkpoint every N steps (default 10)")
    p.add_argument(
        "--ckpt-dir",
        default=os.environ.get("RDZV_CKPT_DIR", "./checkpoints"),
        help="checkpoint directory (default: $RDZV_CKPT_DIR or ./checkpoints)",
    )
    p.add_argument("--batch-size", type=int, default=32, help="per-worker batch size (default 32)")
    p.add_argument("--log-every", type=int, default=10, help="print the loss every N steps (default 10)")
    p.add_argument("--lr", type=float, default=0.02)
    return p.parse_args()


def say(line: str) -> None:
    # one write per line: workers sharing a console never split each other's lines
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def make_dataset() -> TensorDataset:
    """The same data on every rank and every run: y = x W + small noise."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(N_SAMPLES, N_IN, generator=g)
    w = torch.randn(N_IN, N_OUT, generator=g)
    y = x @ w + 0.01 * torch.randn(N_SAMPLES, N_OUT, generator=g)
    return TensorDataset(x, y)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(N_IN, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, N_OUT))


def save_checkpoint(ckpt_dir: Path, state: dict) -> None:
    """Write ``state`` so that a kill at any instant leaves a whole checkpoint."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_dir / CKPT_NAME
    tmp = ckpt_dir / f".{CKPT_NAME}.{os.getpid()}.tmp"
    with open(tmp, "wb") as fp:
        torch.save(state, fp)
        fp.flush()
        os.fsync(fp.fileno())
    os.replace(tmp, final)
    dir_fd = os.open(ckpt_dir, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a power cut
    finally:
        os.close(dir_fd)


def load_checkpoint(ckpt_dir: Path) -> dict | None:
    # temp files of writers killed mid-write are garbage, never checkpoints
    for stale in glob.glob(str(ckpt_dir / f".{CKPT_NAME}.*.tmp")):
        try:
            os.unlink(stale)
        except OSError:
            pass
    path = ckpt_dir / CKPT_NAME
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)


def broadcast_checkpoint(ckpt: dict | None, device: torch.device) -> dict | None:
    """Send rank 0's checkpoint to every rank as bytes (no pickle of objects, no numpy)."""
    data = torch.empty(0, dtype=torch.uint8)
    if dist.get_rank() == 0 and ckpt is not None:
        buf = io.BytesIO()
        torch.save(ckpt, buf)
        data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    n = int(size.item())
    if n == 0:
        return None
    if dist.get_rank() != 0:
        data = torch.empty(n, dtype=torch.uint8)
    data = data.to(device)
    dist.broadcast(data, src=0)
    # .tolist() rather than .numpy(): numpy is optional for torch; the model is small
    raw = bytes(data.cpu().tolist())
    return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)


def main() -> None:
    args = parse_args()
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    ckpt_dir = Path(args.ckpt_dir)

    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    try:
        train(args, rank, world_size, local_rank, restart, ckpt_dir, device)
        dist.barrier()  # every rank is done before any rank tears its group down
    finally:
        dist.destroy_process_group()


def train(
    args: argparse.Namespace,
    rank: int,
    world_size: int,
    local_rank: int,
    restart: int,
    ckpt_dir: Path,
    device: torch.device,
) -> None:
    # Rank 0 reads the checkpoint and sends it to the others: nodes need not
    # share a file system, only rank 0's checkpoint directory matters.
    ckpt = broadcast_checkpoint(load_checkpoint(ckpt_dir) if rank == 0 else None, device)

    model = make_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    step, epoch, samples_into_epoch = 0, 0, 0
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        step, epoch, samples_into_epoch = ckpt["step"], ckpt["epoch"], ckpt["samples_into_epoch"]
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    say(f"started rank {rank}/{world_size} local_rank {local_rank} restart_count {restart} resumed_from_step {step}")

    dataset = make_dataset()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    loss_fn = nn.MSELoss()
    per_step = args.batch_size * world_size  # samples the whole job consumes per step

    def checkpoint() -> None:
        if rank == 0:
            save_checkpoint(
                ckpt_dir,
                {
                    "step": step,
                    "epoch": epoch,
                    "samples_into_epoch": samples_into_epoch,
                    "world_size": world_size,
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                },
            )

    while step < args.steps:
        sampler.set_epoch(epoch)
        # progress within an epoch is kept in samples, so a different world
        # size resumes at about the same place of the same epoch
        skip = samples_into_epoch // per_step
        for i, (x, y) in enumerate(loader):
            if i < skip:
                continue
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(ddp(x), y)
            loss.backward()
            optimizer.step()
            step += 1
            samples_into_epoch = (i + 1) * per_step
            if args.step_sleep > 0:
                time.sleep(args.step_sleep)
            if rank == 0 and step % args.log_every == 0:
                say(f"step {step} loss {loss.item():.4f} world_size {world_size} rank {rank} restart {restart}")
            if step % args.ckpt_every == 0:
                checkpoint()
            if step >= args.steps:
                break
        else:
            epoch += 1
            samples_into_epoch = 0
    checkpoint()
    if rank == 0:
        say(f"done step {step}")


if __name__ == "__main__":
    main()
    # Leave without the interpreter's finalization: under torch 2.13 a DDP script on gloo may
    # otherwise abort after a successful run (SIGABRT; why: docs/torchrun.md, "A DDP script
    # that aborts as it exits"). Nothing is left to run here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
