"""A replica's leadership is bound to the lease its leader key carries, with a
real etcd. bench/ha.py found it: a leader starved past its watchdog margin
(load 9 on 2 cores) was deposed while its lease still lived in etcd; its next
campaign saw the key bound to that old lease ("ours"), granted a *new* lease
because the old one was no longer surely alive, and led again "in its term"
on the key of the old lease, which nothing kept alive any more. When the key
expired another replica was elected, and for 6 s both served agents, until
the first one's write was fenced off."""

from __future__ import annotations

import asyncio
import time

from rdzv_server.etcd import EtcdClient
from rdzv_server.ha import Replica
from tests.helpers.etcd import EtcdCluster

T = 20.0


async def test_a_deposed_leader_does_not_lead_again_on_the_key_of_its_old_lease(etcd_cluster: EtcdCluster) -> None:
    client = EtcdClient(etcd_cluster.endpoints)
    replica = Replica(client, "http://127.0.0.1:1", prefix="/lease-test/", lease_ttl_s=2, replica_id="r1")
    try:
        await client.start()
        await replica._try_lead()
        assert replica.role == "leader"
        old = replica.lease
        # starved past the margin: the lease is not surely alive any more, the watchdog deposes
        replica._lease_until = time.monotonic() - 1.0
        replica._depose("test: starved")
        assert replica.role == "follower"

        await replica._try_lead()  # its next campaign, the key still there on the old lease
        kv = await client.get(replica.leader_key)
        assert kv is not None and kv.lease == old
        assert replica.role == "follower", f"leads with lease {replica.lease:x} on a key bound to {kv.lease:x}"

        # the old key expires with its lease: then it is elected on a key of its own lease
        deadline = time.monotonic() + T
        while replica.role != "leader":
            assert time.monotonic() < deadline, "not elected after the old key expired"
            await asyncio.sleep(0.1)
            await replica._try_lead()
        kv = await client.get(replica.leader_key)
        assert kv is not None and kv.lease == replica.lease and kv.create_revision == replica.term
    finally:
        await client.close()


async def elected(etcd_cluster: EtcdCluster, prefix: str, ttl: int = 2) -> tuple[Replica, list[str]]:
    """A started replica, alone on ``prefix``, once it leads; and the reasons it is deposed for."""
    replica = Replica(EtcdClient(etcd_cluster.endpoints), "http://127.0.0.1:1", prefix=prefix, lease_ttl_s=ttl)
    deposed: list[str] = []
    replica.on_deposed = deposed.append
    await replica.start()
    deadline = time.monotonic() + T
    while not (replica.role == "leader" and replica.ready):
        if time.monotonic() > deadline:
            await replica.stop()
            raise AssertionError("not elected")
        await asyncio.sleep(0.05)
    return replica, deposed


async def test_a_blocked_event_loop_does_not_cost_the_leadership(etcd_cluster: EtcdCluster) -> None:
    """The keep-alive runs in a thread of its own: a loop that does not run for
    longer than the lease TTL (a reconnect storm on a starved machine; here a
    blocking sleep) still finds its lease renewed and keeps leading in its term.
    With the keep-alive on the loop the watchdog deposed it (bench.ha saw it)."""
    replica, deposed = await elected(etcd_cluster, "/blocked-loop/")
    client = replica.client
    try:
        term, lease = replica.term, replica.lease
        time.sleep(3.0)  # the loop is blocked for 1.5 lease TTLs
        assert replica.serving, "the lease was not renewed while the loop was blocked"
        await asyncio.sleep(0.3)  # the watchdog runs again
        assert deposed == [] and replica.role == "leader"
        assert (replica.term, replica.lease) == (term, lease)
        kv = await client.get(replica.leader_key)
        assert kv is not None and kv.lease == lease and kv.create_revision == term
    finally:
        await replica.stop()


async def test_a_replica_whose_etcd_is_gone_stops_serving_though_its_thread_runs(etcd_cluster: EtcdCluster) -> None:
    """The other side: no answered keep-alive, no leadership, thread or not."""
    replica, deposed = await elected(etcd_cluster, "/etcd-gone/")
    try:
        for i in range(3):
            etcd_cluster.pause(i)
        try:
            deadline = time.monotonic() + 2.0 + 1.0  # the TTL, and the watchdog's period with room
            while replica.role == "leader":
                assert time.monotonic() < deadline, "still leading with etcd gone"
                await asyncio.sleep(0.05)
            assert not replica.serving
            assert deposed and "could not be renewed" in deposed[0]
        finally:
            for i in range(3):
                etcd_cluster.resume(i)
    finally:
        await replica.stop()


async def test_a_leader_whose_lease_was_revoked_stops_serving_within_a_poll(etcd_cluster: EtcdCluster) -> None:
    """A follower that took a live leader for dead revokes its lease (ha.py's
    takeover): the leader reads its key at every poll and stops serving as soon
    as the key is gone, not at its next keep-alive (TTL/4: 7.5 s here)."""
    replica, deposed = await elected(etcd_cluster, "/revoked/", ttl=30)
    try:
        # the keep-alive thread ends (it would learn of the revoke at its next pass, 7.5 s
        # apart); the lease was renewed under 7.5 s ago, so the watchdog keeps still for 20 s
        replica._stopping.set()
        assert replica._ka_thread is not None
        await asyncio.to_thread(replica._ka_thread.join, 10.0)
        etcd_cluster.call("/v3/lease/revoke", {"ID": replica.lease})
        deadline = time.monotonic() + 5.0  # under the keep-alive's 7.5 s
        while replica.role == "leader":
            assert time.monotonic() < deadline, "still leading with its lease revoked"
            await asyncio.sleep(0.05)
        assert not replica.serving
        assert deposed and "leader key of this term is gone" in deposed[0], deposed
    finally:
        await replica.stop()
