"""torch's own watchdog under rdzv-agent: a step guarded by torch elastic's
``FileTimerClient`` (the pipe is ``TORCHELASTIC_TIMER_FILE``, set by the agent
when its environment has ``TORCHELASTIC_ENABLE_FILE_TIMER=1``).

In the first attempt (restart 0) the guarded step overruns its 2 s timer (it
sleeps 60 s): the agent must kill it. Later attempts finish at once.
"""

from __future__ import annotations

import os
import sys
import time

from torch.distributed.elastic.timer import FileTimerClient, configure, expires


def main() -> None:
    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    configure(FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
    with expires(after=2, scope="guarded_step"):
        print(f"guarded step restart {restart} pid {os.getpid()}", flush=True)
        if restart == "0":
            time.sleep(60)
    print(f"done restart {restart}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
