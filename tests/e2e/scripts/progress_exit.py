"""No collectives: every rank calls progress() each step; local rank 0 leaves
early with ``os._exit(0)`` (no atexit, so no ``finished()``), the others keep
stepping for ``--seconds``. A worker that has exited must not be called hung."""

from __future__ import annotations

import argparse
import os
import time

from rdzv_client.worker import progress

p = argparse.ArgumentParser()
p.add_argument("--seconds", type=float, default=10.0)
args = p.parse_args()
local_rank = int(os.environ["LOCAL_RANK"])
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
step = 0
end = time.monotonic() + args.seconds
while time.monotonic() < end:
    step += 1
    progress(step)
    if local_rank == 0 and step == 3:
        print(f"leaving early restart {restart}", flush=True)
        os._exit(0)
    time.sleep(0.1)
print(f"done local rank {local_rank} restart {restart}", flush=True)
