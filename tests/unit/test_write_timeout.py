"""How long an HA leader's write waits for etcd (rdzv_server.ha.Replica.write):
as long as its lease surely holds, never less than the client's timeout. A
write under a 10 s lease that etcd answers after 3 s (a starved etcd, seen at
8,192 nodes by bench.big_job --etcd) used to time out at 2 s on every endpoint:
the round change was refused and every agent of the job reconnected."""

from __future__ import annotations

import time
from typing import Any

from rdzv_server import etcd
from rdzv_server.ha import Replica


class Client:
    """An etcd client that records each transaction's timeout and applies it."""

    timeout_s = etcd.DEFAULT_TIMEOUT_S

    def __init__(self) -> None:
        self.timeouts: list[float | None] = []

    async def txn(self, compare: Any, success: Any, failure: Any = None, timeout_s: float | None = None) -> Any:
        self.timeouts.append(timeout_s)
        return etcd.TxnResult(succeeded=True, revision=7, responses=[])


def leading(ttl: int) -> tuple[Replica, Client]:
    client = Client()
    replica = Replica(client, "http://127.0.0.1:1", "/t/", lease_ttl_s=ttl)  # type: ignore[arg-type]
    replica.role, replica.ready, replica.term, replica.lease = "leader", True, 5, 1
    replica._ttl, replica._lease_until = float(ttl), time.monotonic() + ttl  # a keep-alive just answered
    return replica, client


async def test_a_write_under_a_long_lease_waits_while_the_lease_holds() -> None:
    replica, client = leading(10)
    await replica.write([etcd.put(b"/t/jobs/j", b"{}")])
    (timeout,) = client.timeouts
    assert timeout is not None and 8.0 < timeout <= 10.0, timeout  # 10 s less the 1.5 s margin, less a moment


async def test_under_the_default_lease_a_write_waits_the_clients_timeout() -> None:
    replica, client = leading(2)
    await replica.write([etcd.put(b"/t/jobs/j", b"{}")] * 150)  # two transactions (100 ops at most each)
    assert client.timeouts == [etcd.DEFAULT_TIMEOUT_S] * 2, client.timeouts


def test_a_leader_may_pause_only_while_its_lease_surely_outlives_the_pause() -> None:
    """(the collector's valve, rdzv_server.gc_policy: the keep-alive thread cannot renew meanwhile)"""
    replica, _ = leading(2)
    assert replica.may_pause(0.5) and not replica.may_pause(1.9)  # 2 s lease, 0.3 s margin
    replica._lease_until = time.monotonic() + 0.5
    assert not replica.may_pause(0.5)
    replica.role = "follower"
    assert replica.may_pause(60.0)
