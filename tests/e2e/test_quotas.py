"""Real agents never trip the server's own limits on a joined connection
(issue 19): with a short --idle-timeout and a job whose heartbeat timeout is
long (the client's choice), an agent's heartbeats (every 2 s at most) and
progress keep its one connection, within the frame rate limit, for a whole
run."""

from __future__ import annotations

import pytest

from tests.helpers.cluster import Cluster


@pytest.mark.timeout(120)
def test_a_real_agent_keeps_its_connection_under_a_short_idle_timeout(cluster: Cluster) -> None:
    server = cluster.start_server("--idle-timeout", "10")
    agent = cluster.start_agent(
        server,
        "calm",
        "progress_loop.py",
        "--steps",
        "70",  # 14 s: longer than the idle timeout
        "--interval",
        "0.2",
        nnodes="1:1",
        flags=("--heartbeat-timeout", "600"),  # heartbeats every 2 s: well inside 10 s
    )
    assert agent.wait_exit(90) == 0, agent.text()[-3000:]
    view = server.job("calm")
    assert view["state"] == "succeeded" and view["restarts"] == 0 and len(view["history"]) == 1, view
    log = server.text()
    assert "nothing received for" not in log and "frames at over" not in log, log[-3000:]
