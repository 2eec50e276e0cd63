"""The etcd client with etcd's auth on (a real 3-member etcd): a token from
user and password, a new one when etcd no longer takes it, a clear refusal of
a wrong password; both transports (aiohttp, and the keep-alive thread's
standard-library one)."""

from __future__ import annotations

import asyncio

import pytest

from rdzv_server import etcd
from tests.helpers.etcd import EtcdCluster


def enable_auth(cluster: EtcdCluster, password: str) -> None:
    cluster.call("/v3/auth/role/add", {"name": "root"})
    cluster.call("/v3/auth/user/add", {"name": "root", "password": password})
    cluster.call("/v3/auth/user/grant", {"user": "root", "role": "root"})
    cluster.call("/v3/auth/enable", {})


async def test_user_and_password_get_a_token_and_a_new_one_when_it_is_refused(etcd_cluster: EtcdCluster) -> None:
    enable_auth(etcd_cluster, "s3cret")
    anonymous = etcd.EtcdClient(etcd_cluster.endpoints)
    client = etcd.EtcdClient(etcd_cluster.endpoints, user="root", password="s3cret")
    try:
        with pytest.raises(etcd.EtcdError):  # auth is on: no token, no read
            await anonymous.get(b"/auth-test/k")
        r = await client.txn([], [etcd.put(b"/auth-test/k", b"v")])
        assert r.succeeded
        kv = await client.get(b"/auth-test/k")
        assert kv is not None and kv.value == b"v"
        lease, _ = await client.grant(5)
        assert await asyncio.to_thread(client.keepalive_blocking, lease, 2.0) > 0
        client._token = "not-a-token-etcd-gave"  # as after etcd dropped it: the client authenticates again
        kv = await client.get(b"/auth-test/k")
        assert kv is not None and kv.value == b"v"
        client._token = "not-a-token-etcd-gave"
        assert await asyncio.to_thread(client.keepalive_blocking, lease, 2.0) > 0
    finally:
        await anonymous.close()
        await client.close()


async def test_a_wrong_password_is_a_clear_refusal(etcd_cluster: EtcdCluster) -> None:
    enable_auth(etcd_cluster, "s3cret")
    client = etcd.EtcdClient(etcd_cluster.endpoints, user="root", password="wrong")
    try:
        with pytest.raises(etcd.EtcdError, match="authentication failed"):
            await client.get(b"/auth-test/k")
        with pytest.raises(etcd.EtcdError, match="authentication failed"):
            await asyncio.to_thread(client.keepalive_blocking, 1, 2.0)
    finally:
        await client.close()
