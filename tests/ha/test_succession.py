"""The successor (rdzv_server.ha_peers) with a real 3-member etcd and three
real replicas: the leader names the replica that takes over (/healthz and its
agents' upgrade answer, ``X-Rdzv-Successor``), the first one registered after
it; killed, it is replaced by that one, and an agent's link (the real
AgentLink, its connects watched) goes there first, never to the other
follower, even with that one next in its list; with the successor killed too,
the last replica takes over once its head start is out. Its copy of the
state, read before the election (rdzv_server.ha_standby), is what it serves."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from rdzv_client import wsclient
from rdzv_client.client import STABLE_S, AgentLink
from rdzv_server.ha_peers import HEAD_START_S
from tests.ha.conftest import Agents
from tests.helpers.etcd import b64, prefix_end, unb64
from tests.helpers.ha import HAServers, Replica
from tests.helpers.procs import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

T = 20.0
WAITS = "its successor"  # the line of a replica that lets the successor campaign first
COPY = "the state is the standby copy"  # the line of a new leader that serves its copy (ha_standby)


def registered(ha: HAServers) -> list[str]:
    """The registered replicas' advertise URLs, the first registered first."""
    key = (ha.prefix + "replicas/").encode()
    answer = ha.etcd.call("/v3/kv/range", {"key": b64(key), "range_end": b64(prefix_end(key))})
    kvs = sorted(answer.get("kvs") or [], key=lambda kv: int(kv["create_revision"]))
    return [json.loads(unb64(kv["value"]))["url"] for kv in kvs]


def named(replica: Replica) -> Any:
    return (replica.health() or {}).get("successor")


def successor_of(ha: HAServers, leader: Replica) -> Replica:
    url = wait_until(lambda: named(leader), T, f"{leader.name} to name its successor")
    assert url == next(u for u in registered(ha) if u != leader.url), (url, registered(ha))
    return ha.by_url(url)


async def test_the_named_successor_takes_over_and_the_link_goes_there_first(
    ha: HAServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    ha.start(3)
    old = ha.leader()
    successor = successor_of(ha, old)
    other = next(r for r in ha.replicas if r not in (old, successor))
    ports: list[int] = []
    connect = wsclient.connect

    async def watched(host: str, port: int, *args: Any, **kwargs: Any) -> wsclient.WebSocket:
        ports.append(port)
        ws = await connect(host, port, *args, **kwargs)
        return ws

    monkeypatch.setattr(wsclient, "connect", watched)
    # the other follower right after the leader: the walk of old went there first
    link = AgentLink(f"{old.endpoint},{other.endpoint},{successor.endpoint}", heartbeat_s=1.0)
    await link.start()
    try:
        await asyncio.wait_for(link.connected.wait(), T)
        assert ports == [old.port] and link.endpoints.successor == 2
        await asyncio.sleep(STABLE_S + 0.2)  # a service that held (a drop before it is a failure, not news)
        ports.clear()
        await asyncio.to_thread(ha.kill9, old)
        new = await asyncio.to_thread(ha.leader, T, (old,))
        assert new is successor, (new.name, successor.name)
        deadline = time.monotonic() + T
        while not (link.connected.is_set() and link.url.startswith(successor.url)):
            assert time.monotonic() < deadline, (link.last_error, ports)
            await asyncio.sleep(0.05)
        assert ports and set(ports) <= {successor.port, old.port}, (ports, other.port)
        assert ports[0] == successor.port, ports
    finally:
        await link.close()
    # the new leader names the last replica; the killed one is no longer registered
    assert wait_until(lambda: named(successor) == other.url, T, "the new leader to name the last replica")
    assert old.url not in registered(ha)


async def test_with_the_successor_killed_too_the_last_replica_takes_over_after_its_head_start(
    ha: HAServers,
) -> None:
    ha.start(3)
    old = ha.leader()
    successor = successor_of(ha, old)
    last = next(r for r in ha.replicas if r not in (old, successor))
    time.sleep(0.5)
    killed = time.monotonic()
    ha.kill9(successor)
    ha.kill9(old)
    new = ha.leader(T, (old, successor))
    assert new is last
    assert time.monotonic() - killed >= HEAD_START_S  # it let the (dead) successor go first
    assert WAITS in last.text() and successor.url in last.text()


async def test_the_successor_serves_the_state_it_copied_before_the_election(ha: HAServers, agents: Agents) -> None:
    ha.start(3)
    old = ha.leader()
    successor = successor_of(ha, old)
    await agents.form(old, "standby", ["n1", "n2", "n3"])
    before = old.request("GET", "/v1/jobs/standby")[1]
    await asyncio.sleep(3.5)  # the successor's checks (every 1 s) see the state hold still, and copy it
    ha.kill9(old)
    new = ha.leader(T, (old,))
    assert new is successor
    assert COPY in new.text(), new.text()[-3000:]
    status, after = new.request("GET", "/v1/jobs/standby")
    assert status == 200 and (after["round"], after["world_size"]) == (before["round"], before["world_size"])
    assert sorted(n["node_id"] for n in after["nodes"]) == ["n1", "n2", "n3"]
