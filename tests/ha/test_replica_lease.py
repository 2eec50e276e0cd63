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
