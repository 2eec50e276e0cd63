"""Restart storms (issue 15) with real agents, a real server and real gloo
workers: a job whose workers fail right after their first all_reduce in every
round, and never call progress(), stops after --storm-restarts restarts in a
row without progress; every agent exits EXIT_NO_PROGRESS with one line saying
why. No timed assertions: every wait has a generous deadline."""

from __future__ import annotations

import pytest

from rdzv_client.reactions import EXIT_NO_PROGRESS
from tests.helpers.cluster import Cluster


@pytest.mark.timeout(110)
def test_a_restart_storm_stops_the_job_and_every_agent_exits_no_progress(cluster: Cluster) -> None:
    server = cluster.start_server()
    args = ("loop.py", "--steps", "200", "--interval", "0.1", "--fail-if-env", "E2E_ALWAYS_FAIL")
    # no round lasts an hour and loop.py reports no steps: no round makes progress
    flags = ("--max-restarts", "10", "--storm-restarts", "2", "--min-round-s", "3600")
    agents = [cluster.start_agent(server, "storm", *args, flags=flags, env={"E2E_ALWAYS_FAIL": "1"}) for _ in range(2)]
    for a in agents:
        assert a.wait_exit(90) == EXIT_NO_PROGRESS, a.text()[-3000:]
    for a in agents:
        line = a.wait_log(r"^\[rdzv-agent\] job storm failed: .*$", timeout=1)[0].group(0)
        assert "no progress in 2 restarts; last failure: " in line, line
        assert "injected failure on rank" in line, line
    view = server.job("storm")
    # rounds 0 and 1 failed and restarted without progress; round 2's failure stopped the job
    assert (view["state"], view["restarts"], view["round"]) == ("failed", 2, 2), view
    assert view["root_cause"].startswith("no progress in 2 restarts"), view["root_cause"]
    assert not cluster.leftovers()
