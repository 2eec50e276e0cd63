"""rdzv_client.inplace_accelerate (issue 20): an ``InPlaceAccelerator`` made
once per round sets accelerate's state up again from the round's group, its
``prepare`` takes an earlier round's prepared objects back to what they wrap
(no DDP of a DDP, no autocast of an autocast, the dataloader re-sharded), the
DDP under it is rdzv's, ``sync_state`` brings every rank to the most advanced
one's models, optimizers and schedulers, and what it refuses it refuses before
anything is set up. accelerate keeps its state per process, so each rank is a
process of its own (gloo on loopback)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[2]

RANK = r"""
import os, sys
os.environ["RDZV_AGENT_PID"] = str(os.getpid())  # this process plays its own agent (before the import)
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from accelerate.state import AcceleratorState
from accelerate.utils import DataLoaderConfiguration, DistributedDataParallelKwargs
from rdzv_client import inplace
from rdzv_client.inplace import _DDP
from rdzv_client.inplace_accelerate import InPlaceAccelerator
from rdzv_client.inplace_backend import ddp_group
from rdzv_client.worker import MembershipChanged, World

rank, port0, port1 = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])

def world(rnd, rank, size, port):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return World(round=rnd, rank=rank, world_size=size, local_rank=0, local_world_size=1, group_rank=rank,
                 group_world_size=size, master_addr="127.0.0.1", master_port=port, fresh=False)

def checksum(m):
    return sum(float(p.detach().double().sum()) for p in m.parameters())

torch.manual_seed(rank)  # different weights on each rank: sync_state must make them rank 1's
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
module = model
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
inner_opt = opt
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
dl = DataLoader(TensorDataset(torch.arange(64.0).reshape(64, 1)), batch_size=4, shuffle=True)
dataset_dl = dl

# ---- round 0: world 2
w0 = world(0, rank, 2, port0)
pg = inplace.process_group(w0, timeout_s=20)
try:
    InPlaceAccelerator(pg, cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(comm_hook="fp16")])
    raise AssertionError("a user comm hook was taken")
except ValueError as e:
    assert "comm_hook" in str(e), e
try:
    InPlaceAccelerator(object(), cpu=True)
    raise AssertionError("a group not from inplace was taken")
except ValueError as e:
    assert "inplace.process_group" in str(e), e
if not torch.cuda.is_available():
    try:
        InPlaceAccelerator(pg)  # no cpu=True, no GPU: accelerate sets up no distributed training
        raise AssertionError("a non-distributed set-up was taken")
    except ValueError as e:
        assert "gloo on CPU only" in str(e), e
    assert AcceleratorState._shared_state == {}, "a refused accelerator left accelerate's state set up"
try:
    InPlaceAccelerator(inplace._Over("round 1 replaces round 0"), cpu=True)
    raise AssertionError("a round over was not raised")
except MembershipChanged as e:
    assert str(e) == "round 1 replaces round 0"

try:
    InPlaceAccelerator(pg, cpu=True, rng_types=["cuda"])
    raise AssertionError("a CUDA random state was taken")
except ValueError as e:
    assert "rng_types" in str(e), e
try:
    InPlaceAccelerator(pg, cpu=True, dynamo_backend="inductor")
    raise AssertionError("torch.compile was taken")
except ValueError as e:
    assert "torch.compile" in str(e), e
assert AcceleratorState._shared_state == {}, "a refused accelerator left accelerate's state set up"
acc = InPlaceAccelerator(pg, cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
try:
    acc.prepare(dl)
    raise AssertionError("dispatch_batches was taken")
except ValueError as e:
    assert "dispatch_batches" in str(e) and acc._dataloaders == [], e

acc = InPlaceAccelerator(pg, cpu=True, mixed_precision="bf16")
assert (acc.num_processes, acc.process_index) == (2, rank)
model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
assert type(model) is _DDP and model.module is module, type(model)
assert model.process_group is ddp_group(pg)  # gloo: the round's interruptible group
assert len(dl) == 8, len(dl)  # 16 batches over 2 ranks
# the shuffle is the same on both ranks (rank 0's generator state, sent by the library's broadcast):
# the two shards make the whole dataset, each sample once
torch.manual_seed(100 + rank)
mine = torch.cat([b[0].flatten() for b in dl])
every = acc.gather(mine)
assert sorted(every.tolist()) == [float(i) for i in range(64)], every.tolist()
opt.zero_grad()
acc.backward(model(torch.randn(4, 8)).float().pow(2).mean())
opt.step()
sched.step()
if rank == 1:  # rank 1 is ahead (as if it took 2 steps more): other weights, its scheduler further on
    with torch.no_grad():
        module[0].weight.add_(1.0)
    sched.step()
    sched.step()
acc.wait_for_everyone()
step = acc.sync_state(w0, 1 + 2 * rank)
assert step == 3, step
sums = acc.gather(torch.tensor([checksum(module), float(sched.scheduler.last_epoch),
                                float(opt.optimizer.param_groups[0]["lr"])], dtype=torch.float64))
assert sums[0].item() == sums[3].item() and sums[1:3].tolist() == sums[4:6].tolist(), sums
assert sched.scheduler.last_epoch == 6, sched.scheduler.last_epoch  # rank 1's: 3 steps x 2 processes

if rank == 0:  # rank 0 leaves: rank 1 finds it gone in accelerate's collectives
    print("ok", flush=True)
    os._exit(0)
for what, call in (("the epoch's random-state broadcast", lambda: next(iter(dl))),
                   ("gather", lambda: acc.gather(torch.ones(1)))):
    try:
        call()
        raise AssertionError(f"{what} went through without rank 0")
    except MembershipChanged as e:
        assert "a collective failed" in str(e), e

# ---- round 1: world 1, the same process (rank 0 now) and objects
w1 = world(1, 0, 1, port1)
pg1 = inplace.process_group(w1, timeout_s=20)
acc = InPlaceAccelerator(pg1, cpu=True, mixed_precision="bf16")
assert acc.num_processes == 1
model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
assert type(model) is _DDP and model.module is module and model.process_group is ddp_group(pg1)
assert opt.optimizer is inner_opt and sched.scheduler.optimizer is inner_opt
assert len(dl) == 16 and dl.dataset is dataset_dl.dataset, len(dl)
# accelerate's autocast wraps the module's own forward once, not the last round's wrapper
assert module._original_forward.__func__ is nn.Sequential.forward, module._original_forward
assert acc.sync_state(w1, step) == 3
before = checksum(module)
opt.zero_grad()
acc.backward(model(torch.randn(4, 8)).float().pow(2).mean())
opt.step()
assert checksum(module) != before
print("ok", flush=True)
os._exit(0)  # as inplace.exit: abandoned groups are not torn down
"""


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port: int = s.getsockname()[1]
    s.close()
    return port


def test_an_accelerator_per_round_reprepares_the_same_objects_and_syncs_their_state(tmp_path: Path) -> None:
    """Round 0, world 2: refusals (a comm hook, a foreign group, no
    distributed set-up, a CUDA random state, torch.compile,
    dispatch_batches) leave nothing set up; ``prepare`` gives
    rdzv's DDP, a dataloader sharded in two with one shuffle on both ranks;
    ``sync_state`` brings rank 0 to rank 1's weights, optimizer and
    scheduler. Rank 0 leaves: rank 1's next epoch start and ``gather`` raise
    MembershipChanged. Round 1, world 1, the same process: ``prepare`` of
    round 0's prepared objects wraps the same module, optimizer and dataset
    again (once), sharded for one rank, and it trains."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RDZV_", "TORCHELASTIC_", "ACCELERATE_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", RDZV_RESTART_MODE="in-place", TORCHELASTIC_RESTART_COUNT="0")
    ports = [str(_free_port()), str(_free_port())]
    agents = []  # each rank's agent end of the worker channel (in-place mode: it takes "parked")
    for r in range(2):
        (tmp_path / f"r{r}").mkdir()
        agents.append(socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM))
        agents[-1].bind(str(tmp_path / f"r{r}" / "sock"))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(r), *ports],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**env, "RDZV_AGENT_SOCKET": str(tmp_path / f"r{r}" / "sock")},
        )
        for r in range(2)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=110)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for a in agents:
            a.close()
    told = "\n".join(f"rank {r} (exit {p.returncode}):\n{out[-3000:]}" for r, (p, out) in enumerate(zip(procs, outs)))
    assert all(p.returncode == 0 and out.strip().endswith("ok") for p, out in zip(procs, outs, strict=True)), told
