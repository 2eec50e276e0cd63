"""Agents that always give up (issue 19 item 8): ``--server-timeout`` counts
any time without a served join, whatever the failure mode, and every refusal
is met with backoff and rate-limited log lines. Real rdzv-agent processes
against a broken server (tests/helpers/broken_server.py) and the real server."""

from __future__ import annotations

import re
import time

import pytest

from tests.helpers.broken_server import BrokenServer
from tests.helpers.cluster import Cluster

pytestmark = pytest.mark.e2e

SERVER_TIMEOUT_S = 3
# the target is --server-timeout + 5 s; the deadline adds the agent's own start on
# a loaded machine (it only bounds a hang: the measured times are in the log)
DEADLINE_S = SERVER_TIMEOUT_S + 5 + 10
LOG_LINE = re.compile(r"^\[rdzv-agent \d\d:\d\d:\d\d\] ", re.M)
# a notice when the outage starts, one rate-limited line per kind of refusal, the
# link's few: never a line per retry
MAX_LOG_LINES = 8


def _gives_up(cluster: Cluster, endpoint: str, job: str) -> str:
    started = time.monotonic()
    agent = cluster.start_agent(
        None,
        job,
        "stubborn.py",
        "--ignore",
        "none",
        nnodes="1",
        flags=("--endpoint", endpoint, "--job-id", job, "--server-timeout", str(SERVER_TIMEOUT_S)),
    )
    code = agent.wait_exit(DEADLINE_S)
    text = agent.text()
    print(f"{job}: exit {code} after {time.monotonic() - started:.1f}s, {len(LOG_LINE.findall(text))} log lines")
    assert code == 3, text
    [line] = [ln for ln in text.splitlines() if "giving up:" in ln]
    assert re.search(rf"(unreachable|not serving this node) for {SERVER_TIMEOUT_S}s", line), line
    assert len(LOG_LINE.findall(text)) <= MAX_LOG_LINES, text
    assert "Traceback" not in text, text
    assert "ready rank" not in text  # never served: no worker started
    return line


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "mode",
    ["close", "silent", "joined_close", "refuse:unavailable", "refuse:rate_limited", "refuse:not_joined", "evict"],
)
def test_agent_gives_up_on_a_broken_server(cluster: Cluster, mode: str) -> None:
    """A server that accepts then closes, one that never answers the join, one
    that answers then drops us at each join, one that refuses each join with a
    retryable code, one that evicts at each join: the agent exits 3 after
    --server-timeout, and asks again with backoff (a few joins, not hundreds)."""
    server = BrokenServer(mode)
    try:
        job = re.sub(r"[^a-z]", "-", mode)
        line = _gives_up(cluster, f"127.0.0.1:{server.port}", job)
        if mode.startswith("refuse:") or mode == "evict":
            assert "join refused" in line, line
        # backoff (50 ms doubling to 3 s, jittered): at most ~8 tries in 3 s; without: hundreds
        assert server.connections <= 12 and server.joins <= 12, (server.connections, server.joins)
    finally:
        server.close()


@pytest.mark.timeout(90)
def test_agent_refused_for_too_many_waiting_jobs_gives_up(cluster: Cluster) -> None:
    """The real server's ``unavailable`` (--max-waiting-jobs is full): the
    refused agent exits 3 after --server-timeout with a few log lines, not one
    warning per retry for ever."""
    server = cluster.start_server("--max-waiting-jobs", "1")
    holder = cluster.start_agent(server, "holder", "stubborn.py", "--ignore", "none", nnodes="2")
    holder.wait_log(r"round 0: 1 joined", 30)
    _gives_up(cluster, server.endpoint, "refused")
    assert holder.popen.poll() is None


@pytest.mark.timeout(60)
def test_agent_never_reaching_its_endpoint_fails_fast_naming_it(cluster: Cluster) -> None:
    """A typo'd port (nothing listens, each connect refused) with the default
    --server-timeout (300 s): the agent gives up after the never-reached deadline
    (service.NEVER_REACHED_S, 10 s; 3 s here through its variable), naming what it
    tried and what to check, not after 300 s."""
    from tests.helpers.procs import free_port

    port = free_port()
    started = time.monotonic()
    agent = cluster.start_agent(
        None,
        "typo",
        "stubborn.py",
        "--ignore",
        "none",
        nnodes="1",
        flags=("--endpoint", f"127.0.0.1:{port}", "--job-id", "typo"),
        env={"RDZV_NEVER_REACHED_TIMEOUT": "3"},
    )
    code = agent.wait_exit(40)  # the deadline bounds a hang: --server-timeout would be 300 s
    text = agent.text()
    print(f"typo: exit {code} after {time.monotonic() - started:.1f}s")
    assert code == 3, text
    [line] = [ln for ln in text.splitlines() if "giving up:" in ln]
    assert "no rdzv server ever answered" in line and f"127.0.0.1:{port}" in line, line
    assert "--endpoint" in line and "RDZV_NEVER_REACHED_TIMEOUT" in line, line
