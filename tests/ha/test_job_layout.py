"""A job in etcd as a pointer and the blobs it names (rdzv_server.joblog,
issue 24), against a real 3-member etcd at its default limits (1.5 MiB a
request, 128 operations a transaction): a job whose whole record is over a
request forms and re-forms, a node-loss round change is one small
transaction, and a new leader loads it; a record of the older layout loads.

The job is driven through the leader's store in process (nodes are channels
that record what they are told): what is measured is what the store writes."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from rdzv_common.protocol import JobSpec
from rdzv_server import etcd, rounds
from rdzv_server.app import Settings, create_app
from rdzv_server.ha import HASettings, Replica
from rdzv_server.keys import STORE
from tests.helpers.etcd import EtcdCluster
from tests.unit.test_joblog import ids, kept, secrets_of
from tests.unit.test_store_runs import Recorder, join

pytestmark = [pytest.mark.e2e]

PREFIX = "/layout/"
T = 30.0  # deadline on every wait
ETCD_LIMIT = 1_572_864  # etcd's default --max-request-bytes (the cluster runs with it)
OLD_RECORD = Path(__file__).parent.parent / "unit" / "data" / "job_record_v1.json"


async def serving(etcd_cluster: EtcdCluster) -> TestClient:
    ha = HASettings(  # a long lease: a loaded machine must not cost the leadership mid-test (not what is tested)
        endpoints=etcd_cluster.endpoints, advertise_url="http://127.0.0.1:9", prefix=PREFIX, lease_ttl_s=10
    )
    client = TestClient(TestServer(create_app(Settings(ha=ha))))
    await client.start_server()
    deadline = time.monotonic() + T
    while not client.app[STORE].serving:
        assert time.monotonic() < deadline, "the replica never led"
        await asyncio.sleep(0.05)
    return client


@pytest.fixture
async def leader(etcd_cluster: EtcdCluster) -> AsyncIterator[TestClient]:
    client = await serving(etcd_cluster)
    try:
        yield client
    finally:
        await client.close()


def measure(client: TestClient) -> list[int]:
    """Bytes (keys and values, as etcd counts them) of every transaction the leader sends from now."""
    replica = client.app[STORE].replica
    sizes: list[int] = []
    real = replica.client.txn

    async def txn(compare: Any, success: list[dict[str, Any]], *args: Any, **kw: Any) -> etcd.TxnResult:
        body = [next(iter(op.values())) for op in success]
        sizes.append(sum(len(etcd.unb64(b["key"])) + len(etcd.unb64(b.get("value"))) for b in body))
        return await real(compare, success, *args, **kw)

    replica.client.txn = txn
    return sizes


def acknowledged(client: TestClient) -> rounds.Job:
    """The job as etcd acknowledged it to the leader (its memory may have moved on:
    a stall's grace is not written)."""
    job = client.app[STORE].backend.last("j")
    assert job is not None
    return job


async def load_anew(etcd_cluster: EtcdCluster) -> dict[str, rounds.Job]:
    """What a new leader loads."""
    replica = Replica(etcd.EtcdClient(etcd_cluster.endpoints), "http://127.0.0.1:10", PREFIX)
    try:
        found, _ = await replica.load()
    finally:
        await replica.client.close()
    return {j: job for j, (job, _) in found.items()}


async def test_a_job_over_one_etcd_request_forms_re_forms_and_loads(
    leader: TestClient, etcd_cluster: EtcdCluster
) -> None:
    """8,192 nodes: its whole record is about twice etcd's request limit (the
    layout before could not write it); it forms in several transactions, each
    under the limit, a node-loss round change is small, and a new leader
    loads exactly the round etcd acknowledged."""
    n = 8192
    store = leader.app[STORE]
    sizes = measure(leader)
    spec = JobSpec(min_nodes=n - 1, max_nodes=n, heartbeat_timeout_s=600, join_timeout_s=600)
    chans = {nid: Recorder() for nid in ids(n)}
    for i, (nid, chan) in enumerate(chans.items()):
        store.join(join(nid, spec), chan)
        if i % 256 == 0:
            await asyncio.sleep(0)  # the loop runs between joins, as it does between frames
    job = store.jobs["j"]
    assert job.state.value == "running"
    await asyncio.wait_for(store.flushed("j"), T)
    acked = acknowledged(leader)
    assert len(json.dumps(rounds.to_record(job))) > ETCD_LIMIT  # one request could not hold it
    assert len(sizes) >= 2 and max(sizes) < ETCD_LIMIT, sizes
    assert kept((await load_anew(etcd_cluster))["j"]) == kept(acked)
    # /metrics says the largest request sent: the body as sent, more than its keys and values
    largest = store.replica.client.max_request_bytes
    assert max(sizes) < largest < ETCD_LIMIT, (largest, sizes)
    scrape = await (await leader.get("/metrics")).text()
    assert f"rdzv_storage_max_request_bytes {float(largest)}" in scrape, scrape[-2000:]

    secrets = secrets_of(chans)
    before = len(sizes)
    lost = ids(n)[n // 2]
    store.leave("j", lost, "bye", chans[lost])
    for i, nid in enumerate(ids(n)):
        if nid != lost:
            store.join(join(nid, spec, node_secret=secrets[nid]), chans[nid])
        if i % 256 == 0:
            await asyncio.sleep(0)
    job = store.jobs["j"]
    assert job.round == 1 and job.state.value == "running" and len(job.order) == n - 1
    await asyncio.wait_for(store.flushed("j"), T)
    acked = acknowledged(leader)
    change = sizes[before:]
    assert 1 <= len(change) <= 2 and sum(change) < 8000, change  # the round opened, then completed
    got = (await load_anew(etcd_cluster))["j"]
    assert kept(got) == kept(acked)
    assert got.round == 1 and got.order == job.order


async def test_an_etcd_record_of_the_older_layout_is_served(etcd_cluster: EtcdCluster) -> None:
    """A job written before this layout (its whole record under jobs/<id>, as the
    code before wrote it) is served by a new leader as it was."""
    old = json.loads(OLD_RECORD.read_text())
    etcd_cluster.put(PREFIX + "jobs/j", json.dumps({"by": "old-replica", "term": 1, "record": old}))
    client = await serving(etcd_cluster)
    try:
        view = await (await client.get("/v1/jobs/j")).json()
        assert view["state"] == "running" and view["round"] == 1, view
        assert [n["node_id"] for n in view["nodes"]] == [n["node_id"] for n in old["nodes"]]
        assert kept((await load_anew(etcd_cluster))["j"])["order"] == old["order"]
    finally:
        await client.close()
