"""Failover of rdzv-server replicas on etcd v3, with everything real (issue 11):
a 3-member etcd cluster (tests/helpers/etcd.py), 3 rdzv-server replicas on it
(tests/helpers/ha.py), 2 real agents given every replica (``--endpoint
a,b,c``) and their real gloo workers (tests/e2e/scripts/loop.py: one
all_reduce per step, ``step S rank R world W restart C pid P``).

What a failover must not do to a running job, whatever failed (the leader
replica SIGKILLed, the leader cut off from etcd, etcd members killed, all of
etcd down and back): restart a worker (the pids stay, every step line says
``restart 0``), open a new round, move a rank or the master. And the history
in etcd must show that no replica ever wrote outside its own leadership.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.cluster import Cluster, managed
from tests.helpers.etcd import EtcdCluster
from tests.helpers.ha import HAServers, Replica, log_times
from tests.helpers.procs import Proc

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ELECTED = r"elected leader \(term \d+"
LOST = r"leadership lost: "


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    yield from managed(Cluster(tmp=tmp_path), request)


@pytest.fixture
def ha(etcd_cluster: EtcdCluster, cluster: Cluster) -> HAServers:
    # etcd first: torn down last, after the cluster killed replicas and agents
    return HAServers(cluster, etcd_cluster)


def snapshot(view: dict[str, Any]) -> tuple[Any, ...]:
    """What a failover must not change in a running job's view: its round, its
    master, every node's group rank (and that each is running)."""
    nodes = sorted((n["node_id"], n["group_rank"], n["state"]) for n in view["nodes"])
    return view["round"], view["master_addr"], view["master_port"], tuple(nodes)


def start_job(ha: HAServers, job_id: str, steps: int) -> tuple[list[Proc], dict[str, list[int]], dict[str, Any]]:
    """Two agents of ``job_id`` (loop.py, ``steps`` steps at 0.1 s), once both
    workers printed step 2: the agents, their worker pids, the job's view."""
    agents = [ha.start_agent(job_id, "loop.py", "--steps", str(steps), "--interval", "0.1") for _ in range(2)]
    for a in agents:
        a.wait_log(r"step 2 rank", timeout=60)
    leader = ha.leader()
    view = leader.wait_job(job_id, lambda v: all(n["state"] == "running" for n in v["nodes"]), 20, "both running")
    workers = {a.name: sorted(ha.cluster.workers_of(a)) for a in agents}
    assert all(len(w) == 1 for w in workers.values()), workers
    return agents, workers, view


def finish_job(ha: HAServers, job_id: str, agents: list[Proc], workers: dict[str, list[int]], before: Any) -> None:
    """The job ends well with no worker restarted: each agent exits 0, each
    worker printed every step as ``restart 0`` from the pid it had before the
    failure, ranks {0, 1} once each; the leader's view ends succeeded in the
    round and with the ranks it had."""
    for a in agents:
        assert a.wait_exit(60) == 0, a.text()[-4000:]
    ranks = []
    for a in agents:
        steps = a.steps()
        assert steps, a.text()[-3000:]
        assert {s.restart for s in steps} == {0}, f"a worker restarted: {a.name}"
        assert {s.pid for s in steps} == set(workers[a.name]), (a.name, {s.pid for s in steps}, workers[a.name])
        assert len({s.rank for s in steps}) == 1 and {s.world for s in steps} == {2}
        ranks.append(steps[0].rank)
        assert [s.step for s in steps] == list(range(1, len(steps) + 1)), f"{a.name} skipped or repeated a step"
    assert sorted(ranks) == [0, 1]
    leader = ha.leader()
    view = leader.wait_job(job_id, lambda v: v["state"] == "succeeded", 20, "the job to succeed")
    assert view["round"] == before[0] and view["restarts"] == 0
    assert max(h["round"] for h in view["history"]) == before[0]  # no round opened since
    assert sorted((n["node_id"], n["group_rank"]) for n in view["nodes"]) == [(n, g) for n, g, _ in before[3]]


def wait_reconnected(ha: HAServers, leader: Replica, agents: list[Proc], job_id: str, before: Any) -> dict:
    """Every agent said it now talks to ``leader``, and the leader's view of
    the job is what it was before the failover (same round, master, ranks,
    every node running)."""
    for a in agents:
        a.wait_log(rf"link: leader is now {leader.url}\b", timeout=30)
    return leader.wait_job(job_id, lambda v: snapshot(v) == before, 20, "the job as it was, every node reconnected")


@pytest.mark.timeout(90)
def test_leader_killed_mid_training(ha: HAServers) -> None:
    """kill -9 of the leader replica mid-training: another replica leads,
    both agents reconnect to it, the job keeps its round, ranks and master,
    no worker restarts, the job succeeds."""
    ha.start(3)
    old = ha.leader()
    agents, workers, view = start_job(ha, "killjob", steps=100)
    before = snapshot(view)
    t0 = time.time()
    ha.kill9(old)
    new = ha.leader(timeout=30)
    t_elected = time.time()
    assert new is not old
    wait_reconnected(ha, new, agents, "killjob", before)
    t_back = time.time()
    for a in agents:  # the workers ran through it: the same processes
        assert sorted(ha.cluster.workers_of(a)) == workers[a.name], a.text()[-3000:]
    finish_job(ha, "killjob", agents, workers, before)
    elected_at = log_times(new, ELECTED)
    print(
        f"\nleader kill -9: new leader's /healthz after {t_elected - t0:.2f}s "
        f"(its log: elected {elected_at[-1].timestamp() - t0:.2f}s after the kill); "
        f"agents reconnected, job view restored after {t_back - t0:.2f}s"
    )
