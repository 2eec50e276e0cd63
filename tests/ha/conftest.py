"""Fixtures for the high-availability tests (issue 11): real etcd clusters.

``etcd_cluster``: a started 3-member :class:`tests.helpers.etcd.EtcdCluster`
on loopback ports, under the test's tmp dir; stopped at teardown (every
member, by pid), its data dirs removed (each holds a 64 MB preallocated WAL;
the logs stay), and the members' log tails printed when the test failed.
``cluster``: the test's processes (replicas, agents), stopped by pid, logs
printed on failure. ``ha``: :class:`tests.helpers.ha.HAServers` on both
(lease TTL 2 s; a module may override it). ``agents``: :class:`Agents`,
simulated agents over real WebSockets.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from rdzv_common.protocol import AGENT_PATH
from tests.api.conftest import Agent, join_msg
from tests.helpers.cluster import Cluster, managed
from tests.helpers.etcd import EtcdCluster, etcd_binary
from tests.helpers.ha import HAServers
from tests.helpers.procs import Server


@pytest.fixture
def etcd_cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(tmp=tmp_path / "etcd", size=3, binary=etcd_binary())
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        rep = getattr(request.node, "rep_call", None)
        if rep is not None and rep.failed:
            print(f"\n{cluster.log_tails()}")
        cluster.remove_data()


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    yield from managed(Cluster(tmp=tmp_path), request)


@pytest.fixture
def ha(etcd_cluster: EtcdCluster, cluster: Cluster) -> HAServers:
    # etcd first: torn down last, after the cluster killed replicas and agents
    return HAServers(cluster, etcd_cluster)


class Agents:
    """Simulated agents over real WebSockets (aiohttp) to a replica."""

    def __init__(self) -> None:
        self.session = aiohttp.ClientSession()
        self.open: list[Agent] = []

    async def connect(self, s: Server) -> Agent:
        agent = Agent(await self.session.ws_connect(s.url + AGENT_PATH, timeout=aiohttp.ClientWSTimeout(ws_close=2)))
        self.open.append(agent)
        return agent

    async def form(self, s: Server, job_id: str, nodes: list[str]) -> list[Agent]:
        """Join ``nodes`` to a new job (nnodes n:n) and wait for their assignments."""
        n = len(nodes)
        agents = [await self.connect(s) for _ in nodes]
        for agent, node in zip(agents, nodes):
            await agent.send(join_msg(job_id, node, (n, n)))
        for agent in agents:
            await agent.expect("joined", timeout=10)
            await agent.expect("assigned", timeout=10)
        return agents

    async def close(self) -> None:
        for agent in self.open:
            await agent.close()
        await self.session.close()


@pytest.fixture
async def agents() -> AsyncIterator[Agents]:
    a = Agents()
    yield a
    await a.close()
