"""In-place mode's store port (issue 25, item 4): rank 0's worker binds the
port its agent picked when it joined; when another process took it meanwhile,
process_group fails at once with a line that says so (before: it retried the
bind until the group's timeout, 60 s by default, and the round stood still).
A real TCPStore and a real socket holding the port, in a subprocess (the group
installs its own excepthook)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from rdzv_client.inplace_store import port_taken

ROOT = Path(__file__).resolve().parents[2]

TAKEN = r"""
import socket, sys
from rdzv_client import inplace
from rdzv_client.inplace_store import StorePortTaken
from rdzv_client.worker import World
holder = socket.socket()
holder.bind(("127.0.0.1", 0))
holder.listen()
port = holder.getsockname()[1]
w = World(round=0, rank=0, world_size=2, local_rank=0, local_world_size=1, group_rank=0, group_world_size=2,
          master_addr="127.0.0.1", master_port=port, fresh=True)
try:
    inplace.process_group(w, timeout_s=float(sys.argv[1]))
except StorePortTaken as e:
    print("TAKEN", e)
except Exception as e:
    print("OTHER", type(e).__name__, e)
"""


@pytest.mark.timeout(60)
def test_rank_0_fails_at_once_when_its_store_port_is_taken() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RDZV_", "TORCHELASTIC_"))}
    env.update(PYTHONPATH=str(ROOT))
    # a group timeout of 20 s: the retry loop before the fix spent it all, then raised torch's own error
    res = subprocess.run([sys.executable, "-c", TAKEN, "20"], capture_output=True, text=True, env=env, timeout=50)
    assert res.stdout.startswith("TAKEN "), (res.stdout, res.stderr[-2000:])
    assert "is taken by another process" in res.stdout and "127.0.0.1:" in res.stdout, res.stdout


UNCAUGHT = TAKEN.split("try:")[0] + "inplace.process_group(w, timeout_s=20.0)\n"


@pytest.mark.timeout(60)
def test_uncaught_it_ends_the_worker_with_the_exit_code_its_agent_reports_uncharged() -> None:
    """Uncaught (as in a training script), the worker exits STORE_PORT_EXIT, not 1:
    its agent reports reason "store_port" and the server charges no restart."""
    from rdzv_client.inplace_store import STORE_PORT_EXIT

    env = {k: v for k, v in os.environ.items() if not k.startswith(("RDZV_", "TORCHELASTIC_"))}
    env.update(PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-c", UNCAUGHT], capture_output=True, text=True, env=env, timeout=50)
    assert res.returncode == STORE_PORT_EXIT, (res.returncode, res.stderr[-2000:])
    assert "StorePortTaken" in res.stderr and "is taken by another process" in res.stderr


def test_port_taken_tells_a_bind_in_use_from_the_failures_worth_retrying() -> None:
    assert port_taken(OSError(errno.EADDRINUSE, "Address already in use"))
    assert port_taken(
        RuntimeError(
            "The server socket has failed to listen on any local network address. port: 1, useIpv6: false, "
            "code: -98, name: EADDRINUSE, message: address already in use"
        )
    )
    assert not port_taken(RuntimeError("Connection reset by peer"))
    assert not port_taken(OSError(errno.ECONNREFUSED, "Connection refused"))
