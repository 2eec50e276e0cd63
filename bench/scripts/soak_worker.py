"""The soak's worker (bench/soak_hang.py): gloo all_reduce and
``rdzv_client.worker.progress(step)`` every step until the wall clock passes
the time in the file END_FILE (written by the harness once the job runs; read
every second), measuring the longest gap between two of its own progress() calls.

    soak_worker.py OUT_DIR END_FILE [--interval S]

Every second, and at the end, it writes OUT_DIR/rank{RANK}-r{RESTART}.json:
``{"rank", "restart", "steps", "worst_gap_s", "gaps_over_1s", "t"}``
(written to a temporary file and renamed: a reader never sees half of one).
"""

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from rdzv_client.worker import finished, progress


def main() -> int:
    out, end_file = sys.argv[1], sys.argv[2]
    end = float("inf")
    interval = float(sys.argv[sys.argv.index("--interval") + 1]) if "--interval" in sys.argv else 0.02
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, restart = dist.get_rank(), os.environ.get("TORCHELASTIC_RESTART_COUNT", "?")
    path = os.path.join(out, f"rank{rank}-r{restart}.json")
    steps, worst, over, last, written = 0, 0.0, 0, None, 0.0

    def write() -> None:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(
                {
                    "rank": rank,
                    "restart": restart,
                    "steps": steps,
                    "worst_gap_s": worst,
                    "gaps_over_1s": over,
                    "t": time.time(),
                },
                f,
            )
        os.replace(tmp, path)

    while True:
        t = torch.tensor([1.0 if time.time() >= end else 0.0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # every rank stops after the same step
        if t.item() > 0:
            break
        steps += 1
        progress(steps)
        now = time.monotonic()
        if last is not None:
            gap = now - last
            worst = max(worst, gap)
            over += gap > 1.0
        last = now
        if now - written >= 1.0:
            write()
            written = now
            if os.path.exists(end_file):
                with open(end_file) as f:
                    end = float(f.read() or "inf")
        time.sleep(interval)
    finished()
    write()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
