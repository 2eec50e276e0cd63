"""Agents and the CLI that behave (issue 13): signals, giving up on a dead
server, root causes that name the error, escaped text from the network,
a bad server message. Real server, real agents, real workers."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT, Cluster, Proc, wait_until

pytestmark = pytest.mark.e2e

READY_RE = r"^\[(\d+)\]: ready rank \d+ pid (\d+)$"


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def _worker_pids(agent: Proc, count: int = 1, timeout: float = 30.0) -> list[int]:
    return [int(m.group(2)) for m in agent.wait_log(READY_RE, timeout, count=count)]


def _no_traceback(agent: Proc) -> None:
    assert "Traceback" not in agent.text(), agent.text()[-3000:]


def rdzv(cluster: Cluster, *argv: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
    """The ``rdzv`` command, to its end."""
    return subprocess.run([sys.executable, "-m", "rdzv_client.cli", *argv], capture_output=True, text=True,
                          env=cluster.env(), cwd=ROOT, timeout=timeout, stdin=subprocess.DEVNULL)


# ------------------------------------------------------------------ signals


@pytest.mark.timeout(90)
def test_second_sigint_kills_workers_that_ignore_signals(cluster: Cluster) -> None:
    """Ctrl-C twice: the second one kills a worker that ignores SIGINT and
    SIGTERM at once, long before --stop-timeout (60 s) would have."""
    server = cluster.start_server()
    agent = cluster.start_agent(server, "ctrlc", "stubborn.py", nnodes="1", flags=("--stop-timeout", "60"))
    [pid] = _worker_pids(agent)
    os.kill(agent.pid, signal.SIGINT)
    agent.wait_log(r"SIGINT: stopping workers", 10)
    assert _alive(pid)  # it ignores SIGINT: only the stop timeout or a second Ctrl-C ends it
    os.kill(agent.pid, signal.SIGINT)
    # well before the 60 s stop timeout
    assert agent.wait_exit(30) == 128 + signal.SIGINT, agent.text()
    assert not _alive(pid)
    assert not cluster.leftovers()
    _no_traceback(agent)


@pytest.mark.timeout(90)
def test_sighup_is_handled_like_sigterm(cluster: Cluster, tmp_path: Path) -> None:
    """A closed terminal (SIGHUP): the agent stops its workers, leaves the job,
    exits 128+1 and leaves no temporary directory behind."""
    server = cluster.start_server()
    tmp = tmp_path / "agent-tmp"
    tmp.mkdir()
    args = ("stubborn.py", "--ignore", "none")
    agents = [cluster.start_agent(server, "hup", *args, nnodes="1:2", env={"TMPDIR": str(tmp)}) for _ in range(2)]
    pids = [_worker_pids(a)[0] for a in agents]
    assert list(tmp.iterdir()), "the agent keeps its error files in a temporary directory"
    hup_id = agents[0].wait_log(r"node (\S+): joining", 1)[0].group(1)
    os.kill(agents[0].pid, signal.SIGHUP)
    assert agents[0].wait_exit(20) == 128 + signal.SIGHUP, agents[0].text()
    assert not _alive(pids[0])
    view = server.wait_job("hup", lambda v: v["round"] >= 1, 20, "a new round without the hung-up node")
    assert hup_id in view["history"][1]["reason"] and "left" in view["history"][1]["reason"], view["history"]
    assert "SIGHUP" in view["history"][1]["reason"]
    assert _alive(pids[1]) or agents[1].popen.poll() is None
    os.kill(agents[1].pid, signal.SIGTERM)
    assert agents[1].wait_exit(20) == 128 + signal.SIGTERM
    assert not list(tmp.iterdir()), list(tmp.iterdir())
    _no_traceback(agents[0])
