"""A node loss never ends a job under ``accelerate launch`` with its defaults
(``--max_restarts 0``), issue 25, item 1: the real accelerate CLI with
``--rdzv_backend rdzv`` (docs/torchrun.md's --same_network recipe: the server
named in ``--rdzv_conf server=...``), three launcher processes as nodes on
loopback, one CPU worker each (scripts/accel_loop.py, a plain accelerate
loop), a real ``rdzv-server`` (the ``rig`` fixture)."""

from __future__ import annotations

import re
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("accelerate")

from tests.helpers.cluster import E2E_SCRIPTS
from tests.helpers.procs import free_port, wait_until
from tests.helpers.torchrun import Rig, TorchrunProc

from .test_torchrun_plugin import _at

pytestmark = pytest.mark.e2e

SCRIPT = E2E_SCRIPTS / "accel_loop.py"


def _launch(rig: Rig, rank: int, port: int, conf: str) -> TorchrunProc:
    """``accelerate launch`` as a user runs it: accelerate's own defaults
    (--max_restarts 0, --monitor_interval 0.1), 3 machines of 1 process."""
    argv = [
        sys.executable,
        "-m",
        "accelerate.commands.accelerate_cli",
        "launch",
        "--multi_gpu",
        "--same_network",
        "--num_processes",
        "3",
        "--num_machines",
        "3",
        "--machine_rank",
        str(rank),
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        str(port),
        "--rdzv_backend",
        "rdzv",
        "--rdzv_conf",
        conf,
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(SCRIPT),
        "--steps",
        "60",
        "--interval",
        "0.1",
    ]
    return rig.start(f"node{rank}", argv, None, cls=TorchrunProc)


@pytest.mark.timeout(120)
def test_a_node_loss_under_accelerate_defaults_keeps_the_job_going(rig: Rig) -> None:
    """3 accelerate launchers (``--rdzv_conf nnodes=2:3``: accelerate's
    --num_machines is one number), accelerate's default --max_restarts 0:
    SIGKILL one node's launcher process group while all train at world 3. The
    two survivors re-form at world 2 with no restart charged, finish, exit 0,
    and the job succeeds."""
    server = rig.start_server()
    port = free_port()  # only accelerate's own port check on machine 0 reads it
    conf = f"server={server.endpoint},job_id=accel-loss,nnodes=2:3,last_call_timeout=30"
    nodes = [_launch(rig, r, port, conf) for r in range(3)]
    wait_until(lambda: all(_at(n, world=3, step=2) for n in nodes), 90, "three workers at step 2, world 3")
    victim = next(n for n in nodes if any(r == 2 for _, r, _, _ in n.steps()))
    rig.kill_node(victim)
    survivors = [n for n in nodes if n is not victim]
    for n in survivors:
        assert n.wait_exit(90) == 0, n.text()[-4000:]
        assert re.search(r"^done rank [01] world 2 restart 0$", n.text(), re.M), n.text()[-3000:]
    # which way it went (the echo came first, or the server's round change did): for the log, not asserted
    print("echo restarts:", [n.text().count("not charged to --max-restarts") for n in survivors])
    view = rig.wait_job("accel-loss", lambda v: v["state"] == "succeeded", 10, "job succeeded")
    assert [(r["round"], r["world_size"]) for r in view["history"]] == [(0, 3), (1, 2)], view["history"]
    assert "lost" in view["history"][-1]["reason"], view["history"]
