"""A node's host vanishes (its cable pulled: no FIN, no RST, no ICMP) and the
server learns it long before the heartbeat timeout (issue 23).

The heartbeat timeout here is 30 s: a re-formation whose reason is not "no
heartbeat", and that happened before the timeout could have fired, was caused
by what these tests are about (the deadlines below are generous, not timed
assertions: the numbers are bench/host_death.py's).

* one node alone (no peer can suspect it): the server's own socket to its
  agent fails at the TCP level (keep-alive + TCP_USER_TIMEOUT,
  rdzv_server.liveness), a lost connection;
* three nodes: the cut node's peers stop hearing its agent's probe answers
  (rdzv_client.peer_probe), suspect it, and the server's probe of its
  connection goes unacknowledged: evicted, "suspected by N peer(s)".
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.helpers.cluster import FaultCluster, Ticks
from tests.helpers.netlab import NetLab
from tests.helpers.procs import free_port, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HB_TIMEOUT = 30.0
# well under the heartbeat timeout: only the new detection can re-form this soon
BEFORE_HB = 20.0


def _start(netlab: NetLab, fcluster: FaultCluster, tmp_path: Path, job: str, nnodes: str):
    port = free_port()
    server = fcluster.start_server_at(
        port,
        tmp_path / "data",
        "--insecure",
        host=netlab.hub_addr,
        name="server",
        netns=netlab.hub,
        request_via=netlab.in_hub,
    )
    stop = tmp_path / "stop"
    agents = [
        fcluster.start_ranks_agent(
            server.endpoint,
            job,
            f"n{i}",
            stop,
            nnodes=nnodes,
            interval=0.05,
            netns=netlab.node_ns(i),
            flags=("--local-addr", netlab.node_addr(i), "--heartbeat-timeout", f"{HB_TIMEOUT:g}"),
            env={"GLOO_SOCKET_IFNAME": "rzeth"},
            worker_args=("--hang-on-error",),
        )
        for i in range(netlab.n)
    ]
    return server, agents, stop


@pytest.mark.parametrize("netlab", [1], indirect=True)
@pytest.mark.timeout(90)
def test_a_lone_nodes_vanished_host_is_a_lost_connection_before_the_heartbeat_timeout(
    netlab: NetLab, fcluster: FaultCluster, tmp_path: Path
) -> None:
    server, agents, _ = _start(netlab, fcluster, tmp_path, "lone", "1")
    wait_until(lambda: any(t.round == 0 and t.step >= 3 for t in Ticks.of(agents[0])), 60, "the node training")
    node_id = server.job("lone")["nodes"][0]["node_id"]
    netlab.cut(0)
    cut_at = time.monotonic()
    view = server.wait_job("lone", lambda v: v["round"] >= 1, BEFORE_HB, "the node lost before the heartbeat timeout")
    assert time.monotonic() - cut_at < HB_TIMEOUT
    reason = view["history"][1]["reason"]
    assert node_id in reason and "connection lost" in reason, view["history"]
