"""In-place re-formation (issue 14) against process restarts and torchrun,
same run, same worker script (examples/train_inplace.py, 1 worker per node).

    python -m bench.inplace [--runs K] [--out FILE.json]

Three launchers per row, interleaved: ``in-place`` (rdzv-agent
``--restart-mode in-place``), ``process`` (rdzv-agent, the default mode) and
``torchrun`` (c10d, as bench/compare.py starts it). The clock stops at the
``synced`` line of every worker of the new world: its wall time right after
the round's first collectives (an all_reduce of the step, an all_reduce of the
source rank and the broadcast of the model and optimizer), so process mode and
torchrun include Python start-up, ``import torch`` and the new group.

Rows:

* node loss: 3 nodes (2:3) train; SIGKILL a node that is not group rank 0
  (torchrun: neither rank 0 nor its store host) -> both survivors synced in world 2.
* rank-0 loss: the node whose worker has rank 0 (rdzv: its worker hosts the
  round's store; torchrun: rank 0's node, which may host its c10d store).
* scale-up: 2 nodes (2:3) train; a third agent launched -> all 3 synced in world 3.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

from . import _common as C
from .compare import Cluster, Outcome

EXAMPLE = C.ROOT / "examples" / "train_inplace.py"
LAUNCHERS = ("in-place", "process", "torchrun")
SYNCED = re.compile(r"synced round (\d+) rank (\d+) world (\d+) step (\d+) fresh (\d) t (\S+)")
STEP = re.compile(r"step (\d+) rank (\d+) world (\d+) round (\d+) pid (\d+) sum")


class InPlaceCluster(Cluster):
    def __init__(self, launcher: str, tmp: Path, name: str) -> None:
        self.mode = launcher
        super().__init__("torchrun" if launcher == "torchrun" else "rdzv", tmp, f"{name}-{launcher}")

    def start_node(self, nnodes: str) -> C.Proc:
        cmd = [sys.executable, "-u", str(EXAMPLE), "--steps", "100000", "--step-sleep", "0.02"]
        if self.mode == "in-place":
            cmd = ["--restart-mode", "in-place", *cmd]
        p = self.launch(nnodes, cmd, no_python=True)
        return p

    def synced(self, after: float) -> list[tuple[int, int, float, C.Proc]]:
        """(rank, world, t, agent) of every synced line after ``after``."""
        out = []
        for a in self.agents:
            for m in SYNCED.finditer(a.text()):
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


ROWS = [
    ("node_loss", "node loss (SIGKILL a non-rank-0 node of 3) -> survivors' first collectives in world 2",
     lambda cl: row_loss(cl, 2, 60)),
    ("rank0_loss", "rank-0 node loss (of 3) -> survivors' first collectives in world 2",
     lambda cl: row_loss(cl, 0, 60)),
    ("scale_up", "scale-up 2 -> 3: third agent launched -> first collectives with world 3",
     lambda cl: row_scale_up(cl, 60)),
]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--only", default="", help="comma-separated row keys")
    args = ap.parse_args(argv)
    rows = [r for r in ROWS if not args.only or r[0] in args.only.split(",")]
    results: dict[str, dict[str, list[Outcome]]] = {k: {name: [] for name in LAUNCHERS} for k, _, _ in rows}
    with tempfile.TemporaryDirectory(prefix="rdzv-bench-inplace-") as tmp:
        for run in range(args.runs):
            for key, _, fn in rows:
                order = list(LAUNCHERS) if run % 2 == 0 else list(reversed(LAUNCHERS))
                for launcher in order:
                    cl = InPlaceCluster(launcher, Path(tmp), key)
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
    body = []
    for key, title, _ in rows:
        cells = []
        for launcher in LAUNCHERS:
            vals = [o.value for o in results[key][launcher] if o.value is not None]
            fails = [o.failure for o in results[key][launcher] if o.value is None]
            text = f"{C.median(vals):.2f} s" + (f" ({min(vals):.2f}-{max(vals):.2f})" if len(vals) > 1 else "")
            cells.append((text if vals else "") + ("; " if vals and fails else "") + "; ".join(map(str, fails)))
        body.append([title, *cells])
    print(C.md_table(["row (median of runs)", *LAUNCHERS], body))
    if args.out:
        args.out.write_text(
            json.dumps(
                {k: {n: [vars(o) for o in outs] for n, outs in by.items()} for k, by in results.items()}, indent=1
            )
        )


if __name__ == "__main__":
    main()
