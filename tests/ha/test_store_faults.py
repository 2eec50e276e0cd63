"""The HA store when one write to etcd fails while the leader keeps its lease
(issue 11 review): the real app in process as the only replica, a real
3-member etcd, and one write made to fail at the replica's write (an etcd
that timed out or refused that one transaction; the lease lives on).

A refused change must change nothing: what the REST answer said was not
done is still there to retry, in memory as in etcd."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from rdzv_common.protocol import AGENT_PATH
from rdzv_server import etcd
from rdzv_server.app import Settings, create_app
from rdzv_server.ha import HASettings
from rdzv_server.keys import STORE
from tests.api.conftest import Agent, join_msg
from tests.helpers.etcd import EtcdCluster

pytestmark = [pytest.mark.e2e]

PREFIX = "/review/"
T = 20.0  # deadline on every wait


@pytest.fixture
async def leader(etcd_cluster: EtcdCluster) -> AsyncIterator[TestClient]:
    ha = HASettings(endpoints=etcd_cluster.endpoints, advertise_url="http://127.0.0.1:9", prefix=PREFIX)
    client = TestClient(TestServer(create_app(Settings(ha=ha))))
    await client.start_server()
    try:
        deadline = time.monotonic() + T
        while not client.app[STORE].serving:
            assert time.monotonic() < deadline, "the replica never led"
            await asyncio.sleep(0.05)
        yield client
    finally:
        await client.close()


def fail_next_delete(client: TestClient) -> list[str]:
    """The replica's next write that deletes a key raises EtcdUnavailable (once)."""
    replica = client.app[STORE].replica
    real = replica.write
    seen: list[str] = []

    async def write(ops: list[dict[str, Any]]) -> None:
        if not seen and any("request_delete_range" in op for op in ops):
            seen.append("failed")
            raise etcd.EtcdUnavailable("etcd: injected timeout of one transaction")
        await real(ops)

    replica.write = write
    return seen


async def test_a_delete_etcd_refused_leaves_the_job_to_delete_again(
    leader: TestClient, etcd_cluster: EtcdCluster
) -> None:
    agent = Agent(await leader.ws_connect(AGENT_PATH))
    await agent.send(join_msg("j", "n1", (1, 1)))
    await agent.expect("joined")
    await agent.expect("assigned")
    r = await leader.post("/v1/jobs/j/close")
    assert r.status == 200, await r.text()
    await agent.close()
    assert etcd_cluster.get(PREFIX + "jobs/j") is not None
    seen = fail_next_delete(leader)
    r = await leader.delete("/v1/jobs/j")
    assert seen == ["failed"]
    assert r.status == 503, await r.text()
    assert (await r.json())["code"] == "unavailable"
    # not deleted: still in etcd, so still here (a retry must find it, not 404)
    assert etcd_cluster.get(PREFIX + "jobs/j") is not None
    r = await leader.get("/v1/jobs/j")
    assert r.status == 200, await r.text()
    assert (await r.json())["state"] == "closed"
    listed = await (await leader.get("/v1/jobs")).json()
    assert [j["job_id"] for j in listed["jobs"]] == ["j"]
    r = await leader.delete("/v1/jobs/j")  # the retry
    assert r.status == 200, await r.text()
    assert etcd_cluster.get(PREFIX + "jobs/j") is None
    assert (await leader.get("/v1/jobs/j")).status == 404


async def test_a_rest_change_cut_short_by_a_step_down_answers_not_leader(leader: TestClient) -> None:
    """The leader steps down while a REST change waits for its write: the
    answer is not_leader (a client of an endpoint list goes on to the next
    replica), not a plain 'unavailable' that makes the CLI give up."""
    agent = Agent(await leader.ws_connect(AGENT_PATH))
    await agent.send(join_msg("k", "n1", (1, 1)))
    await agent.expect("joined")
    await agent.expect("assigned")
    replica = leader.app[STORE].replica
    real = replica.write
    held = asyncio.Event()
    release = asyncio.Event()

    async def write(ops: list[dict[str, Any]]) -> None:
        held.set()
        await release.wait()
        await real(ops)

    replica.write = write
    close = asyncio.ensure_future(leader.post("/v1/jobs/k/close"))
    await asyncio.wait_for(held.wait(), T)
    replica._depose("the test deposes it")  # what the watchdog does when the lease is not renewed in time
    r = await asyncio.wait_for(close, T)
    release.set()
    assert r.status == 503, await r.text()
    assert (await r.json())["code"] == "not_leader", await r.text()


async def test_a_record_that_is_not_rdzvs_is_named_at_a_bounded_rate(
    etcd_cluster: EtcdCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A key under the prefix that is not a job record: the elected replica
    cannot load the state and does not serve (it says which key), but it
    retries at a bounded rate: not a full load of every job and an error
    line with a traceback every poll (10 a second) for as long as it stays."""
    etcd_cluster.put(PREFIX + "jobs/bad", "not a record")
    ha = HASettings(endpoints=etcd_cluster.endpoints, advertise_url="http://127.0.0.1:9", prefix=PREFIX)
    client = TestClient(TestServer(create_app(Settings(ha=ha))))
    await client.start_server()
    try:
        replica = client.app[STORE].replica
        deadline = time.monotonic() + T
        while not replica.elections:
            assert time.monotonic() < deadline, "the replica was never elected"
            await asyncio.sleep(0.05)
        await asyncio.sleep(3.0)
        assert not client.app[STORE].serving
        named = [r for r in caplog.records if "jobs/bad" in r.getMessage()]
        assert named, [r.getMessage() for r in caplog.records]
        errors = [r for r in caplog.records if r.levelname in ("ERROR", "WARNING") and r.name.startswith("rdzv")]
        assert replica.elections <= 3 and len(errors) <= 6, (replica.elections, len(errors))
    finally:
        await client.close()


async def test_a_follower_cut_off_from_etcd_stops_naming_the_leader(etcd_cluster: EtcdCluster) -> None:
    """All of etcd goes down: the leader stops serving within its lease, and a
    follower that cannot read the leader key any more stops naming the old
    leader (in X-Rdzv-Leader and /healthz) once that leadership may be over,
    rather than naming it for as long as the outage lasts."""
    from rdzv_server.ha import Replica

    a = Replica(etcd.EtcdClient(etcd_cluster.endpoints), "http://127.0.0.1:11", PREFIX, 2, replica_id="a")
    b = Replica(etcd.EtcdClient(etcd_cluster.endpoints), "http://127.0.0.1:12", PREFIX, 2, replica_id="b")
    await a.start()
    try:
        deadline = time.monotonic() + T
        while not a.serving:
            assert time.monotonic() < deadline, "a never led"
            await asyncio.sleep(0.05)
        await b.start()
        while b.leader_url != a.advertise_url:
            assert time.monotonic() < deadline, b.leader_url
            await asyncio.sleep(0.05)
        for i in range(3):
            etcd_cluster.kill(i)
        await asyncio.sleep(3 * 2.0)  # three TTLs
        assert not a.serving and a.role == "follower"
        assert b.role == "follower"
        assert b.leader_url is None, b.leader_url
        assert b.refusal().leader is None
    finally:
        await b.stop()
        await a.stop()


async def test_a_host_write_etcd_refused_changes_nothing(leader: TestClient, etcd_cluster: EtcdCluster) -> None:
    """A cordon whose write etcd refused is answered 503 and is not in effect:
    the replica reloads the state from etcd (its agents reconnect) rather than
    keep a host change that the next leader would not know of."""
    replica = leader.app[STORE].replica
    real = replica.write
    seen: list[str] = []

    async def write(ops: list[dict[str, Any]]) -> None:
        if not seen and any(
            etcd.unb64(op.get("request_put", {}).get("key")).startswith(b"/review/hosts/") for op in ops
        ):
            seen.append("failed")
            raise etcd.EtcdUnavailable("etcd: injected timeout of one transaction")
        await real(ops)

    replica.write = write
    r = await leader.post("/v1/hosts/h1/cordon", json={"reason": "maintenance"})
    assert seen == ["failed"]
    assert r.status == 503, await r.text()
    assert etcd_cluster.get(PREFIX + "hosts/h1") is None
    deadline = time.monotonic() + T
    while True:  # it reloads, then serves again, without the cordon
        r = await leader.get("/v1/hosts/h1")
        if r.status != 503:
            break
        assert time.monotonic() < deadline, "the replica did not serve again"
        await asyncio.sleep(0.05)
    assert r.status == 404, await r.text()  # no record of h1: the cordon is not in effect
    r = await leader.post("/v1/hosts/h1/cordon", json={"reason": "maintenance"})  # the retry
    assert r.status == 200, await r.text()
    assert etcd_cluster.get(PREFIX + "hosts/h1") is not None
