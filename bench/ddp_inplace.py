"""Plain DDP in place (issue 20): two measurements, printed, never asserted.

    python -m bench.ddp_inplace [--runs K] [--steps N] [--only loss,hook]

* ``loss``: 3 rdzv-agents (2:3, ``--restart-mode in-place``) run
  examples/train_ddp_inplace.py; SIGKILL a node whose worker is not rank 0 ->
  seconds until both survivors printed their first DDP step in world 2 (the
  step line's wall time ``t``), and whether they kept their pids.
* ``hook``: the cost per step of ``inplace.ddp``'s comm hook (the all-reduce
  on a future the round controls, and the final callback that waits for it)
  against DDP's own all-reduce: 2 worker processes, gloo on loopback, a
  ~10M-parameter MLP on CPU (1 torch thread each), the two kinds of DDP
  alternated on the same model so that load drifts hit all; torch's own
  Python ``allreduce_hook`` is the third (what any Python hook costs).
"""

from __future__ import annotations

import argparse
import json
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

EXAMPLE = C.ROOT / "examples" / "train_ddp_inplace.py"
STEP = re.compile(r"step (\d+) rank (\d+) world (\d+) round (\d+) pid (\d+) sum \S+ t (\S+)")


def _steps(agent: C.Proc) -> list[tuple[int, int, int, int, int, float]]:
    return [(int(a), int(b), int(c), int(d), int(e), float(f)) for a, b, c, d, e, f in STEP.findall(agent.text())]


def node_loss(tmp: Path) -> dict[str, object]:
    cl = Cluster("rdzv", tmp, "ddp-loss")
    try:
        cmd = [sys.executable, "-u", str(EXAMPLE), "--steps", "100000", "--step-sleep", "0.02"]
        agents = [cl.launch("2:3", cmd, no_python=True, rdzv_flags=("--restart-mode", "in-place")) for _ in range(3)]
        if not C.wait_until(lambda: all(any(s[2] == 3 for s in _steps(a)) for a in agents), 120):
            return {"error": "no world 3 in 120 s"}
        time.sleep(1.0)  # steady training
        victim = next(a for a in agents if not any(s[1] == 0 for s in _steps(a)))
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
        time.sleep(0.5)
        kept = all({s[4] for s in _steps(a)} == before[a.name] for a in survivors)
        return {"first_step_world2_s": max(firsts) - t_kill, "kept_pids": kept}
    finally:
        cl.close()


WORKER = r"""
import os, statistics, sys, time
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from rdzv_client import inplace
from rdzv_client.worker import World

rank, steps, ports = int(sys.argv[1]), int(sys.argv[2]), [int(p) for p in sys.argv[3:]]
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024), nn.ReLU(), nn.Linear(1024, 1024))
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
x = torch.randn(16, 1024)
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
KINDS = ("ddp", "hook", "torch_hook")
times = {k: [] for k in KINDS}
for i, port in enumerate(ports):
    kind = KINDS[i % 3]
    world = World(round=i, rank=rank, world_size=2, local_rank=0, local_world_size=1, group_rank=rank,
                  group_world_size=2, master_addr="127.0.0.1", master_port=port, fresh=False)
    pg = inplace.process_group(world)
    ddp = inplace.ddp(model, pg) if kind == "hook" else DistributedDataParallel(model, process_group=pg)
    if kind == "torch_hook":  # torch's own Python hook (allreduce + .then): what any Python hook costs
        ddp.register_comm_hook(pg, allreduce_hook)
    for s in range(steps + 3):
        t0 = time.perf_counter()
        opt.zero_grad()
        ddp(x).sum().backward()
        opt.step()
        if s >= 3:  # after DDP's bucket rebuild
            times[kind].append(time.perf_counter() - t0)
    if kind != "hook":
        ddp._remove_autograd_hooks()
    del ddp
if rank == 0:
    n = sum(p.numel() for p in model.parameters())
    print("RESULT", n, *(statistics.median(times[k]) for k in KINDS), flush=True)
inplace.exit(0)
"""


def hook_cost(steps: int, segments: int) -> dict[str, object]:
    ports = [str(C.free_port()) for _ in range(3 * segments)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RDZV_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = str(C.ROOT)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(r), str(steps), *ports],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
    line = next((ln for ln in outs[0][0].splitlines() if ln.startswith("RESULT")), None)
    if line is None:
        return {"error": (outs[0][1] or outs[1][1])[-500:]}
    _, n, own, hook, torch_hook = line.split()
    return {
        "params": int(n),
        "ddp_own_s": float(own),
        "hook_s": float(hook),
        "torch_hook_s": float(torch_hook),
        "ratio": float(hook) / float(own),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per segment (hook row)")
    ap.add_argument("--segments", type=int, default=3, help="segments of each kind, alternated (hook row)")
    ap.add_argument("--only", default="loss,hook")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = args.only.split(",")
    results: dict[str, list[dict[str, object]]] = {r: [] for r in rows}
    with tempfile.TemporaryDirectory(prefix="rdzv-bench-ddp-") as tmp:
        for run in range(args.runs):
            for row in rows:
                out = node_loss(Path(tmp)) if row == "loss" else hook_cost(args.steps, args.segments)
                out["load"] = C.loadavg()
                results[row].append(out)
                print(f"[bench] run {run + 1} {row}: {out}", file=sys.stderr, flush=True)
    if "loss" in results:
        vals = [float(o["first_step_world2_s"]) for o in results["loss"] if "first_step_world2_s" in o]  # type: ignore[arg-type]
        kept = all(o.get("kept_pids") for o in results["loss"])
        if vals:
            print(f"node loss -> first DDP step in world 2: median {statistics.median(vals):.3f} s "
                  f"({min(vals):.3f}-{max(vals):.3f}, {len(vals)} runs), survivors kept pids: {kept}")  # fmt: skip
    if "hook" in results:
        ok = [o for o in results["hook"] if "ratio" in o]
        if ok:
            own = statistics.median(float(o["ddp_own_s"]) for o in ok)  # type: ignore[arg-type]
            hook = statistics.median(float(o["hook_s"]) for o in ok)  # type: ignore[arg-type]
            ratios = [float(o["ratio"]) for o in ok]  # type: ignore[arg-type]
            th = statistics.median(float(o["torch_hook_s"]) for o in ok)  # type: ignore[arg-type]
            print(f"step with DDP's own all-reduce {own * 1000:.1f} ms, with inplace.ddp's hook {hook * 1000:.1f} ms, "
                  f"with torch's allreduce_hook {th * 1000:.1f} ms "
                  f"({ok[0]['params']} parameters): hook/own {statistics.median(ratios):.3f} "
                  f"({min(ratios):.3f}-{max(ratios):.3f}, {len(ok)} runs)")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
