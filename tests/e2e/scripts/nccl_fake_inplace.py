"""An in-place worker with a fake NCCL communicator (no GPU needed): each round
it tracks one with rdzv_client.inplace_nccl, as process_group(backend="nccl")
does, and waits for the agent's word. With FAKE_STICKY_CUDA_ERROR=1 in its first
round, the device check after the abort fails as a sticky CUDA error does. A
round >= 1 ends the job after 1 s."""

from __future__ import annotations

import os
import time

from rdzv_client import inplace, inplace_nccl, worker

first_round = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
sticky = os.environ.get("FAKE_STICKY_CUDA_ERROR") == "1" and first_round == "0"


def say(line: str) -> None:
    print(line, flush=True)


class FakeCommunicator:
    def __init__(self, round_no: int) -> None:
        self.round = round_no

    def abort(self) -> None:
        say(f"abort round {self.round} pid {os.getpid()}")


def synchronize() -> None:
    if sticky:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    say(f"synchronized pid {os.getpid()}")


inplace_nccl._rounds = inplace_nccl.Rounds(synchronize=synchronize)
for world in worker.rounds():
    say(f"round {world.round} rank {world.rank} world {world.world_size} pid {os.getpid()}")
    inplace_nccl.track(FakeCommunicator(world.round))
    started = time.monotonic()
    try:
        while world.round == 0 or time.monotonic() - started < 1.0:
            worker.progress()
            time.sleep(0.05)
    except worker.MembershipChanged:
        continue
    break
inplace.exit(0)
