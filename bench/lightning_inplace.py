"""PyTorch Lightning in place (issue 20): node loss -> first Lightning step in world 2. Printed, never asserted.

    python -m bench.lightning_inplace [--runs K] [--victim other|rank0]

3 rdzv-agents (2:3, ``--restart-mode in-place``) run
examples/train_lightning_inplace.py (``Trainer.fit`` with
``strategy=InPlaceDDPStrategy()``); SIGKILL a node (``other``: one whose worker
is not rank 0; ``rank0``: the one that hosts the round's store and is the
broadcast source) -> seconds until both survivors printed their first step in
world 2 (the step line's wall time ``t``: after the new group, the broadcast
of the most advanced rank's checkpoint, Lightning's restore, dataloader and
DDP set-up), and whether they kept their pids.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from . import _common as C
from .compare import Cluster

EXAMPLE = C.ROOT / "examples" / "train_lightning_inplace.py"
STEP = re.compile(r"step (\d+) rank (\d+) world (\d+) round (\d+) pid (\d+) sum \S+ t (\S+)")


def _steps(agent: C.Proc) -> list[tuple[int, int, int, int, int, float]]:
    return [(int(a), int(b), int(c), int(d), int(e), float(f)) for a, b, c, d, e, f in STEP.findall(agent.text())]


def node_loss(tmp: Path, victim_kind: str, example: Path = EXAMPLE) -> dict[str, object]:
    """One run; ``example`` prints the same step lines (bench/accelerate_inplace.py runs its own)."""
    cl = Cluster("rdzv", tmp, "lit-loss")
    try:
        cmd = [sys.executable, "-u", str(example), "--steps", "100000", "--step-sleep", "0.02"]
        cmd += ["--root", str(tmp)] if example == EXAMPLE else []
        agents = [cl.launch("2:3", cmd, no_python=True, rdzv_flags=("--restart-mode", "in-place")) for _ in range(3)]
        if not C.wait_until(lambda: all(any(s[2] == 3 for s in _steps(a)) for a in agents), 120):
            return {"error": "no world 3 in 120 s"}
        time.sleep(1.0)  # steady training
        is_rank0 = [any(s[1] == 0 for s in _steps(a)) for a in agents]
        victim = next(a for a, r0 in zip(agents, is_rank0, strict=True) if r0 == (victim_kind == "rank0"))
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


def run_node_loss(argv: list[str] | None, example: Path, name: str, doc: str | None) -> None:
    """The command line of a node-loss bench of ``example`` (``name``: what its
    steps are, in the summary line); the Lightning and accelerate benches."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--victim", choices=("other", "rank0"), default="other")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    results: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="rdzv-bench-inplace-") as tmp:
        for run in range(args.runs):
            out = node_loss(Path(tmp) / str(run), args.victim, example)
            out["load"] = C.loadavg()
            results.append(out)
            print(f"[bench] run {run + 1}: {out}", file=sys.stderr, flush=True)
    vals = [float(o["first_step_world2_s"]) for o in results if "first_step_world2_s" in o]  # type: ignore[arg-type]
    if vals:
        kept = all(o.get("kept_pids") for o in results)
        print(f"node loss ({args.victim}) -> first {name} step in world 2: median {statistics.median(vals):.3f} s "
              f"({min(vals):.3f}-{max(vals):.3f}, {len(vals)} runs), survivors kept pids: {kept}")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


def main(argv: list[str] | None = None) -> None:
    run_node_loss(argv, EXAMPLE, "Lightning", __doc__)


if __name__ == "__main__":
    main()
