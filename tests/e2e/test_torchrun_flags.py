"""A command line copied from torchrun runs under rdzv-agent (issue 12, item 6):
none of torchrun's flags is refused, the ones rdzv implements do what torchrun
does (--role, --signals-to-handle, --shutdown-timeout, --virtual-local-rank,
--run-path), and each one rdzv does differently is named in one note line.
The same flags under the real torchrun give the workers the same variables.
Real server, real agent, real gloo workers (scripts/env_dump.py)."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.helpers.cluster import E2E_SCRIPTS, Cluster
from tests.helpers.procs import free_port, wait_until

pytestmark = pytest.mark.e2e

# What torchrun's user wrote, less the rendezvous flags (each launcher gets its own endpoint).
COPIED = [
    "--nnodes=1",
    "--nproc-per-node=2",
    "--max-restarts=0",
    "--role=trainer",
    "--monitor-interval=1",
    "--start-method=spawn",
    "--signals-to-handle=SIGTERM,SIGINT,SIGUSR1",
    "--shutdown-timeout=5",
    "--virtual-local-rank",
    "--run-path",
    "--event-log-handler=console",
    "--duplicate-stdout-filters=loss",
    "--duplicate_stderr_filters=warn",
    "--local-addr=127.0.0.1",
]
# Only rdzv-agent gets these: torchrun would act on them (static rendezvous, NUMA binding of GPUs, a plugin).
AGENT_ONLY = ["--master-addr=127.0.0.1", "--master_port=29500", "--numa-binding=node", "--logs-specs=default"]
COMPARED = ("ROLE_NAME", "TORCHELASTIC_SIGNALS_TO_HANDLE", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES", "LOCAL_WORLD_SIZE")


def _dumps(out: Path, n: int) -> list[dict]:
    files = sorted(out.glob("env_rank*_restart0.json"))
    assert len(files) == n, files
    return [json.loads(f.read_text()) for f in files]


@pytest.mark.timeout(120)
def test_a_torchrun_line_with_many_flags_runs_as_under_torchrun(cluster: Cluster, tmp_path: Path) -> None:
    server = cluster.start_server()
    ours, theirs = tmp_path / "agent-out", tmp_path / "torchrun-out"
    ours.mkdir()
    theirs.mkdir()
    script = str(E2E_SCRIPTS / "env_dump.py")
    agent = cluster.start(
        "agent",
        [
            sys.executable,
            "-m",
            "rdzv_client.agent",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={server.endpoint}",
            "--rdzv-id=copied",
            *COPIED,
            *AGENT_ONLY,
            script,
            str(ours),
        ],
    )
    torchrun = cluster.start(
        "torchrun",
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}",
            "--rdzv-id=copied",
            *COPIED,
            script,
            str(theirs),
        ],
    )
    assert agent.wait_exit(90) == 0, agent.text()[-4000:]
    assert torchrun.wait_exit(90) == 0, torchrun.text()[-4000:]
    text = agent.text()
    assert "unrecognized arguments" not in text
    assert "max-restarts 0" in text and "(torchrun: 0)" not in text
    for said in (
        "note: --rdzv-backend c10d: rdzv-agent always uses the rdzv server",
        "note: --monitor-interval: not used",
        "note: --start-method spawn: not used",
        "note: --event-log-handler console: not used",
        "note: --master-addr/--master-port: not used",
        "note: --logs-specs default: not used",
        "note: --numa-binding node: not applied",
        "note: --duplicate-stdout-filters: not used",
        "note: --duplicate-stderr-filters: not used",
    ):
        assert text.count(said) == 1, (said, text[-3000:])
    mine, torch_s = _dumps(ours, 2), _dumps(theirs, 2)
    assert all(d["world"] == 2 and d["sum"] == 3.0 for d in mine + torch_s)
    for d in mine:
        assert d["env"]["ROLE_NAME"] == "trainer"
        assert d["env"]["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGUSR1"
        assert d["env"]["LOCAL_RANK"] == "0" and d["env"]["CUDA_VISIBLE_DEVICES"] == str(d["rank"])
    for a, b in zip(mine, torch_s):
        assert a["rank"] == b["rank"]
        assert {k: a["env"].get(k) for k in COMPARED} == {k: b["env"].get(k) for k in COMPARED}, (a["rank"], COMPARED)
    assert server.job("copied")["state"] == "succeeded"


@pytest.mark.timeout(90)
def test_a_signal_from_signals_to_handle_stops_workers_and_leaves(cluster: Cluster) -> None:
    """--signals-to-handle SIGUSR1 (SLURM's warning signal): the agent stops its
    workers and leaves the job, as for SIGTERM; exit 128+SIGUSR1. Its default
    list adds SIGQUIT, as torchrun's."""
    server = cluster.start_server()
    agent = cluster.start_agent(
        server,
        "usr1",
        "loop.py",
        "--steps",
        "100000",
        "--interval",
        "0.05",
        nnodes="1",
        flags=("--signals-to-handle", "SIGTERM,SIGUSR1"),
    )
    wait_until(lambda: len(agent.steps()) >= 2, 60, "the worker stepping")
    assert "max-restarts 3 (torchrun: 0)" in agent.text()  # its default, said in its first line
    workers = cluster.workers_of(agent)
    assert workers
    os.kill(agent.pid, signal.SIGUSR1)
    assert agent.wait_exit(30) == 128 + signal.SIGUSR1, agent.text()[-3000:]
    assert "SIGUSR1: stopping workers and leaving the job" in agent.text()
    wait_until(lambda: not cluster.workers_of(agent) and not cluster.leftovers(), 10, "its workers gone")
    view = server.wait_job("usr1", lambda v: v["state"] != "running" or not v["nodes"], 10, "the node left")
    assert all(n["state"] != "running" for n in view["nodes"]), view
