"""The successor's copy of the state (rdzv_server.ha_standby), against a real
3-member etcd: read once etcd's marks of the state hold still, served at an
election only while etcd holds nothing newer (a round change, a new job, a
deleted one after the copy: not served, the state is read anew), dropped by a
replica that is not the successor. The state is written by a real leader's
store in process (tests/ha/test_job_layout.py's), the copy read by a Standby
on its own etcd client, as a follower's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestClient

from rdzv_common.protocol import JobSpec
from rdzv_server import etcd, ha_standby
from rdzv_server.ha_standby import CHECK_S, Standby
from rdzv_server.keys import STORE
from tests.ha.test_job_layout import PREFIX, T, leader, load_anew  # noqa: F401  (leader: the fixture, used by name)
from tests.helpers.etcd import EtcdCluster
from tests.unit.test_joblog import ids, kept
from tests.unit.test_store_runs import Recorder, join

pytestmark = [pytest.mark.e2e]


@pytest.fixture
async def standby(etcd_cluster: EtcdCluster) -> AsyncIterator[Standby]:
    client = etcd.EtcdClient(etcd_cluster.endpoints)
    await client.start()
    try:
        yield Standby(client, PREFIX.encode())
    finally:
        await client.close()


async def form(leader: TestClient, job_id: str, n: int) -> dict[str, Recorder]:
    store = leader.app[STORE]
    spec = JobSpec(min_nodes=n, max_nodes=n)
    chans = {nid: Recorder() for nid in ids(n)}
    for nid, chan in chans.items():
        store.join(join(nid, spec).model_copy(update={"job_id": job_id}), chan)
    assert store.jobs[job_id].state.value == "running"
    await asyncio.wait_for(store.flushed(job_id), T)
    return chans


async def copied(standby: Standby) -> None:
    """The successor's checks until its copy is read anew: the marks seen, then held still a check."""
    standby.drop()
    for _ in range(3):
        await standby.keep(True, max(0.0, standby._checked_at) + CHECK_S)
        if standby._loading is not None:
            await standby._loading  # (the read runs in a task of its own)
        if standby.copy is not None:
            return
    raise AssertionError("no copy after three checks of still marks")


async def test_a_copy_of_a_still_state_is_served_and_is_what_a_load_reads(
    leader: TestClient, standby: Standby, etcd_cluster: EtcdCluster
) -> None:
    await form(leader, "j", 64)
    await standby.keep(True, 0.0)
    assert standby.copy is None  # marks seen once: read when they hold still
    await copied(standby)
    state = await standby.take()
    assert state is not None and standby.used == 1 and standby.copy is None  # taken once
    jobs, hosts = state
    assert {j: kept(job) for j, (job, _) in jobs.items()} == {
        j: kept(job) for j, job in (await load_anew(etcd_cluster)).items()
    }
    assert await standby.take() is None  # gone once taken


@pytest.mark.parametrize("change", ["round change", "new job", "deleted job"])
async def test_a_state_changed_after_the_copy_is_never_served(
    leader: TestClient, standby: Standby, etcd_cluster: EtcdCluster, change: str
) -> None:
    store = leader.app[STORE]
    chans = await form(leader, "j", 8)
    await form(leader, "k", 2)
    await copied(standby)
    if change == "round change":
        store.leave("j", ids(8)[3], "bye", chans[ids(8)[3]])
        await asyncio.wait_for(store.flushed("j"), T)
    elif change == "new job":
        await form(leader, "m", 2)
    else:  # (a job made and deleted after the copy leaves the state as the copy has it: served, rightly)
        await form(leader, "d", 1)  # closed, then deleted
        resp = await leader.post("/v1/jobs/d/close")
        assert resp.status == 200, await resp.text()
        await asyncio.wait_for(store.flushed("d"), T)
        await copied(standby)  # the copy holds d
        resp = await leader.delete("/v1/jobs/d")
        assert resp.status == 200, await resp.text()
        for _ in range(int(T / 0.05)):  # (a removal is not a job's write to flush: etcd is asked)
            if "d" not in await load_anew(etcd_cluster):
                break
            await asyncio.sleep(0.05)
    assert await standby.take() is None, change  # the elected replica reads the state anew
    assert standby.used == 0


async def test_a_replica_that_is_not_the_successor_keeps_no_copy(leader: TestClient, standby: Standby) -> None:
    await form(leader, "j", 4)
    await copied(standby)
    await standby.keep(False, 5000.0)
    assert standby.copy is None and await standby.take() is None


async def test_the_marks_move_with_a_new_job(leader: TestClient, standby: Standby) -> None:
    client, prefix = standby.client, PREFIX.encode()
    _, before = await ha_standby.marks(client, prefix)
    await form(leader, "j", 2)
    _, after = await ha_standby.marks(client, prefix)
    assert after != before and after[0][1] == before[0][1] + 1  # jobs/: one pointer more


async def test_newest_is_the_highest_mod_revision_and_the_count_of_the_range(standby: Standby) -> None:
    """etcd's JSON gateway sorts by mod revision, descending, as asked (not by key): the
    last put on a key that is not the first one is what newest names."""
    client, scratch = standby.client, b"/scratch-newest/"
    assert (await client.newest(scratch))[1:] == (0, 0)
    keys = (b"a", b"b", b"c", b"b")  # the last put on a key in the middle: neither key order names it
    revisions = [(await client.txn([], [etcd.put(scratch + k, b"v")])).revision for k in keys]
    _, mod, count = await client.newest(scratch)
    assert (mod, count) == (revisions[-1], 3)
    await client.txn([], [etcd.delete(scratch + b"a")])
    assert (await client.newest(scratch))[1:] == (revisions[-1], 2)


async def test_an_election_cancels_a_read_of_the_copy_in_progress(leader: TestClient, standby: Standby) -> None:
    await form(leader, "j", 4)
    await standby.keep(True, 0.0)
    await standby.keep(True, CHECK_S)  # the marks held still: a read starts, in a task
    reading = standby._loading
    assert reading is not None and not reading.done()
    assert await standby.take() is None  # elected meanwhile: no copy, the read cancelled
    assert reading.cancelled() and standby._loading is None
