"""Dump this worker's whole environment, and the result of an all_reduce, as JSON.

Writes ``OUT_DIR/env_rank{RANK}_restart{TORCHELASTIC_RESTART_COUNT}.json`` with
``{"env": {...}, "sum": S, "world": W, "rank": R}`` where S is the all_reduce
sum of every rank's ``rank + 1``.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist


def main() -> None:
    out_dir = sys.argv[1]
    env = dict(os.environ)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    path = os.path.join(out_dir, f"env_rank{env['RANK']}_restart{env['TORCHELASTIC_RESTART_COUNT']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"env": env, "sum": t.item(), "world": world, "rank": rank}, f)
    os.replace(path + ".tmp", path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
