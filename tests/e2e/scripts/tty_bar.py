"""A worker for terminal tests: says whether its stdout and stderr are
terminals, then draws a tqdm progress bar (to stderr, tqdm's default) with one
refresh per step, carriage returns and all; ``--fail`` then raises under
torch's ``@record`` (an error file with the traceback)."""

import argparse
import os
import sys
import time

from torch.distributed.elastic.multiprocessing.errors import record
from tqdm import tqdm


def explode(rank: str) -> None:
    raise ValueError(f"tty_bar failed on rank {rank}")


@record
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--fail", action="store_true")
    args = p.parse_args()
    rank = os.environ["RANK"]
    print(f"isatty stdout={sys.stdout.isatty()} stderr={sys.stderr.isatty()} rank={rank}", flush=True)
    for _ in tqdm(range(args.steps), desc=f"bar{rank}", ncols=60, mininterval=0, miniters=1):
        time.sleep(0.02)
    print(f"bar done rank={rank}", flush=True)
    if args.fail:
        explode(rank)


if __name__ == "__main__":
    main()
