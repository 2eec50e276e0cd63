"""A worker that reports three steps, says where its agent's socket is, then
hangs (sleeps without calling progress())."""

import os
import time

from rdzv_client.worker import progress

for step in (1, 2, 3):
    progress(step)
    time.sleep(0.1)
print(f"socket {os.environ['RDZV_AGENT_SOCKET']}", flush=True)
time.sleep(600)
