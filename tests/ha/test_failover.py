"""Failover of rdzv-server replicas on etcd v3, with everything real (issue 11):
a 3-member etcd cluster (tests/helpers/etcd.py), 3 rdzv-server replicas on it
(tests/helpers/ha.py), 2 real agents given every replica (``--endpoint
a,b,c``) and their real gloo workers (tests/faults/scripts/ranks.py: one
all_reduce per tick, ``tick round R rank r node N pid P step S world W``,
every rank leaves after the tick where one saw the stop file).

What a failover must not do to a running job, whatever failed (the leader
replica SIGKILLed, the leader cut off from etcd, etcd members killed, all of
etcd down and back): restart a worker (the pids stay, every tick says restart
count 0), open a new round, move a rank or the master. And etcd's history must
show that no replica wrote outside its own leadership.

The tests print what they measured (seconds from the fault to the new
leader, to the agents back); they assert no timing.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.cluster import RANKS, Ticks
from tests.helpers.etcd import EtcdCluster
from tests.helpers.ha import HAServers, Replica, elected_lease, fencing_violations, log_times
from tests.helpers.procs import Proc, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ELECTED = r"elected leader \(term \d+"
LOST = r"leadership lost: "


def snapshot(view: dict[str, Any]) -> tuple[Any, ...]:
    """What a failover must not change in a running job's view: its round, its
    master, every node's group rank (and that each is running)."""
    nodes = sorted((n["node_id"], n["group_rank"], n["state"]) for n in view["nodes"])
    return view["round"], view["master_addr"], view["master_port"], tuple(nodes)


@dataclass
class Job:
    """A 2-node job of real agents and gloo workers, running."""

    ha: HAServers
    job_id: str
    agents: list[Proc]
    workers: dict[str, list[int]]  # agent name -> its worker pids when the job was running
    before: tuple[Any, ...]  # snapshot() of the job's view then
    stop_file: Path
    texts: dict[str, str]  # agent name -> its log when the job was running

    @classmethod
    def start(cls, ha: HAServers, job_id: str) -> Job:
        stop_file = ha.cluster.tmp / f"{job_id}.stop"
        agents = [
            ha.start_agent(job_id, RANKS, "--label", f"node{i}", "--stop-file", str(stop_file), name=f"node{i}")
            for i in range(2)
        ]
        for a in agents:
            a.wait_log(r"tick round 0 rank \d node \S+ pid \d+ step 3 ", timeout=60)
        view = ha.leader().wait_job(
            job_id, lambda v: len(v["nodes"]) == 2 and all(n["state"] == "running" for n in v["nodes"]), 20, "running"
        )
        workers = {a.name: sorted(ha.cluster.workers_of(a)) for a in agents}
        assert all(workers.values()), workers
        return cls(ha, job_id, agents, workers, snapshot(view), stop_file, {a.name: a.text() for a in agents})

    def steps(self) -> dict[str, int]:
        return {a.name: Ticks.last_step(a) for a in self.agents}

    def run_on(self, ticks: int, timeout: float = 30.0) -> None:
        """Wait until every worker did ``ticks`` more all_reduces (training goes on)."""
        target = {name: step + ticks for name, step in self.steps().items()}
        wait_until(
            lambda: all(self.steps()[n] >= s for n, s in target.items()), timeout, f"{ticks} more ticks on each node"
        )

    def same_workers(self) -> None:
        for a in self.agents:
            assert a.popen.poll() is None, a.text()[-3000:]
            assert sorted(self.ha.cluster.workers_of(a)) == self.workers[a.name], a.text()[-3000:]

    def reconnected(self, leader: Replica) -> dict[str, Any]:
        """Every agent said it now talks to ``leader``, and the leader's view of
        the job is what it was before the failure (round, master, ranks, every
        node running)."""
        for a in self.agents:  # "reconnected to": when the replica it had leads again
            pattern = rf"(link: leader is now {leader.url}\b|reconnected to {leader.url}/)"
            a.wait_log(pattern, timeout=30, count=len(re.findall(pattern, self.texts[a.name])) + 1)
        view: dict[str, Any] = leader.wait_job(
            self.job_id, lambda v: snapshot(v) == self.before, 20, "the job as it was, every node reconnected"
        )
        return view

    def finish(self) -> None:
        """The job ends well with no worker restarted: each agent exits 0;
        each worker ticked in restart 0 only, from the pid it had before the
        failure, every step once, ranks {0, 1} once each; the leader's view
        ends succeeded in the round and with the ranks it had."""
        self.stop_file.touch()
        for a in self.agents:
            assert a.wait_exit(60) == 0, a.text()[-4000:]
        ranks = []
        for a in self.agents:
            ticks = Ticks.of(a)
            assert ticks, a.text()[-3000:]
            assert {t.round for t in ticks} == {0}, f"a worker of {a.name} restarted"
            assert {t.pid for t in ticks} <= set(self.workers[a.name]) and len({t.pid for t in ticks}) == 1
            assert len({t.rank for t in ticks}) == 1 and {t.world for t in ticks} == {2}
            assert [t.step for t in ticks] == list(range(1, len(ticks) + 1)), f"{a.name} skipped or repeated a tick"
            ranks.append(ticks[0].rank)
        assert sorted(ranks) == [0, 1]
        view = self.ha.leader().wait_job(self.job_id, lambda v: v["state"] == "succeeded", 20, "the job to succeed")
        assert view["round"] == self.before[0] and view["restarts"] == 0
        assert max(h["round"] for h in view["history"]) == self.before[0]  # no round opened since
        assert sorted((n["node_id"], n["group_rank"]) for n in view["nodes"]) == [(n, g) for n, g, _ in self.before[3]]


def elections(ha: HAServers) -> int:
    return sum(len(log_times(r, ELECTED)) for r in ha.replicas)


def check_history(ha: HAServers) -> tuple[dict[int, tuple[str, str]], set[int]]:
    """etcd's history under the deployment's prefix: every job/host write by the
    leader of its term while that leadership was live. Returns the terms
    (term -> replica id, URL) and the terms the job's record was written in."""
    events = ha.events()
    problems = fencing_violations(events, ha.prefix)
    assert not problems, "\n".join(problems[:20])
    written = {json.loads(e.value)["term"] for e in events if e.key.startswith(ha.prefix + "jobs/") and e.value}
    assert written  # the check had writes to check
    return ha.leader_terms(events), written


@pytest.mark.timeout(90)
def test_leader_killed_mid_training(ha: HAServers) -> None:
    """kill -9 of the leader replica mid-training: another replica leads,
    both agents reconnect to it, the job keeps its round, ranks and master,
    no worker restarts, the job succeeds."""
    ha.start(3)
    old = ha.leader()
    job = Job.start(ha, "killjob")
    t0 = time.time()
    ha.kill9(old)
    new = ha.leader(timeout=30)
    t_elected = time.time()
    assert new is not old
    job.reconnected(new)
    t_back = time.time()
    job.same_workers()
    job.run_on(5)
    job.finish()
    terms, written = check_history(ha)
    assert len(terms) == 2 and {url for _, url in terms.values()} == {old.url, new.url}
    assert written == set(terms)  # both leaderships wrote the job (the check covered both)
    print(
        f"\nleader kill -9: new leader's /healthz says leader {t_elected - t0:.2f}s after the kill "
        f"(its log: elected at +{log_times(new, ELECTED)[-1].timestamp() - t0:.2f}s); "
        f"both agents on it and the job's view as before at +{t_back - t0:.2f}s"
    )


@pytest.mark.timeout(90)
def test_leader_cut_off_from_etcd(ha: HAServers, etcd_cluster: EtcdCluster) -> None:
    """Each replica talks to one etcd member (replica i -> member i); the
    leader's member is SIGSTOPped, so the leader loses etcd but not its
    agents. It stops serving before another replica is elected (the log
    times of one machine's clock), answers 503 not_leader afterwards, every
    write in etcd's history was made by the leadership live at its revision,
    and the job carries on with no restart under the new leader."""
    ha.start(3, per_member=True)
    old = ha.leader()
    job = Job.start(ha, "cutjob")
    assert elections(ha) == 1
    t0 = time.time()
    etcd_cluster.pause(old.index)
    try:
        new = ha.leader(timeout=30, exclude=(old,))
        t_elected = time.time()
        lost = old.wait_log(LOST, timeout=10)
        assert len(lost) == 1, old.text()[-3000:]
        lost_at = log_times(old, LOST)
        elected_at = log_times(new, ELECTED)
        assert len(lost_at) == 1 and len(elected_at) == 1, (lost_at, elected_at)
        assert lost_at[0] < elected_at[0], (
            f"the old leader stopped at {lost_at[0]}, the new one was elected at {elected_at[0]}"
        )
        status, body = old.request("GET", "/v1/jobs/cutjob")
        assert status == 503 and body["code"] == "not_leader", (status, body)
        job.reconnected(new)
        t_back = time.time()
        job.same_workers()
    finally:
        etcd_cluster.resume(old.index)
    job.run_on(5)
    status, body = old.request("GET", "/v1/jobs/cutjob")  # back on etcd: a follower that names the leader
    assert status == 503 and body["code"] == "not_leader", (status, body)
    job.finish()
    terms, written = check_history(ha)
    assert len(terms) == 2 and {url for _, url in terms.values()} == {old.url, new.url}
    assert written == set(terms)  # both leaderships wrote the job (the check covered both)
    print(
        f"\nleader's etcd member paused: old leader stopped serving at +{lost_at[0].timestamp() - t0:.2f}s, "
        f"new leader elected at +{elected_at[0].timestamp() - t0:.2f}s (its /healthz at +{t_elected - t0:.2f}s), "
        f"both agents on it and the job's view as before at +{t_back - t0:.2f}s"
    )


def member_ids(etcd: EtcdCluster) -> dict[str, str]:
    """member name -> its raft id (the gateway's string form)."""
    listed = etcd.call("/v3/cluster/member/list", {}, member=etcd.leader())["members"]
    return {m["name"]: str(m["ID"]) for m in listed}


def raft_leader_not(etcd: EtcdCluster, keep: int) -> int:
    """The member that is etcd's raft leader, moved off member ``keep`` first if it was there."""
    raft = etcd.leader()
    if raft == keep:
        target = next(i for i in range(len(etcd.members)) if i != keep and etcd.healthy(i))
        ids = member_ids(etcd)
        etcd.call("/v3/maintenance/transfer-leadership", {"targetID": ids[etcd.members[target].name]}, member=raft)
        raft = wait_until(lambda: (lambda r: r if r != keep else None)(etcd.leader()), 10, "the raft leader to move")
    return raft


def nothing_happened(ha: HAServers, leader: Replica, job: Job) -> None:
    """The same replica leads, nobody was elected or lost the leadership, the job is as it was."""
    assert ha.leader() is leader
    assert elections(ha) == 1, {r.name: log_times(r, ELECTED) for r in ha.replicas}
    assert not any(log_times(r, LOST) for r in ha.replicas), {r.name: log_times(r, LOST) for r in ha.replicas}
    assert snapshot(leader.job(job.job_id) or {}) == job.before
    job.same_workers()


@pytest.mark.timeout(90)
def test_one_etcd_member_killed(ha: HAServers, etcd_cluster: EtcdCluster) -> None:
    """An etcd member the leader does not use, then (that one back) etcd's raft
    leader, killed: nothing happens. The same replica leads throughout, no
    election, no round change, no worker restart."""
    ha.start(3, per_member=True)
    leader = ha.leader()
    job = Job.start(ha, "memberjob")
    raft = etcd_cluster.leader()
    victim = next(i for i in range(3) if i not in (leader.index, raft))
    etcd_cluster.kill(victim)
    job.run_on(30)  # > the lease TTL (2 s) at 0.1 s a tick
    nothing_happened(ha, leader, job)
    etcd_cluster.restart(victim)
    # the raft leader (moved off the leader's member if it was there: that would be the cut-off test)
    raft = raft_leader_not(etcd_cluster, leader.index)
    etcd_cluster.kill(raft)
    job.run_on(30)
    nothing_happened(ha, leader, job)
    etcd_cluster.restart(raft)
    job.finish()
    check_history(ha)
    print(f"\nthe leader replica on etcd member {leader.index}: killed member {victim}, then raft leader {raft}")


@pytest.mark.timeout(90)
def test_all_etcd_members_killed_and_restarted(ha: HAServers, etcd_cluster: EtcdCluster) -> None:
    """Every etcd member SIGKILLed, ~3 s later restarted: the agents ride it out
    as a server outage (the workers keep running, the agents say the server is
    unreachable); once etcd is back a replica leads, loads the job, the agents
    reconnect, same round, no restart, the job succeeds."""
    ha.start(3)
    old = ha.leader()
    job = Job.start(ha, "etcdjob")
    t0 = time.time()
    for i in range(3):
        etcd_cluster.kill(i)
    old.wait_log(LOST, timeout=15)
    for a in job.agents:
        a.wait_log(r"server unreachable for \d+s at .*; workers keep running", timeout=20)
    job.run_on(10)
    job.same_workers()
    t_restart = time.time()
    for i in range(3):
        etcd_cluster.restart(i, wait=False)
    etcd_cluster.wait_healthy()
    t_healthy = time.time()
    new = ha.leader(timeout=30)
    t_elected = time.time()
    job.reconnected(new)
    t_back = time.time()
    for a in job.agents:
        a.wait_log(r"server \S+ reachable again", timeout=10)
    job.same_workers()
    # the leadership it took holds: the leader key is bound to the lease it keeps
    # alive (a lease of before the outage, restored by etcd, would expire unrenewed
    # and hand the key to another replica while this one still serves)
    held = elections(ha)
    job.run_on(40)  # past the lease TTL (2 s) at 0.1 s a tick
    assert ha.leader(timeout=5) is new
    assert elections(ha) == held, {r.name: log_times(r, ELECTED) for r in ha.replicas}
    assert ha.leader_lease() == elected_lease(new)
    job.finish()
    check_history(ha)
    print(
        f"\nall etcd members killed: old leader stopped serving at "
        f"+{log_times(old, LOST)[-1].timestamp() - t0:.2f}s; etcd restarted at +{t_restart - t0:.2f}s, "
        f"healthy at +{t_healthy - t0:.2f}s; {new.name} leads ({'the old leader' if new is old else 'another'}) "
        f"at +{t_elected - t0:.2f}s; both agents on it and the job's view as before at +{t_back - t0:.2f}s"
    )
