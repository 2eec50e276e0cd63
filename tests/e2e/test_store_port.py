"""In-place mode's store port taken by another process (issue 25, the defect):
a real agent, a real server, real gloo workers. Rank 0 cannot host its round's
store; that is not the training's fault, so it must not spend the restart
budget: with --max-restarts 0 the job re-forms uncharged and succeeds (it
failed before: the worker exited 1 and the failure was charged)."""

from __future__ import annotations

import pytest

from tests.helpers.cluster import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def test_a_taken_store_port_re_forms_without_spending_the_budget(cluster: Cluster) -> None:
    server = cluster.start_server()
    flags = ("--restart-mode", "in-place", "--max-restarts", "0")
    agent = cluster.start_agent(server, "port", "port_taken.py", nnodes="1", flags=flags)
    assert agent.wait_exit(90) == 0, agent.text()
    view = server.job("port")
    assert view["state"] == "succeeded" and view["restarts"] == 0, view
    assert "store port taken, not charged" in view["history"][1]["reason"], view["history"]
    assert view["culprit"]["round"] == 0 and "exit code 76" in view["culprit"]["cause"], view["culprit"]
    assert any("StorePortTaken" in line for line in view["culprit"]["stderr"]), view["culprit"]
    assert "formed round 1 rank 0 world 1" in agent.text()
