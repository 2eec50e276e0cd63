"""A torchrun-plugin node's host vanishes (its cable pulled: no FIN, no RST, no
ICMP) and its peers find it (issue 23): stock torchrun with
``--rdzv-backend=rdzv`` in network namespaces, real gloo workers
(tests/e2e/scripts/loop.py), a real ``rdzv-server`` in the hub namespace.

The plugin runs the agent's peer prober (rdzv_client.peer_probe): its join
carries a probe port, it probes the peers its assignment's ``watch`` names and
reports the silent ones. Before, a plugin node was neither watched nor
watching, and a pulled cable was found by the server's TCP keep-alive ("connection
lost", 4.6 s) or the heartbeat timeout: the eviction's reason tells which
detection fired (the deadlines are generous, not timed assertions: the
numbers are bench/host_death.py's).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.e2e.test_torchrun_plugin import _at
from tests.helpers.cluster import FaultCluster
from tests.helpers.netlab import NetLab
from tests.helpers.procs import wait_until
from tests.helpers.torchrun import WORKER, WORKER_ARGS, TorchrunProc

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.timeout(120)
def test_a_torchrun_nodes_pulled_cable_is_suspected_by_its_peers(
    netlab: NetLab, fcluster: FaultCluster, tmp_path: Path
) -> None:
    """3 torchrun nodes (--nnodes 2:3) train at world 3; the cable of rank 2's
    node is pulled while the workers wait in gloo's all_reduce on it. Its
    peers' probes go unanswered, they suspect it, the server's probe of its
    connection goes unacknowledged: evicted, "suspected by N peer(s)", and the
    two survivors step at world 2."""
    server = fcluster.start_hub_server(netlab, tmp_path / "data")
    nodes = []
    for i in range(netlab.n):
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--rdzv-backend=rdzv",
            f"--rdzv-endpoint={server.endpoint}",
            "--rdzv-id=tcut",
            f"--nnodes=2:{netlab.n}",
            "--nproc-per-node=1",
            "--max-restarts=3",
            "--monitor-interval=0.1",
            f"--local-addr={netlab.node_addr(i)}",
            str(WORKER),
            *WORKER_ARGS,
            "--steps",
            "100000",
            "--interval",
            "0.05",
        ]
        nodes.append(
            fcluster.start(
                f"node{i}",
                ["ip", "netns", "exec", netlab.node_ns(i), *argv],
                {"GLOO_SOCKET_IFNAME": "rzeth"},
                cls=TorchrunProc,
            )
        )
    wait_until(lambda: all(_at(n, world=3, step=3) for n in nodes), 90, "three workers at step 3, world 3")
    victim = next(n for n in nodes if any(r == 2 for _, r, _, _ in n.steps()))
    survivors = [n for n in nodes if n is not victim]
    netlab.cut(nodes.index(victim))
    cut_at, cut_wall = time.monotonic(), time.time()
    wait_until(lambda: all(_at(n, world=2) for n in survivors), 60, "both survivors' workers at world 2")
    print(f"torchrun host death: survivors stepping in world 2 within {time.monotonic() - cut_at:.2f}s of the cut")
    view = server.job("tcut")
    assert view is not None
    reason = view["history"][1]["reason"]
    print(f"round 1 opened {view['history'][1]['started_at'] - cut_wall:.2f}s after the cut: {reason}")
    # before plugin nodes probed each other: "connection lost" (keep-alive) or "no heartbeat"
    assert "suspected by" in reason, view["history"]
