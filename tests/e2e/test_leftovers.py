"""What an agent leaves on a node is bounded (issue 12 item 5): its private
directory (worker channel, timer pipe, error files without --log-dir) lives
under ``$TMPDIR/rdzv-$UID/``; an agent killed with SIGKILL cannot remove it,
the next agent to start on the node does, and never a live agent's."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.helpers.cluster import Cluster
from tests.helpers.procs import Proc

pytestmark = pytest.mark.e2e


def _agent(cluster: Cluster, tmpdir: Path) -> Proc:
    # bad_lr.py without E2E_BAD_LR: a worker that sleeps until stopped
    agent = cluster.start_agent(None, "", "bad_lr.py", nnodes="1", flags=("--standalone",), env={"TMPDIR": str(tmpdir)})
    agent.wait_log(r"round 0: group rank 0", 60)
    return agent


def _left(tmpdir: Path) -> list[str]:
    """Everything under ``tmpdir`` but the per-user base directory itself."""
    base = f"rdzv-{os.getuid()}"
    return sorted(str(p.relative_to(tmpdir)) for p in tmpdir.rglob("*") if p.name != base)


@pytest.mark.timeout(180)
def test_a_sigkilled_agents_directory_is_removed_by_the_next_agent(cluster: Cluster, tmp_path: Path) -> None:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    first = _agent(cluster, tmpdir)
    assert any(str(first.pid) in p for p in _left(tmpdir)), _left(tmpdir)
    cluster.kill_node(first)
    assert _left(tmpdir), "a SIGKILLed agent cannot clean up: its directory is still there"
    second = _agent(cluster, tmpdir)
    third = _agent(cluster, tmpdir)  # starts while the second runs: the second's directory stays
    left = _left(tmpdir)
    assert not any(str(first.pid) in p for p in left), left
    for live in (second, third):
        assert any(str(live.pid) in p for p in left), left
    for live in (second, third):
        live.popen.send_signal(signal.SIGTERM)
        assert live.wait_exit(30) == 128 + signal.SIGTERM, live.text()
    assert _left(tmpdir) == [], "agents that exit remove what they made"


@pytest.mark.timeout(180)
def test_tee_without_log_dir_keeps_logs_until_the_next_agent(cluster: Cluster, tmp_path: Path) -> None:
    """--tee without --log-dir: the logs stay in the agent's directory after it
    exits (it says where), and the next agent on the node removes them."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = {"TMPDIR": str(tmpdir)}
    first = cluster.start_agent(
        None, "", "tty_bar.py", "--steps", "1", nnodes="1", flags=("--standalone", "--tee", "3"), env=env
    )
    assert first.wait_exit(60) == 0, first.text()
    [where] = first.wait_log(r"log directory set to: (\S+)", 5)
    logs = Path(where.group(1))
    assert logs.is_relative_to(tmpdir) and (logs / "attempt_0" / "0" / "stdout.log").is_file(), _left(tmpdir)
    assert "kept until the next rdzv-agent" in first.text(), first.text()
    second = cluster.start_agent(None, "", "tty_bar.py", "--steps", "1", nnodes="1", flags=("--standalone",), env=env)
    assert second.wait_exit(60) == 0, second.text()
    assert _left(tmpdir) == [], _left(tmpdir)
