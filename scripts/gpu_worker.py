"""Worker of scripts/gpu-check, started by rdzv-agent with torchrun's environment.

    gpu_worker.py --out DIR --mode env|allreduce|train [--seconds S] [--backend nccl|gloo]

env        records what the agent gave this worker (ranks, sizes, visible GPUs); no collective
allreduce  one all_reduce of a 4 MiB tensor on cuda:LOCAL_RANK (nccl) and checks the sum
train      all_reduce in a loop for S seconds (the node-loss drill); "started" once the
           first one is through, "done" at the end
lag        the train loop, but the last local rank computes 0.3 s a step (a host-side straggler,
           lock-stepped by the all_reduce): the agent's NCCL RAS readings should name it;
           at the end each rank writes its Flight Recorder JSON dump (needs
           TORCH_FR_BUFFER_SIZE) to DIR/fr-rank<RANK>.json
inplace    the same loop per round, in place (rdzv-agent --restart-mode in-place): the
           round's group from rdzv_client.inplace.process_group(world, backend=...),
           "first" once the round's first all_reduce is through (with its time and the
           pid), "done" when a round trained S seconds (the job ends)

Each worker writes DIR/<mode>-round<R>-rank<RANK>.json (R = TORCHELASTIC_RESTART_COUNT, the
round) and exits 0, or exits 1 with the reason on stderr. --backend gloo runs the same on
CPU (gpu-check --rehearse-on-cpu).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def write(out: Path, name: str, record: dict) -> None:
    path = out / name
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--mode", choices=["env", "allreduce", "train", "lag", "inplace"], required=True)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    args = p.parse_args()
    env = {
        k: os.environ.get(k)
        for k in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "GROUP_WORLD_SIZE",
            "TORCHELASTIC_RESTART_COUNT",
            "CUDA_VISIBLE_DEVICES",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING",
            "TORCH_NCCL_RETHROW_CUDA_ERRORS",
        )
    }
    rank, local_rank = int(env["RANK"]), int(env["LOCAL_RANK"])
    world = int(env["WORLD_SIZE"])
    tag = f"{args.mode}-round{env['TORCHELASTIC_RESTART_COUNT']}-rank{rank}"
    record: dict = {"env": env, "pid": os.getpid()}

    import torch
    import torch.distributed as dist

    if args.backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        props = torch.cuda.get_device_properties(local_rank)
        record["gpu"] = {
            "name": props.name,
            "uuid": str(getattr(props, "uuid", "")),
            "visible": torch.cuda.device_count(),
        }
    else:
        device = torch.device("cpu")
    if args.mode == "env":
        write(args.out, tag + ".json", record)
        return 0

    if args.mode == "inplace":
        return in_place(args, record, device)
    dist.init_process_group(args.backend)
    expected = world * (world + 1) / 2
    started = time.monotonic()
    steps = 0
    slow = args.mode == "lag" and local_rank == int(env["LOCAL_WORLD_SIZE"]) - 1
    try:
        while True:
            if slow:
                time.sleep(0.25)  # with the loop's 0.05: this rank's step computes 0.3 s, its peers' 0.05 s
            t = torch.full((1 << 20,), float(rank + 1), device=device)
            dist.all_reduce(t)
            if args.backend == "nccl":
                torch.cuda.synchronize(device)
            lo, hi = t.min().item(), t.max().item()
            if lo != expected or hi != expected:
                print(f"gpu_worker rank {rank}: all_reduce gave {lo}..{hi}, expected {expected}", file=sys.stderr)
                return 1
            steps += 1
            if steps == 1 and args.mode in ("train", "lag"):
                write(args.out, tag + "-started.json", record)
            if args.mode == "allreduce" or time.monotonic() - started >= args.seconds:
                break
            time.sleep(0.05)
        dist.barrier()
        if args.mode == "lag" and args.backend == "nccl":
            from torch._C._distributed_c10d import _dump_nccl_trace_json

            (args.out / f"fr-rank{rank}.json").write_bytes(_dump_nccl_trace_json(True, True))
    finally:
        dist.destroy_process_group()
    record.update(steps=steps, sum=expected, seconds=round(time.monotonic() - started, 2))
    write(args.out, tag + ("-done.json" if args.mode in ("train", "lag") else ".json"), record)
    return 0


def in_place(args: argparse.Namespace, record: dict, device) -> int:
    """The in-place drill's worker: per round a fresh group (NCCL's communicator is
    aborted when the round ends), all_reduce in a loop; the process stays."""
    import torch

    from rdzv_client import inplace, worker

    for world in worker.rounds():
        with inplace.group(world, backend=args.backend) as pg:
            expected = world.world_size * (world.world_size + 1) / 2
            tag = f"inplace-round{world.round}-rank{world.rank}"
            started, steps = time.monotonic(), 0
            while time.monotonic() - started < args.seconds:
                t = torch.full((1 << 20,), float(world.rank + 1), device=device)
                if args.backend == "nccl":
                    try:
                        pg.allreduce([t]).wait()
                        torch.cuda.synchronize(device)
                    except RuntimeError as e:  # a lost peer; the abort comes before the next round
                        raise worker.MembershipChanged(f"a collective failed: {e}") from e
                else:
                    inplace.all_reduce(t, pg)
                worker.check()  # the agent's word first: an aborted all_reduce's sum means nothing
                lo, hi = t.min().item(), t.max().item()
                if lo != expected or hi != expected:
                    print(
                        f"gpu_worker rank {world.rank}: all_reduce gave {lo}..{hi}, expected {expected}",
                        file=sys.stderr,
                    )
                    inplace.exit(1)
                steps += 1
                if steps == 1:
                    write(
                        args.out,
                        tag + "-first.json",
                        {**record, "world": world.world_size, "round": world.round, "t": time.time()},
                    )
                worker.progress(steps)
                time.sleep(0.05)
            write(args.out, tag + "-done.json", {**record, "world": world.world_size, "steps": steps})
    inplace.exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
