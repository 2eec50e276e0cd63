"""A torchrun that gives up after a worker failure ends the job on every
node (issue 12, item 1): stock torchrun with ``--rdzv-backend=rdzv``, real gloo
workers (scripts/loop.py), a real ``rdzv-server`` (the ``rig`` fixture,
tests/helpers/torchrun.py).

Under c10d both torchruns exit within a second. Before the fix the plugin only
told the server that the giving-up node left: the server opened a new round,
the healthy torchrun stopped its workers and waited for that round for the
whole join timeout (600 s)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.helpers.procs import wait_until
from tests.helpers.torchrun import Rig, TorchrunProc

from .test_torchrun_plugin import _at

pytestmark = pytest.mark.e2e

# Far below the join timeout (600 s, the plugin's default) that a stranded peer waits for.
EXIT_DEADLINE_S = 60


def _both_end(rig: Rig, nodes: list[TorchrunProc], job_id: str) -> dict:
    for n in nodes:
        rc = n.wait_exit(EXIT_DEADLINE_S)  # fails the test if it expires
        assert rc == 1, (n.name, rc, n.text()[-3000:])
    return rig.wait_job(job_id, lambda v: v["state"] == "failed", 10, "job failed")


@pytest.mark.timeout(150)
def test_a_torchrun_that_gives_up_ends_the_job_on_every_node(rig: Rig, tmp_path: Path) -> None:
    """torchrun's default ``--max-restarts 0``: rank 1 raises after step 1 while
    rank 0 sleeps 10 s between steps (its worker is healthy: its collective
    would only break at its next step, long after the give-up). Both torchruns exit
    1; the job is failed with rank 1's error as its root cause; the node that
    gave up prints torchrun's failure summary, the healthy one the server's
    reason through RendezvousClosedError."""
    rig.start_server()
    marker = tmp_path / "failed-once"
    args = ("--steps", "1000", "--interval", "10", "--fail-once", str(marker), "--fail-rank", "1")
    nodes = [
        rig.torchrun(f"node{i}", "peers", "2", *args, conf="last_call_timeout=20", max_restarts=0) for i in range(2)
    ]
    wait_until(lambda: all(_at(n, world=2) for n in nodes), 60, "both workers at step 1, world 2")
    view = _both_end(rig, nodes, "peers")
    assert "injected one-time failure on rank 1" in (view["root_cause"] or ""), view
    assert view["round"] == 0, view["history"]  # no round was opened for the node that gave up
    quitter = next(n for n in nodes if any(r == 1 for _, r, _, _ in n.steps()))
    peer = next(n for n in nodes if n is not quitter)
    assert "Root Cause (first observed failure)" in quitter.text(), quitter.text()[-3000:]
    text = peer.text()
    assert "RendezvousClosedError: job peers failed: " in text, text[-3000:]
    assert "injected one-time failure on rank 1" in text, text[-3000:]


@pytest.mark.timeout(150)
def test_a_torchrun_whose_budget_is_spent_ends_the_job_on_every_node(rig: Rig) -> None:
    """``--max-restarts 1`` on both, node1's workers fail in every round: the
    first failure restarts both nodes (round 1), the second spends node1's
    budget; node0, healthy, must not wait for a round that cannot form."""
    rig.start_server()
    args = ("--steps", "1000", "--interval", "10", "--fail-if-env", "RDZV_TEST_FAIL")
    nodes = [
        rig.torchrun(
            f"node{i}",
            "spent",
            "2",
            *args,
            conf="last_call_timeout=20",
            max_restarts=1,
            env={"RDZV_TEST_FAIL": "1"} if i == 1 else None,
        )
        for i in range(2)
    ]
    view = _both_end(rig, nodes, "spent")
    assert view["round"] == 1, view["history"]
    assert "injected failure on rank" in (view["root_cause"] or ""), view
    assert "RendezvousClosedError: job spent failed: " in nodes[0].text(), nodes[0].text()[-3000:]
