"""Hugging Face accelerate in place (issue 20): node loss -> first accelerate step in world 2. Printed, never asserted.

    python -m bench.accelerate_inplace [--runs K] [--victim other|rank0]

3 rdzv-agents (2:3, ``--restart-mode in-place``) run
examples/train_accelerate_inplace.py (an ``InPlaceAccelerator`` per round);
SIGKILL a node -> seconds until both survivors printed their first step in
world 2 (after the new group, accelerate's state set up again, ``prepare``,
the broadcast of the most advanced rank's state), and whether they kept
their pids. The run itself is bench/lightning_inplace.py's, on this example.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from . import _common as C
from .lightning_inplace import node_loss

EXAMPLE = C.ROOT / "examples" / "train_accelerate_inplace.py"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--victim", choices=("other", "rank0"), default="other")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    results: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="rdzv-bench-acc-") as tmp:
        for run in range(args.runs):
            out = node_loss(Path(tmp) / str(run), args.victim, EXAMPLE)
            out["load"] = C.loadavg()
            results.append(out)
            print(f"[bench] run {run + 1}: {out}", file=sys.stderr, flush=True)
    vals = [float(o["first_step_world2_s"]) for o in results if "first_step_world2_s" in o]  # type: ignore[arg-type]
    if vals:
        kept = all(o.get("kept_pids") for o in results)
        print(f"node loss ({args.victim}) -> first accelerate step in world 2: median {statistics.median(vals):.3f} s "
              f"({min(vals):.3f}-{max(vals):.3f}, {len(vals)} runs), survivors kept pids: {kept}")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
