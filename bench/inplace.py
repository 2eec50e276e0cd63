"""In-place re-formation (issues 14 and 20) against process restarts and
torchrun, same run, same worker script (1 worker per node).

    python -m bench.inplace [--runs K] [--only KEYS] [--out FILE.json]

Three launchers per row, interleaved: ``in-place`` (rdzv-agent
``--restart-mode in-place``), ``process`` (rdzv-agent, the default mode) and
``torchrun`` (c10d, as bench/compare.py starts it). Two scripts, each under
all three: examples/train_inplace.py (the library's loop: a hand all-reduce
of the gradients) and examples/train_ddp_inplace.py (plain DDP through
``inplace.ddp``; rows ``ddp_*``). The clock stops, for the library's script,
at the ``synced`` line of every worker of the new world (its wall time right
after the round's first collectives: an all_reduce of the step, an
all_reduce of the source rank and the broadcast of the model and optimizer);
for the DDP script, at every worker's first DDP step in the new world (its
step line's ``t``). Process mode and torchrun include Python start-up,
``import torch`` and the new group.

Rows:

* node loss: 3 nodes (2:3) train; SIGKILL a node that is not group rank 0
  (torchrun: neither rank 0 nor its store host) -> both survivors synced in world 2.
* rank-0 loss: the node whose worker has rank 0 (rdzv: its worker hosts the
  round's store; torchrun: rank 0's node, which may host its c10d store).
* scale-up: 2 nodes (2:3) train; a third agent launched -> all 3 synced in world 3.
* hook (``--only hook``; no launcher): the cost per step of ``inplace.ddp``'s
  comm hook (the all-reduce on a future the round controls, the final
  callback that waits for it, the group's timing of that wait) against DDP's
  own all-reduce: 2 worker processes, gloo on loopback, a ~10M-parameter MLP
  on CPU (1 torch thread each), the kinds of DDP alternated on the same model
  so that load drifts hit all; torch's own Python ``allreduce_hook`` is the
  third (what any Python hook costs).
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
from .compare import Cluster, Outcome

LAUNCHERS = ("in-place", "process", "torchrun")
# rank: group 2, world: group 3, wall time: group 6 (the clock's stop)
SYNCED = re.compile(r"synced round (\d+) rank (\d+) world (\d+) step (\d+) fresh (\d) t (\S+)")
DDP_STEP = re.compile(r"step (\d+) rank (\d+) world (\d+) round (\d+) pid (\d+) sum \S+ t (\S+)")
STEP = re.compile(r"step (\d+) rank (\d+) world (\d+) round (\d+) pid (\d+) sum")
# script -> (the example, the line that stops the clock)
SCRIPTS = {
    "library": (C.ROOT / "examples" / "train_inplace.py", SYNCED),
    "ddp": (C.ROOT / "examples" / "train_ddp_inplace.py", DDP_STEP),
}


class InPlaceCluster(Cluster):
    def __init__(self, launcher: str, tmp: Path, name: str, script: str = "library") -> None:
        self.mode = launcher
        self.example, self.mark = SCRIPTS[script]
        super().__init__("torchrun" if launcher == "torchrun" else "rdzv", tmp, f"{name}-{launcher}")

    def start_node(self, nnodes: str) -> C.Proc:
        cmd = [sys.executable, "-u", str(self.example), "--steps", "100000", "--step-sleep", "0.02"]
        if self.mode == "in-place":
            cmd = ["--restart-mode", "in-place", *cmd]
        p = self.launch(nnodes, cmd, no_python=True)
        return p

    def synced(self, after: float) -> list[tuple[int, int, float, C.Proc]]:
        """(rank, world, t, agent) of every line that stops the clock after ``after``."""
        out = []
        for a in self.agents:
            for m in self.mark.finditer(a.text()):
                t = float(m.group(6))
                if t > after:
                    out.append((int(m.group(2)), int(m.group(3)), t, a))
        return out

    def owner_of_rank(self, rank: int, world: int) -> C.Proc | None:
        for a in self.agents:
            if any(int(m.group(2)) == rank and int(m.group(3)) == world for m in STEP.finditer(a.text())):
                return a
        return None


def _all_synced(cl: InPlaceCluster, world: int, after: float, bound: float) -> float | None:
    deadline = time.time() + bound
    while time.time() < deadline:
        by_rank: dict[int, float] = {}
        for rank, w, t, _ in cl.synced(after):
            if w == world:
                by_rank.setdefault(rank, t)
        if len(by_rank) == world:
            return max(by_rank.values())
        time.sleep(0.05)
    return None


def _form(cl: InPlaceCluster, n: int, bound: float) -> str | None:
    for _ in range(n):
        cl.start_node("2:3")
    if _all_synced(cl, n, 0.0, bound) is None:
        return f"setup: no world {n} in {bound:g} s"
    time.sleep(1.0)  # a few steps of steady training
    return None


def row_loss(cl: InPlaceCluster, victim_rank: int, bound: float) -> Outcome:
    bad = _form(cl, 3, 120)
    if bad:
        return Outcome(None, bad)
    host = cl.agents[0] if cl.mode == "torchrun" else None
    if victim_rank == 0:
        victim = cl.owner_of_rank(0, 3)
    else:
        victim = next((a for r in (2, 1) if (a := cl.owner_of_rank(r, 3)) is not None and a is not host), None)
    if victim is None:
        return Outcome(None, "could not find the victim")
    t_kill = time.time()
    C.kill_tree(victim.pid)
    t = _all_synced(cl, 2, t_kill, bound)
    if t is None:
        return Outcome(None, f"no world 2 in {bound:g} s")
    time.sleep(1.0)  # a few steps of the new world, for _kept
    kept = sum(1 for a in cl.agents if a is not victim and _kept(a))
    return Outcome(t - t_kill, info={"victim": victim.name, "kept_processes": kept})


def _kept(agent: C.Proc) -> bool:
    """The agent's worker printed steps in two rounds with one pid."""
    pids = {int(m.group(5)) for m in STEP.finditer(agent.text())}
    rounds = {int(m.group(4)) for m in STEP.finditer(agent.text())}
    return len(pids) == 1 and len(rounds) > 1


def row_scale_up(cl: InPlaceCluster, bound: float) -> Outcome:
    bad = _form(cl, 2, 120)
    if bad:
        return Outcome(None, bad)
    third = cl.start_node("2:3")
    t = _all_synced(cl, 3, third.launched_at, bound)
    if t is None:
        return Outcome(None, f"no world 3 in {bound:g} s")
    survivors = [ts for rank, w, ts, a in cl.synced(third.launched_at) if w == 3 and a is not third]
    return Outcome(
        t - third.launched_at,
        info={"survivors_synced_after_launch_s": max(survivors) - third.launched_at if survivors else None},
    )


_ROW_KINDS = [
    ("node_loss", "node loss (SIGKILL a non-rank-0 node of 3) -> survivors' first {what} in world 2",
     lambda cl: row_loss(cl, 2, 60)),
    ("rank0_loss", "rank-0 node loss (of 3) -> survivors' first {what} in world 2",
     lambda cl: row_loss(cl, 0, 60)),
    ("scale_up", "scale-up 2 -> 3: third agent launched -> first {what} with world 3",
     lambda cl: row_scale_up(cl, 60)),
]  # fmt: skip
# (key, title, script, measurement): the library's loop, then the same rows for plain DDP
ROWS = [(k, t.format(what="collectives"), "library", fn) for k, t, fn in _ROW_KINDS] + [
    (f"ddp_{k}", "plain DDP: " + t.format(what="DDP step"), "ddp", fn) for k, t, fn in _ROW_KINDS
]
HOOK = "hook"  # the row without launchers: inplace.ddp's hook against DDP's own all-reduce

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
    """One measurement of the hook row: 2 ranks, ``segments`` segments of each kind of DDP alternated."""
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


def hook_line(outs: list[dict[str, object]]) -> str:
    ok = [o for o in outs if "ratio" in o]
    if not ok:
        return "hook row: no result: " + "; ".join(str(o.get("error", ""))[-200:] for o in outs)

    def med(key: str) -> float:
        return statistics.median(float(o[key]) for o in ok)  # type: ignore[arg-type]

    ratios = [float(o["ratio"]) for o in ok]  # type: ignore[arg-type]
    return C.md_table(
        ["per DDP step (median of runs)", "DDP's own all-reduce", "inplace.ddp's hook", "torch's allreduce_hook",
         "hook / own"],
        [[f"{ok[0]['params']} parameters, 2 ranks, gloo, CPU", f"{med('ddp_own_s') * 1000:.1f} ms",
          f"{med('hook_s') * 1000:.1f} ms", f"{med('torch_hook_s') * 1000:.1f} ms",
          f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}, {len(ok)} runs)"]],
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--only", default="", help=f"comma-separated row keys ({', '.join(r[0] for r in ROWS)}, {HOOK})")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per segment (hook row)")
    ap.add_argument("--segments", type=int, default=3, help="segments of each kind, alternated (hook row)")
    args = ap.parse_args(argv)
    only = [k for k in args.only.split(",") if k]
    unknown = set(only) - {r[0] for r in ROWS} - {HOOK}
    if unknown:
        ap.error(f"--only: no row {', '.join(sorted(unknown))}")
    rows = [r for r in ROWS if not only or r[0] in only]
    results: dict[str, dict[str, list[Outcome]]] = {k: {name: [] for name in LAUNCHERS} for k, _, _, _ in rows}
    hooks: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="rdzv-bench-inplace-") as tmp:
        for run in range(args.runs):
            for key, _, script, fn in rows:
                order = list(LAUNCHERS) if run % 2 == 0 else list(reversed(LAUNCHERS))
                for launcher in order:
                    cl = InPlaceCluster(launcher, Path(tmp), key, script)
                    try:
                        out = fn(cl)
                    except Exception as e:  # one broken measurement must not stop the others
                        out = Outcome(None, f"error: {e!r}"[:200])
                    finally:
                        cl.close()
                    out.info["load"] = C.loadavg()
                    results[key][launcher].append(out)
                    shown = f"{out.value:.3f}" if out.value is not None else out.failure
                    print(f"[bench] run {run + 1} {key} {launcher}: {shown} {out.info}", file=sys.stderr, flush=True)
            if not only or HOOK in only:
                h = hook_cost(args.steps, args.segments)
                h["load"] = C.loadavg()
                hooks.append(h)
                print(f"[bench] run {run + 1} {HOOK}: {h}", file=sys.stderr, flush=True)
    body = []
    for key, title, _, _ in rows:
        cells = []
        for launcher in LAUNCHERS:
            vals = [o.value for o in results[key][launcher] if o.value is not None]
            fails = [o.failure for o in results[key][launcher] if o.value is None]
            text = f"{C.median(vals):.2f} s" + (f" ({min(vals):.2f}-{max(vals):.2f})" if len(vals) > 1 else "")
            cells.append((text if vals else "") + ("; " if vals and fails else "") + "; ".join(map(str, fails)))
        body.append([title, *cells])
    if body:
        print(C.md_table(["row (median of runs)", *LAUNCHERS], body))
    if hooks:
        print(("\n" if body else "") + hook_line(hooks))  # a table of its own
    if args.out:
        data: dict[str, object] = {k: {n: [vars(o) for o in v] for n, v in by.items()} for k, by in results.items()}
        if hooks:
            data[HOOK] = hooks
        args.out.write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
