"""A leader whose process is gone is replaced at once, not when its lease
expires (rdzv_server/ha.py: followers probe the leader's --advertise-url and
revoke the lease of one that refuses connections after it was reached).

The replicas run with a 30 s lease, so that "at once" and "when the lease
expires" cannot be confused: a new leader within TAKEOVER_S (a third of the
lease) is the takeover, not an expiry. And the two cases where it must NOT
happen: a leader that is frozen (SIGSTOP: its port still takes connections)
and one whose advertise URL was never reachable (a wrong --advertise-url)
keep their leadership.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.ha.conftest import Agents
from tests.ha.test_replicas import fenced, leader_kv, lease_ttl
from tests.helpers.cluster import Cluster
from tests.helpers.etcd import EtcdCluster
from tests.helpers.ha import HAServers
from tests.helpers.procs import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TTL = 30  # the replicas' --etcd-lease-ttl
TAKEOVER_S = 10.0  # a new leader within this long of a kill is a takeover (the lease would last TTL)
QUIET_S = 3.0  # how long a leader that must keep its place is watched (30 probes by each follower)
REVOKING = "refuses connections (its process is gone): revoking its lease"


@pytest.fixture
def ha(etcd_cluster: EtcdCluster, cluster: Cluster) -> HAServers:
    """The replicas of tests/ha/conftest.py, with a 30 s lease."""
    return HAServers(cluster, etcd_cluster, lease_ttl=TTL)


async def test_a_killed_leader_is_replaced_before_its_lease_expires(ha: HAServers) -> None:
    ha.start(3)
    old = ha.leader()
    before = leader_kv(ha.etcd, ha.prefix)
    assert before is not None and before["url"] == old.url, before
    time.sleep(0.5)  # the followers reach the leader once (probes every 0.1 s)
    killed_at = time.monotonic()
    ha.kill9(old)
    new = ha.leader(timeout=TAKEOVER_S, exclude=(old,))
    took = time.monotonic() - killed_at
    after = leader_kv(ha.etcd, ha.prefix)
    assert after is not None and after["url"] == new.url and after["term"] > before["term"], (before, after)
    assert took < TTL / 2, took  # not the lease's expiry
    assert lease_ttl(ha.etcd, before["lease"]) == -1  # revoked, with TTL - took seconds left
    revokers = [r for r in ha.replicas if r is not old and REVOKING in r.text()]
    assert revokers, [r.text()[-1500:] for r in ha.replicas if r is not old]
    fenced(ha)


async def test_a_frozen_leader_keeps_its_place(ha: HAServers) -> None:
    """SIGSTOP: the kernel still accepts connections on its port, so the
    probes are not refused; only the lease could end this leadership."""
    ha.start(3)
    old = ha.leader()
    before = leader_kv(ha.etcd, ha.prefix)
    time.sleep(0.5)
    os.kill(old.pid, signal.SIGSTOP)
    try:
        time.sleep(QUIET_S)
        now = leader_kv(ha.etcd, ha.prefix)
        assert now == before, (before, now)
        assert [r.name for r in ha.replicas if REVOKING in r.text()] == []
    finally:
        os.kill(old.pid, signal.SIGCONT)
    assert ha.leader() is old
    assert leader_kv(ha.etcd, ha.prefix) == before


async def test_a_leader_never_reached_keeps_its_place(ha: HAServers) -> None:
    """A wrong --advertise-url (nothing listens there): followers are refused
    from the start, and that is not taken for a death."""
    wrong = f"http://127.0.0.1:{free_port()}"
    first = ha.start_replica(flags=("--advertise-url", wrong))  # the last --advertise-url counts
    ha.leader()
    ha.start(2)
    before = leader_kv(ha.etcd, ha.prefix)
    assert before is not None and before["url"] == wrong, before
    time.sleep(QUIET_S)
    assert leader_kv(ha.etcd, ha.prefix) == before
    assert ha.leader() is first
    assert [r.name for r in ha.replicas if REVOKING in r.text()] == []


async def test_a_stopped_leader_hands_over_itself(ha: HAServers, agents: Agents) -> None:
    """SIGTERM with an agent connected: the leader revokes its own lease while
    it still listens (closing its port first would have the followers take it
    for dead while it still served, and its own revoke would fail)."""
    ha.start(3)
    old = ha.leader()
    await agents.form(old, "held", ["n1"])  # an agent's connection: the server's shutdown waits on it
    time.sleep(0.5)
    assert ha.stop(old) == 0, old.text()[-2000:]
    ha.leader(exclude=(old,))
    assert "leadership handed over: lease revoked" in old.text(), old.text()[-2000:]
    assert [r.name for r in ha.replicas if REVOKING in r.text()] == []
    fenced(ha)
