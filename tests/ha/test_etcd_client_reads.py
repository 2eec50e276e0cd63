"""rdzv_server/etcd.py reads whole answers from a real etcd: a new leader
loads every job with ``range_prefix``, and with 1,000 nodes in 10 jobs a page
of records is hundreds of KB, which arrives in many TCP reads. (bench/ha.py
found it: the client read only the first chunk of the body, failed to parse
it -- "HTTP 200, not JSON" -- and every elected replica lost its leadership
while loading, over and over.)"""

from __future__ import annotations

import json

from rdzv_server.etcd import EtcdClient
from tests.helpers.etcd import EtcdCluster


async def test_a_range_of_many_large_records_is_read_whole(etcd_cluster: EtcdCluster) -> None:
    prefix = "/big/jobs/"
    records = {f"{prefix}job{i:02d}": json.dumps({"i": i, "pad": "x" * 60_000}) for i in range(20)}
    for key, value in records.items():
        etcd_cluster.put(key, value)
    client = EtcdClient(etcd_cluster.endpoints)
    try:
        kvs, revision = await client.range_prefix(prefix.encode())
        one = await client.get(f"{prefix}job07".encode())
    finally:
        await client.close()
    assert revision > 0
    assert {kv.key.decode(): kv.value.decode() for kv in kvs} == records
    assert one is not None and one.value.decode() == records[f"{prefix}job07"]
