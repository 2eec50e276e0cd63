"""FSDP2 in place (issue 20): measurements, printed, never asserted.

    python -m bench.fsdp_inplace [--runs K] [--only loss,loss0,cost]

* ``loss`` / ``loss0``: 3 rdzv-agents (2:3, ``--restart-mode in-place``) run
  examples/train_fsdp_inplace.py (``--save-every 10``); SIGKILL a node whose
  worker is not rank 0 (``loss``) or rank 0's (``loss0``) -> seconds until
  both survivors printed their first FSDP2 step in world 2 (the step line's
  wall time ``t``), the steps they went back (last step before the kill minus
  the save they resumed from), whether they kept their pids.
* ``cost``: the cost per step of FSDP2 on the interruptible group
  (``inplace_fsdp.mesh``: rdzv's Work per collective, a waiter thread per
  gloo reduce-scatter) against FSDP2 on the round's plain gloo group: 2
  worker processes, gloo on loopback, a ~10M-parameter MLP (each Linear
  sharded) on CPU, 1 torch thread each, the two alternated so that load
  drifts hit both.
* ``memory``: 21 rounds in one process (2 worker processes, each round a
  new group, a fresh 1M-parameter FSDP2 model with AdamW, two steps and a
  forward whose backward never comes, then the round's end): the resident
  memory a round leaves behind (after 5 rounds of warm-up).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import _common as C
from .compare import Cluster

EXAMPLE = C.ROOT / "examples" / "train_fsdp_inplace.py"
STEP = re.compile(r"step (\d+) rank (\d+) world (\d+) round (\d+) pid (\d+) sum \S+ t (\S+)")
RESUMED = re.compile(r"resumed (\d+) rank (\d+) world (\d+) round (\d+) pid (\d+)")


def _steps(agent: C.Proc) -> list[tuple[int, int, int, int, int, float]]:
    return [(int(a), int(b), int(c), int(d), int(e), float(f)) for a, b, c, d, e, f in STEP.findall(agent.text())]


def node_loss(tmp: Path, rank0: bool) -> dict[str, object]:
    cl = Cluster("rdzv", tmp, "fsdp-loss")
    try:
        ckpt = cl.dir / "ckpt"
        cmd = [sys.executable, "-u", str(EXAMPLE), "--steps", "100000", "--step-sleep", "0.02", "--ckpt", str(ckpt)]
        agents = [cl.launch("2:3", cmd, no_python=True, rdzv_flags=("--restart-mode", "in-place")) for _ in range(3)]
        if not C.wait_until(lambda: all(any(s[2] == 3 and s[0] > 15 for s in _steps(a)) for a in agents), 120):
            return {"error": "no world 3 past a save in 120 s"}
        victim = next(a for a in agents if any(s[1] == 0 for s in _steps(a)) == rank0)
        survivors = [a for a in agents if a is not victim]
        before = {a.name: {s[4] for s in _steps(a)} for a in survivors}
        t_kill = time.time()
        C.kill_tree(victim.pid)

        def first_in_world2() -> list[float] | None:
            firsts = [min((s[5] for s in _steps(a) if s[2] == 2 and s[5] > t_kill), default=None) for a in survivors]
            return None if None in firsts else firsts  # type: ignore[return-value]

        firsts = C.wait_until(first_in_world2, 60)
        if not firsts:
            return {"error": "no world 2 in 60 s"}
        time.sleep(0.3)
        last = max(s[0] for a in survivors for s in _steps(a) if s[2] == 3)
        resumed = [int(m[0]) for a in survivors for m in RESUMED.findall(a.text()) if m[2] == "2"]
        kept = all({s[4] for s in _steps(a)} == before[a.name] for a in survivors)
        return {
            "first_step_world2_s": max(firsts) - t_kill,
            "went_back": last - min(resumed) if resumed else None,
            "kept_pids": kept,
        }
    finally:
        cl.close()


WORKER = r"""
import statistics, sys, time
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from rdzv_client import inplace, inplace_fsdp
from rdzv_client.worker import World

rank, steps, ports = int(sys.argv[1]), int(sys.argv[2]), [int(p) for p in sys.argv[3:]]
torch.set_num_threads(1)
KINDS = ("plain", "interruptible")
times = {k: [] for k in KINDS}
x = torch.randn(16, 1024)
for i, port in enumerate(ports):
    kind = KINDS[i % 2]
    world = World(round=i, rank=rank, world_size=2, local_rank=0, local_world_size=1, group_rank=rank,
                  group_world_size=2, master_addr="127.0.0.1", master_port=port, fresh=False)
    pg = inplace.process_group(world)
    if kind == "plain":
        dist.distributed_c10d._register_process_group(pg.group_name, pg)  # for DTensor's name lookups
        mesh = DeviceMesh.from_group(pg, "cpu", mesh_dim_names=(f"plain{i}",))
    else:
        mesh = inplace_fsdp.mesh(pg)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024), nn.ReLU(), nn.Linear(1024, 1024))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    for s in range(steps + 2):
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        if s >= 2:
            times[kind].append(time.perf_counter() - t0)
if rank == 0:
    n = sum(p.numel() for p in model.parameters())
    print("RESULT", n, *(statistics.median(times[k]) for k in KINDS), flush=True)
inplace.exit(0)
"""


def step_cost(steps: int, segments: int) -> dict[str, object]:
    out, err = _two_workers(WORKER, [str(steps), *(str(C.free_port()) for _ in range(2 * segments))])
    line = next((ln for ln in out.splitlines() if ln.startswith("RESULT")), None)
    if line is None:
        return {"error": err[-500:]}
    _, n, plain, interruptible = line.split()
    return {
        "params": int(n),
        "plain_s": float(plain),
        "interruptible_s": float(interruptible),
        "ratio": float(interruptible) / float(plain),
    }


MEMORY = r"""
import ctypes, gc, os, sys
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from rdzv_client import inplace, inplace_fsdp
from rdzv_client.worker import World

rank, ports = int(sys.argv[1]), [int(p) for p in sys.argv[2:]]
torch.set_num_threads(1)

def rss_mb():
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what malloc caches is not what is kept
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

marks = []
x = torch.randn(4, 1000)
for i, port in enumerate(ports):
    world = World(round=i, rank=rank, world_size=2, local_rank=0, local_world_size=1, group_rank=rank,
                  group_world_size=2, master_addr="127.0.0.1", master_port=port, fresh=False)
    mesh = inplace_fsdp.mesh(inplace.process_group(world))
    model = nn.Sequential(nn.Linear(1000, 1000), nn.ReLU(), nn.Linear(1000, 10))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        opt.zero_grad(); model(x).sum().backward(); opt.step()
    loss = model(x).sum()  # a round cut short between forward and backward
    del model, opt, loss, mesh
    inplace._end_rounds("the round is over")
    marks.append(rss_mb())
if rank == 0:
    print("RESULT", marks[5], marks[-1], (marks[-1] - marks[5]) / (len(marks) - 6), flush=True)
inplace.exit(0)
"""


def _two_workers(code: str, args: list[str], timeout: float = 600) -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RDZV_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = str(C.ROOT)
    env["MALLOC_ARENA_MAX"] = "1"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(r), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        return "", f"timed out after {timeout:g} s (a port taken by another process meanwhile?)"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
    return outs[0][0], outs[0][1] or outs[1][1]


def memory(rounds: int = 21) -> dict[str, object]:
    out, err = _two_workers(MEMORY, [str(C.free_port()) for _ in range(rounds)], timeout=120)
    line = next((ln for ln in out.splitlines() if ln.startswith("RESULT")), None)
    if line is None:
        return {"error": err[-500:]}
    _, at5, last, per_round = line.split()
    return {"rss_round5_mb": float(at5), "rss_last_mb": float(last), "per_round_mb": float(per_round)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per segment (cost row)")
    ap.add_argument("--segments", type=int, default=3, help="segments of each kind, alternated (cost row)")
    ap.add_argument("--only", default="loss,loss0,cost,memory")
    args = ap.parse_args(argv)
    rows = args.only.split(",")
    results: dict[str, list[dict[str, object]]] = {r: [] for r in rows}
    with tempfile.TemporaryDirectory(prefix="rdzv-bench-fsdp-") as tmp:
        for run in range(args.runs):
            for row in rows:
                if row == "cost":
                    out = step_cost(args.steps, args.segments)
                elif row == "memory":
                    out = memory()
                else:
                    out = node_loss(Path(tmp), rank0=row == "loss0")
                out["load"] = C.loadavg()
                results[row].append(out)
                print(f"[bench] run {run + 1} {row}: {out}", file=sys.stderr, flush=True)
    for row in ("loss", "loss0"):
        ok = [o for o in results.get(row, []) if "first_step_world2_s" in o]
        if ok:
            vals = [float(o["first_step_world2_s"]) for o in ok]  # type: ignore[arg-type]
            back = [o["went_back"] for o in ok]
            kept = all(o.get("kept_pids") for o in ok)
            who = "rank 0's node" if row == "loss0" else "a node not rank 0's"
            print(f"SIGKILL of {who} -> first FSDP2 step in world 2: median {statistics.median(vals):.3f} s "
                  f"({min(vals):.3f}-{max(vals):.3f}, {len(vals)} runs), steps gone back {back}, "
                  f"survivors kept pids: {kept}")  # fmt: skip
    ok = [o for o in results.get("cost", []) if "ratio" in o]
    if ok:
        plain = statistics.median(float(o["plain_s"]) for o in ok)  # type: ignore[arg-type]
        intr = statistics.median(float(o["interruptible_s"]) for o in ok)  # type: ignore[arg-type]
        ratios = [float(o["ratio"]) for o in ok]  # type: ignore[arg-type]
        print(f"FSDP2 step on the plain gloo group {plain * 1000:.1f} ms, on the interruptible group "
              f"{intr * 1000:.1f} ms ({ok[0]['params']} parameters): ratio {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f}, {len(ok)} runs)")  # fmt: skip
    ok = [o for o in results.get("memory", []) if "per_round_mb" in o]
    if ok:
        per = [float(o["per_round_mb"]) for o in ok]  # type: ignore[arg-type]
        print(f"20 round changes in one process (1M-parameter FSDP2 model, AdamW): {statistics.median(per):.2f} "
              f"MB a round stays ({min(per):.2f}-{max(per):.2f}, {len(ok)} runs)")  # fmt: skip


if __name__ == "__main__":
    main()
