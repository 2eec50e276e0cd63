"""The benchmark's worker: stamps its start time before anything else.

    stamp.py OUT [--sleep S] [--loop] [--fail-once MARKER --fail-rank R]
             [--progress] [--fail-if-env NAME]

First thing (before importing torch): append ``start RANK WORLD RESTART TIME
PID`` to OUT (O_APPEND: one write per line, so lines from many workers never
interleave). Then:

* default: exit 0 (after ``--sleep S`` seconds);
* ``--loop``: gloo all_reduce every 0.1 s until killed; after the first
  collective append ``step1 RANK WORLD RESTART TIME PID``; when a collective
  fails (a peer died) exit 1 at once;
* ``--fail-once MARKER --fail-rank R``: rank R appends ``crash ...`` and exits
  1 after its first collective, once (the first attempt that finds no MARKER);
* ``--progress``: call ``rdzv_client.worker.progress(step)`` after every
  collective (a no-op outside rdzv-agent, so torchrun runs it unchanged);
* ``--fail-if-env NAME``: a worker whose environment names a file in NAME
  appends ``crash ...`` and exits 1 once that file exists: at start, in every
  attempt, or in the loop (a host that goes bad and fails on every join).

Both launchers run this same file with the same arguments.
"""

import os
import sys
import time

T0 = time.time()
_env = os.environ


def stamp(out, what, t):
    line = (
        f"{what} {_env.get('RANK', '?')} {_env.get('WORLD_SIZE', '?')} "
        f"{_env.get('TORCHELASTIC_RESTART_COUNT', '?')} {t:.6f} {os.getpid()}\n"
    )
    fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def main():
    out = sys.argv[1]
    stamp(out, "start", T0)
    args = sys.argv[2:]

    def opt(name, default=None):
        return args[args.index(name) + 1] if name in args else default

    bad = _env.get(opt("--fail-if-env", ""), "")
    if bad and os.path.exists(bad):
        stamp(out, "crash", time.time())
        return 1
    if "--loop" not in args:
        time.sleep(float(opt("--sleep", "0")))
        return 0
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    marker = opt("--fail-once")
    fail_rank = int(opt("--fail-rank", "-1"))
    progress = None
    if "--progress" in args:
        from rdzv_client.worker import progress
    step = 0
    while True:
        t = torch.ones(1)
        try:
            dist.all_reduce(t)
        except RuntimeError:
            os._exit(1)  # a peer is gone: fail fast, as a real job would after its timeout
        step += 1
        if progress is not None:
            progress(step)
        if bad and os.path.exists(bad):
            stamp(out, "crash", time.time())
            os._exit(1)
        if step == 1:
            stamp(out, "step1", time.time())
            if marker and rank == fail_rank and not os.path.exists(marker):
                open(marker, "w").close()
                stamp(out, "crash", time.time())
                os._exit(1)
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
