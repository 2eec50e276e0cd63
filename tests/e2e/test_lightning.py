"""PyTorch Lightning under rdzv-agent (issue 12: worked when tried by hand; kept
as a regression test): a tiny LightningModule with the ddp strategy on CPU
(gloo), two agents ("nodes") with two workers each against a real server.
Lightning must find torchrun's environment (TorchElasticEnvironment), agree
with the agents on ranks and world size, and finish."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("torch")
pytest.importorskip("pytorch_lightning")

from tests.helpers.cluster import E2E_SCRIPTS, Cluster

pytestmark = pytest.mark.e2e

LINE_RE = re.compile(
    r"lightning rank (\d+) world (\d+) node (\d+) local (\d+) step (\d+) sum ([\d.]+) env (\w+)$", re.M
)


@pytest.mark.timeout(150)
def test_lightning_ddp_on_two_nodes(cluster: Cluster) -> None:
    server = cluster.start_server()
    agents = [
        cluster.start_agent(
            server,
            "lit",
            E2E_SCRIPTS / "lightning_train.py",
            "2",
            "2",
            str(cluster.tmp / f"root{i}"),
            nnodes="2",
            nproc=2,
            flags=("--last-call", "30"),
        )
        for i in range(2)
    ]
    for a in agents:
        assert a.wait_exit(120) == 0, a.text()[-4000:]
    lines = [m.groups() for a in agents for m in LINE_RE.finditer(a.text())]
    assert sorted(int(r) for r, *_ in lines) == [0, 1, 2, 3], [a.text()[-3000:] for a in agents]
    for rank, world, node, local, step, total, env in lines:
        assert (int(world), float(total), env) == (4, 10.0, "TorchElasticEnvironment"), lines
        assert int(node) * 2 + int(local) == int(rank), lines
        assert int(step) == 2, lines  # 4 batches of the 64 samples split over 4 ranks: 2 steps each
    view = server.wait_job("lit", lambda v: v["state"] == "succeeded", 10, "job succeeded")
    assert view["world_size"] == 4 and [r["round"] for r in view["history"]] == [0], view
