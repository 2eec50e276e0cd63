"""The leader's *host* dies (its cable is pulled): nothing resets, nothing
answers. A real training job rides it out with the default heartbeat timeout.

Every process has a network namespace of its own, joined by a bridge
(:class:`tests.helpers.netlab.NetLab`): etcd (one member) in the hub at
SUBNET.1, three ``rdzv-server --etcd`` replicas at SUBNET.10-12, two real
agents training scripts/ranks.py over gloo at SUBNET.13-14. Cutting the
leader's cable is ``ip link set <its hub-side veth> down``: silent loss, as
when a machine dies. Its followers cannot tell a dead host by a refused port
(ha.py's takeover), so the lease decides (2 s); the agents cannot tell by a
reset, so their next heartbeat, unacknowledged for TCP_USER_TIMEOUT_S, fails
the connection and they go on to the next endpoint; the new leader gives
every node a heartbeat timeout + FAILOVER_GRACE_S to come back. Checked: a
new leader, both agents on it, the job still in round 0 with no restart, the
same worker processes training on; plugged back, the old leader is a follower
and the job succeeds.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.cluster import FaultCluster, NsServer, Ticks, managed
from tests.helpers.etcd import etcd_binary
from tests.helpers.netlab import NetLab, netlab_or_skip
from tests.helpers.procs import descendants, wait_healthy, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPLICAS = 3
AGENTS = 2
PORT = 29400  # every replica has an address of its own: one port for all
PREFIX = "/dead-host/"


@pytest.fixture
def netlab() -> Iterator[NetLab]:
    with netlab_or_skip(REPLICAS + AGENTS, subnet="10.213.9") as lab:
        yield lab


@pytest.fixture
def fcluster(netlab: NetLab, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[FaultCluster]:
    # after netlab: its processes are stopped before the namespaces go
    yield from managed(FaultCluster(tmp=tmp_path), request)


def start_etcd(lab: NetLab, fc: FaultCluster, tmp: Path) -> str:
    url, peer = f"http://{lab.hub_addr}:2379", f"http://{lab.hub_addr}:2380"
    argv = [
        "ip", "netns", "exec", lab.hub, str(etcd_binary()),
        "--name", "m0", "--data-dir", str(tmp / "etcd.data"),
        "--listen-client-urls", url, "--advertise-client-urls", url,
        "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
        "--initial-cluster", f"m0={peer}",
        "--heartbeat-interval", "50", "--election-timeout", "500", "--unsafe-no-fsync", "--log-level", "warn",
    ]  # fmt: skip
    fc.start("etcd", argv)
    return url


def start_replica(lab: NetLab, fc: FaultCluster, i: int, etcd_url: str) -> NsServer:
    addr = lab.node_addr(i)
    argv = [
        "ip", "netns", "exec", lab.node_ns(i), sys.executable, "-m", "rdzv_server",
        "--host", addr, "--port", str(PORT), "--insecure",
        "--etcd", etcd_url, "--etcd-prefix", PREFIX, "--advertise-url", f"http://{addr}:{PORT}",
        "--etcd-lease-ttl", "2",
    ]  # fmt: skip
    replica: NsServer = fc.start(f"replica{i}", argv, cls=NsServer, port=PORT)
    replica.host, replica.via = addr, lab.in_hub
    assert wait_healthy(replica, 30), replica.text()[-3000:]
    return replica


def role(replica: NsServer) -> str | None:
    try:
        status, body = replica.request("GET", "/healthz", timeout=1.0)
    except (OSError, ValueError):
        return None
    return body.get("role") if status == 200 and isinstance(body, dict) else None


@pytest.mark.timeout(150)
def test_the_leaders_host_dies_and_the_job_rides_it_out(netlab: NetLab, fcluster: FaultCluster, tmp_path: Path) -> None:
    etcd_url = start_etcd(netlab, fcluster, tmp_path)
    replicas = [start_replica(netlab, fcluster, i, etcd_url) for i in range(REPLICAS)]
    endpoints = ",".join(f"{netlab.node_addr(i)}:{PORT}" for i in range(REPLICAS))
    stop = tmp_path / "stop"
    agents = [
        fcluster.start_ranks_agent(
            endpoints, "dh", f"n{i}", stop, nnodes=str(AGENTS), interval=0.05, netns=netlab.node_ns(i),
            flags=("--local-addr", netlab.node_addr(i)),  # the default heartbeat timeout (6 s)
            env={"GLOO_SOCKET_IFNAME": "rzeth"},
        )
        for i in range(REPLICAS, REPLICAS + AGENTS)
    ]  # fmt: skip
    wait_until(
        lambda: all(any(t.round == 0 and t.world == AGENTS and t.step >= 3 for t in Ticks.of(a)) for a in agents),
        60,
        "both nodes training in round 0",
    )
    leader = wait_until(lambda: next((r for r in replicas if role(r) == "leader"), None), 20, "the leader", 0.2)
    leader_i = replicas.index(leader)
    others = [r for r in replicas if r is not leader]
    workers = {a.name: descendants(a.pid) for a in agents}
    assert all(workers.values()), workers

    netlab.cut(leader_i)  # its host is gone: no reset, no answer
    cut_at = time.monotonic()
    new = wait_until(lambda: next((r for r in others if role(r) == "leader"), None), 30, "a new leader", 0.2)
    elected_s = time.monotonic() - cut_at
    new_url = f"http://{new.host}:{PORT}"
    for a in agents:
        a.wait_log(rf"leader is now {new_url}", 30)
    agents_s = time.monotonic() - cut_at
    steps = {a.name: max(t.step for t in Ticks.of(a)) for a in agents}
    wait_until(
        lambda: all(max(t.step for t in Ticks.of(a)) >= steps[a.name] + 20 for a in agents), 30, "training going on"
    )
    status, view = new.request("GET", "/v1/jobs/dh")
    assert status == 200, view
    assert (view["state"], view["round"], view["restarts"]) == ("running", 0, 0), view
    assert all(n["state"] == "running" for n in view["nodes"]), view["nodes"]
    assert {a.name: descendants(a.pid) for a in agents} == workers, "worker processes were restarted"
    assert {t.round for a in agents for t in Ticks.of(a)} == {0}

    netlab.heal(leader_i)
    wait_until(lambda: role(leader) == "follower", 20, "the old leader back as a follower", 0.2)
    stop.touch()
    for a in agents:
        assert a.wait_exit(40) == 0, a.text()[-3000:]
    status, view = new.request("GET", "/v1/jobs/dh")
    assert status == 200 and view["state"] == "succeeded" and view["restarts"] == 0, view
    print(f"leader's host gone: new leader {elected_s:.1f}s after the cut, both agents on it {agents_s:.1f}s")
