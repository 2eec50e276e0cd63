"""A worker for the /ui tests (standard library only, no torch): reports
progress every 0.2 s and runs until stopped; when the file named by
``--fail-file`` appears it prints an error and exits 3."""

import argparse
import os
import sys
import time

from rdzv_client.worker import progress

p = argparse.ArgumentParser()
p.add_argument("--fail-file", default=None)
args = p.parse_args()
step = 0
while True:
    step += 1
    progress(step)
    if args.fail_file and os.path.exists(args.fail_file):
        print("ValueError: loss is nan <b>(ui test)</b>", file=sys.stderr, flush=True)
        sys.exit(3)
    time.sleep(0.2)
