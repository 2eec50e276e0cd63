"""A worker that ignores SIGINT and SIGTERM (only SIGKILL ends it) and
otherwise sleeps: ``ready rank R pid P`` once it ignores them.
``--ignore`` none makes it an ordinary sleeper."""

import argparse
import os
import signal
import time

p = argparse.ArgumentParser()
p.add_argument("--ignore", choices=["signals", "none"], default="signals")
p.add_argument("--seconds", type=float, default=600.0)
args = p.parse_args()
if args.ignore == "signals":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(f"ready rank {os.environ.get('RANK')} pid {os.getpid()}", flush=True)
deadline = time.monotonic() + args.seconds
while time.monotonic() < deadline:
    time.sleep(0.1)
