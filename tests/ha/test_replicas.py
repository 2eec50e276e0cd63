"""HA replicas at the API level (issue 11): a real 3-member etcd, real
``rdzv-server --etcd`` processes, real HTTP and WebSocket upgrades.

Agents are simulated where a job is needed (a WebSocket that sends the
protocol's join, tests/api/conftest.py's ``Agent``): these tests are about
what the replicas answer and what etcd holds, not about the agent.

Checked here: followers refuse every REST call and the agent upgrade with 503
``not_leader`` naming the leader (``X-Rdzv-Leader``) and answer /healthz,
/metrics and /openapi.json themselves; a SIGTERMed leader revokes its lease
and hands over; a SIGSTOPped leader is replaced and, once resumed, writes
nothing (checked in etcd's history); what a leader said it saved is in etcd
and served by the next leader after a kill -9; a leader that loses etcd's
quorum stops serving and one serves again once etcd is back; DELETE removes
the job's key; a leader that is not known (or not a URL) is never named;
deployments under two prefixes of one etcd are separate; and, in process, a
replica that still believes it leads is refused by etcd itself when its term
is gone (the compare of every write).

Every test that changes something ends by checking etcd's history under its
prefix: each write of job or host state was made by the replica holding the
live leader key of its term (tests/helpers/ha.py ``fencing_violations``).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import aiohttp
import pytest

from rdzv_common.protocol import AGENT_PATH, LEADER_HEADER
from tests.api.conftest import Agent, join_msg
from tests.ha.conftest import Agents
from tests.helpers.etcd import EtcdCluster, b64, unb64
from tests.helpers.ha import LEASE_TTL_S, HAServers, fencing_violations
from tests.helpers.procs import Server, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TTL = float(LEASE_TTL_S)  # the replicas' --etcd-lease-ttl (tests/ha/conftest.py's ha)


# ---------------------------------------------------------------- reading


def leader_kv(etcd: EtcdCluster, prefix: str) -> dict[str, Any] | None:
    """The leader key: its value (url, id), lease and create revision (the term); None when absent."""
    answer = etcd.call("/v3/kv/range", {"key": b64(prefix + "leader")})
    kvs = answer.get("kvs") or []
    if not kvs:
        return None
    kv = kvs[0]
    return {
        **json.loads(unb64(kv["value"])),
        "lease": int(kv.get("lease", 0)),
        "term": int(kv["create_revision"]),
    }


def lease_ttl(etcd: EtcdCluster, lease: int) -> int:
    """What etcd says is left of a lease (-1: it does not exist: revoked or expired)."""
    return int(etcd.call("/v3/lease/timetolive", {"ID": lease})["TTL"])


def record(etcd: EtcdCluster, key: str) -> dict[str, Any] | None:
    raw = etcd.get(key)
    return None if raw is None else json.loads(raw)


def job_record(etcd: EtcdCluster, prefix: str, job_id: str) -> dict[str, Any] | None:
    """A job as etcd holds it (its pointer and the blobs that names), as its record."""
    from rdzv_server import joblog, rounds

    value = record(etcd, prefix + "jobs/" + job_id)
    if value is None:
        return None
    data = prefix + "jobdata/" + job_id + "/"
    answer = etcd.call("/v3/kv/range", {"key": b64(data), "range_end": b64(data[:-1] + "0")})
    blobs = {
        joblog.parse_blob_name(unb64(kv["key"]).decode()[len(data) :]): json.loads(unb64(kv["value"]))["data"]
        for kv in answer.get("kvs") or []
    }
    return rounds.to_record(joblog.to_job(joblog.assemble(value["pointer"], blobs).snap))


def refused(
    s: Server, method: str, path: str, body: Any = None, timeout: float = 5.0
) -> tuple[int, dict[str, Any], dict[str, str]]:
    """One raw HTTP call: (status, JSON body, headers), whatever the status."""
    data = None if body is None else json.dumps(body).encode()
    if data is None and method == "POST":
        data = b""
    req = urllib.request.Request(s.url + path, method=method, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null"), dict(r.headers)
    except urllib.error.HTTPError as e:
        with e:
            return e.code, json.loads(e.read() or b"null"), dict(e.headers)


def post(s: Server, path: str, body: Any = None) -> dict[str, Any]:
    status, answer, _ = refused(s, "POST", path, body)
    assert status == 200, (s.name, path, status, answer)
    return answer


def metric(s: Server, name: str) -> float | None:
    with urllib.request.urlopen(s.url + "/metrics", timeout=5.0) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return None


def fenced(ha: HAServers) -> list[tuple[int, str, str, int]]:
    """Fail on any write of state outside its writer's leadership (etcd's
    history); return every write as (revision, key, by or "" for a delete, term)."""
    events = ha.events()
    problems = fencing_violations(events, ha.prefix)
    assert not problems, problems
    out = []
    for e in events:
        if e.key.startswith((ha.prefix + "jobs/", ha.prefix + "hosts/")):
            v = json.loads(e.value) if e.value is not None else {"by": "", "term": 0}
            out.append((e.revision, e.key, v["by"], v["term"]))
    return out


def kill9(s: Server) -> None:
    os.kill(s.pid, signal.SIGKILL)
    s.wait_exit(10)


# ------------------------------------------------------------ simulated agents


async def dropped(agent: Agent, timeout: float = 10.0) -> None:
    """The server closed the agent's connection (messages sent before the close are skipped)."""
    deadline = time.monotonic() + timeout
    while True:
        frame = await asyncio.wait_for(agent.ws.receive(), max(0.01, deadline - time.monotonic()))
        if frame.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED):
            return
        assert frame.type == aiohttp.WSMsgType.TEXT, frame


async def upgrade(s: Server) -> tuple[int, dict[str, str]]:
    """The agent channel's upgrade at ``s``: (HTTP status, response headers); 101 when it was accepted."""
    async with aiohttp.ClientSession() as session:
        try:
            ws = await session.ws_connect(s.url + AGENT_PATH, timeout=aiohttp.ClientWSTimeout(ws_close=2))
        except aiohttp.WSServerHandshakeError as e:
            return e.status, dict(e.headers or {})
        await ws.close()
        return 101, {}


# ------------------------------------------------------------------- tests

# Every REST route a follower must refuse (with a valid body where one is needed).
REST_CALLS = [
    ("GET", "/v1/jobs", None),
    ("GET", "/v1/jobs/j1", None),
    ("DELETE", "/v1/jobs/j1", None),
    ("POST", "/v1/jobs/j1/close", None),
    ("GET", "/v1/hosts", None),
    ("GET", "/v1/hosts/h1", None),
    ("POST", "/v1/hosts/h1/cordon", {"reason": "test"}),
    ("POST", "/v1/hosts/h1/uncordon", None),
    ("POST", "/v1/hosts/h1/health", {"job_id": "j1", "reason": "test"}),
    ("GET", "/v1/events?since=0", None),
    ("GET", "/v1/jobs/j1/events?since=0", None),
    ("GET", "/no/such/path", None),
]


def ui_redirect(s: Server, path: str) -> tuple[int, dict[str, str]]:
    """GET ``path`` without following a redirect: (status, headers)."""
    conn = http.client.HTTPConnection(s.host, s.port, timeout=5.0)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        r.read()
        return r.status, dict(r.getheaders())
    finally:
        conn.close()


async def test_followers_refuse_and_name_the_leader(ha: HAServers) -> None:
    ha.start(3)
    leader = ha.leader()
    followers = [r for r in ha.replicas if r is not leader]
    kv = leader_kv(ha.etcd, ha.prefix)
    assert kv is not None and kv["url"] == leader.url, kv
    for f in followers:
        wait_until(lambda f=f: (f.health() or {}).get("leader") == leader.url, 10, f"{f.name} knowing the leader")
        h = f.health()
        assert h is not None and h["role"] == "follower" and h["leader"] == leader.url, h
        for method, path, body in REST_CALLS:
            status, answer, headers = refused(f, method, path, body)
            assert status == 503, (f.name, method, path, status, answer)
            assert answer["code"] == "not_leader", (method, path, answer)
            assert leader.url in answer["message"], answer
            assert headers.get(LEADER_HEADER) == leader.url, (method, path, headers)
        # a person's browser on a follower's dashboard goes to the leader's (API calls get the 503 above)
        for path in ("/ui", "/ui/jobs/j1?x=1", "/"):
            status, headers = ui_redirect(f, path)
            assert status == 307 and headers.get("Location") == leader.url + path, (path, status, headers)
            assert headers.get(LEADER_HEADER) == leader.url, headers
        status, headers = await upgrade(f)
        assert status == 503 and headers.get(LEADER_HEADER) == leader.url, (status, headers)
        assert metric(f, "rdzv_ha_leader") == 0
        status, doc, _ = refused(f, "GET", "/openapi.json")
        assert status == 200 and doc["openapi"].startswith("3."), status
    h = leader.health()
    assert h is not None and h["role"] == "leader" and h["leader"] == leader.url, h
    assert metric(leader, "rdzv_ha_leader") == 1
    status, jobs, headers = refused(leader, "GET", "/v1/jobs")
    assert status == 200 and jobs["jobs"] == [] and LEADER_HEADER not in headers, (status, jobs, headers)
    assert (await upgrade(leader))[0] == 101


async def test_sigterm_hands_over_and_revokes_the_lease(ha: HAServers) -> None:
    ha.start(3)
    old = ha.leader()
    before = leader_kv(ha.etcd, ha.prefix)
    assert before is not None and before["url"] == old.url and before["lease"] != 0
    assert lease_ttl(ha.etcd, before["lease"]) > 0
    assert ha.stop(old) == 0, old.text()[-2000:]  # SIGTERM: exits 0
    new = ha.leader()
    after = leader_kv(ha.etcd, ha.prefix)
    assert after is not None and after["url"] == new.url, after
    assert after["lease"] != before["lease"] and after["term"] > before["term"], (before, after)
    # revoked, not left to expire: etcd no longer knows the old lease
    assert lease_ttl(ha.etcd, before["lease"]) == -1
    assert "leadership handed over: lease revoked" in old.text()


def _in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


async def test_a_paused_leader_is_fenced(ha: HAServers, agents: Agents) -> None:
    """SIGSTOP the leader past its lease: another is elected and changes things;
    the old one, resumed with a join and a cordon waiting in its sockets,
    serves nothing and writes nothing in etcd after the new term began."""
    ha.start(3)
    old = ha.leader()
    old_kv = leader_kv(ha.etcd, ha.prefix)
    assert old_kv is not None
    # a job waiting for its second node on the old leader
    waiting = await agents.connect(old)
    await waiting.send(join_msg("fenced", "n1", (2, 2)))
    await waiting.expect("joined", timeout=10)
    second = await agents.connect(old)
    writes_before = len(fenced(ha))

    os.kill(old.pid, signal.SIGSTOP)
    paused_at = time.monotonic()
    try:
        # queued in the stopped process's sockets: a join that would form a round, and a cordon
        await second.send(join_msg("fenced", "n2", (2, 2)))
        # (answered only once the process runs again: a deadline past the whole pause)
        cordon, cordon_out = _in_thread(
            lambda: refused(old, "POST", "/v1/hosts/late/cordon", {"reason": "late"}, timeout=60)
        )
        new = ha.leader(timeout=10 * TTL, exclude=(old,))
        new_kv = leader_kv(ha.etcd, ha.prefix)
        assert new_kv is not None and new_kv["url"] == new.url and new_kv["term"] > old_kv["term"], new_kv
        assert post(new, "/v1/hosts/h9/cordon", {"reason": "maintenance"})["cordoned"] is True
        # paused for more than 2 TTLs in all (a duration, not a condition: nothing to poll)
        time.sleep(max(0.0, paused_at + 2.5 * TTL - time.monotonic()))
    finally:
        os.kill(old.pid, signal.SIGCONT)
    cordon.join(30)
    assert cordon_out, "the cordon sent to the paused leader got no answer"
    status, answer, _ = cordon_out[0]
    assert status == 503 and answer["code"] == "not_leader", (status, answer)
    status, answer, _ = refused(old, "GET", "/v1/jobs")
    assert status == 503 and answer["code"] == "not_leader", (status, answer)
    wait_until(lambda: (old.health() or {}).get("leader") == new.url, 10, "the old leader naming the new one")
    assert (old.health() or {}).get("role") == "follower"
    await dropped(waiting)  # its agents were dropped
    writes = fenced(ha)
    late = [w for w in writes if w[2] == old_kv["id"] and w[0] > new_kv["term"]]
    assert not late, f"the old leader wrote after term {new_kv['term']} began: {late}"
    assert len(writes) > writes_before  # the new leader's cordon, at least
    assert record(ha.etcd, ha.prefix + "hosts/late") is None
    # the new leader has the job as the old one saved it: one node waiting, no round formed
    view = new.get("/v1/jobs/fenced")
    assert view["round"] == 0 and [n["node_id"] for n in view["nodes"]] == ["n1"], view
    assert "leadership lost" in old.text(), old.text()[-2000:]


async def test_what_a_leader_answered_survives_its_kill(ha: HAServers, agents: Agents) -> None:
    ha.start(3)
    a = ha.leader()
    await agents.form(a, "kept", ["k1", "k2"])
    await agents.form(a, "done", ["d1"])
    assert post(a, "/v1/hosts/bad-host/cordon", {"reason": "bad disk"})["cordoned"] is True
    host_record = record(ha.etcd, ha.prefix + "hosts/bad-host")
    assert host_record is not None and host_record["record"]["cordoned"] is True, host_record
    closed = post(a, "/v1/jobs/done/close")
    saved = job_record(ha.etcd, ha.prefix, "done")  # read right after the answer
    assert saved is not None and saved["state"] == "closed", (closed, saved)
    kept = job_record(ha.etcd, ha.prefix, "kept")
    assert kept is not None and kept["state"] == "running", kept

    ha.kill9(a)
    b = ha.leader(timeout=10 * TTL)
    assert b is not a
    view = b.get("/v1/jobs/kept")
    assert view["state"] == "running" and view["round"] == 0, view
    assert {n["node_id"] for n in view["nodes"]} == {"k1", "k2"}, view
    assert b.get("/v1/jobs/done")["state"] == "closed"
    host = b.get("/v1/hosts/bad-host")
    assert host["cordoned"] is True and host["cordon_reason"] == "bad disk", host
    fenced(ha)


async def test_no_etcd_quorum_no_serving(ha: HAServers, agents: Agents) -> None:
    """2 of 3 etcd members paused: the leader stops serving (drops its agents,
    refuses the upgrade, names no leader); resumed: a replica serves again."""
    ha.start(3)
    old = ha.leader()
    connected = (await agents.form(old, "q", ["q1"]))[0]
    paused = [1, 2]
    for i in paused:
        ha.etcd.pause(i)
    try:
        wait_until(lambda: (old.health() or {}).get("role") == "follower", 10 * TTL, "the leader stepping down")
        await dropped(connected)
        assert [r.role() for r in ha.replicas] == ["follower"] * 3
        status, headers = await upgrade(old)
        assert status == 503 and LEADER_HEADER not in headers, (status, headers)
        status, answer, headers = refused(old, "GET", "/v1/jobs/q")
        assert status == 503 and answer["code"] == "not_leader" and LEADER_HEADER not in headers, (answer, headers)
        assert metric(old, "rdzv_ha_leader") == 0
    finally:
        for i in paused:
            ha.etcd.resume(i)
    new = ha.leader(timeout=30)
    assert new.get("/v1/jobs/q")["state"] == "running"  # (its node has a heartbeat timeout to come back)
    assert (await upgrade(new))[0] == 101
    # and it stays the only one: the leases etcd restored after the outage expire or are
    # renewed within a few TTLs; never two replicas saying leader at once meanwhile
    end = time.monotonic() + 3 * TTL
    while time.monotonic() < end:
        roles = ha.roles()
        assert list(roles.values()).count("leader") <= 1, roles
        time.sleep(0.05)
    assert ha.leader() is new
    fenced(ha)


async def test_delete_removes_the_key(ha: HAServers, agents: Agents) -> None:
    ha.start(2)
    leader = ha.leader()
    await agents.form(leader, "gone", ["g1"])
    status, answer, _ = refused(leader, "DELETE", "/v1/jobs/gone")
    assert status == 409, answer  # live: refused, the key stays
    assert record(ha.etcd, ha.prefix + "jobs/gone") is not None
    post(leader, "/v1/jobs/gone/close")
    status, answer, _ = refused(leader, "DELETE", "/v1/jobs/gone")
    assert status == 200, answer
    assert ha.etcd.get(ha.prefix + "jobs/gone") is None
    assert refused(leader, "GET", "/v1/jobs/gone")[0] == 404
    writes = fenced(ha)
    assert writes[-1][1:3] == (ha.prefix + "jobs/gone", ""), writes  # the last write: the delete


async def test_retention_removes_the_key(ha: HAServers, agents: Agents) -> None:
    """--retain-finished on an HA leader: a finished job's key goes from etcd,
    so the next leader does not bring the job back."""
    ha.start(2, flags=("--retain-finished", "1s"))
    leader = ha.leader()
    await agents.form(leader, "old", ["o1"])
    await agents.form(leader, "live", ["l1"])
    post(leader, "/v1/jobs/old/close")
    wait_until(lambda: ha.etcd.get(ha.prefix + "jobs/old") is None, 20, "the finished job's key removed")
    assert refused(leader, "GET", "/v1/jobs/old")[0] == 404
    ha.kill9(leader)
    new = ha.leader(timeout=10 * TTL)
    assert refused(new, "GET", "/v1/jobs/old")[0] == 404
    assert new.get("/v1/jobs/live")["state"] == "running"
    fenced(ha)


@pytest.mark.parametrize(
    "value",
    [
        b"not json",
        b'{"url": "ftp://elsewhere", "id": "x"}',
        b'{"url": 5}',
        b'{"url": "http://a.example\\r\\nSet-Cookie: x=1", "id": "x"}',
        b'{"url": "http://\\u00e9t\\u00e9.example", "id": "x"}',
    ],
    ids=["garbage", "not-http", "not-a-string", "crlf", "non-ascii"],
)
async def test_a_foreign_leader_key_is_never_named(ha: HAServers, value: bytes) -> None:
    """A leader key that is not a replica's (no lease: it never goes away): the
    replica never leads, answers not_leader, and names no leader unless the
    value is an http(s) URL, which it then sends escaped (one header line).
    The key first names a plain URL, so that the replica is seen reading it."""
    first = "http://127.0.0.1:9"
    ha.etcd.put(ha.prefix + "leader", json.dumps({"url": first, "id": "someone"}))
    r = ha.start_replica()

    def leader_header() -> str | None:
        status, answer, headers = refused(r, "GET", "/v1/jobs")
        assert status == 503 and answer["code"] == "not_leader", (status, answer)
        assert "Set-Cookie" not in headers, headers
        return headers.get(LEADER_HEADER)

    wait_until(lambda: leader_header() == first, 10, "the replica naming the key's URL")
    ha.etcd.put(ha.prefix + "leader", value)
    if b"http://" in value:
        named = wait_until(lambda: (lambda h: h if h != first else None)(leader_header()), 10, "the new header")
        assert "\r" not in named and "\n" not in named, named
        assert named.startswith("http://"), named
    else:
        wait_until(lambda: leader_header() is None, 10, "no leader named")
        h = r.health()
        assert h is not None and h["role"] == "follower" and h["leader"] is None, h
        status, upgrade_headers = await upgrade(r)
        assert status == 503 and LEADER_HEADER not in upgrade_headers, (status, upgrade_headers)
    assert r.running and r.role() == "follower"
    assert ha.etcd.get(ha.prefix + "leader") == value  # nobody took it over


async def test_unknown_leader_is_not_named(ha: HAServers) -> None:
    """A replica started while etcd has no quorum knows no leader: it names none."""
    for i in (1, 2):
        ha.etcd.pause(i)
    try:
        r = ha.start_replica()
        wait_until(lambda: "etcd: campaign" in r.text(), 20, "a failed read of the leader key")
        status, answer, headers = refused(r, "GET", "/v1/jobs")
        assert status == 503 and answer["code"] == "not_leader" and LEADER_HEADER not in headers, (answer, headers)
        h = r.health()
        assert h is not None and h["role"] == "follower" and h["leader"] is None, h
        status, headers = await upgrade(r)
        assert status == 503 and LEADER_HEADER not in headers, (status, headers)
    finally:
        for i in (1, 2):
            ha.etcd.resume(i)
    assert ha.leader(timeout=30) is r


async def test_prefixes_are_separate_deployments(ha: HAServers, agents: Agents) -> None:
    other = HAServers(ha.cluster, ha.etcd, prefix=ha.prefix.rstrip("/") + "-b/", lease_ttl=int(TTL))
    ha.start(2)
    for i in range(2):
        other.start_replica(name=f"other{i}")  # its own log files
    la, lb = ha.leader(), other.leader()
    assert leader_kv(ha.etcd, ha.prefix)["url"] == la.url  # type: ignore[index]
    assert leader_kv(ha.etcd, other.prefix)["url"] == lb.url  # type: ignore[index]
    await agents.form(la, "only-a", ["a1"])
    await agents.form(lb, "only-b", ["b1"])
    post(la, "/v1/hosts/ha/cordon", {"reason": "a"})
    assert la.get("/v1/jobs/only-a")["state"] == "running"
    assert refused(lb, "GET", "/v1/jobs/only-a")[0] == 404
    assert refused(la, "GET", "/v1/jobs/only-b")[0] == 404
    assert [j["job_id"] for j in lb.get("/v1/jobs")["jobs"]] == ["only-b"]
    assert lb.get("/v1/hosts")["hosts"] == []
    assert ha.etcd.get(ha.prefix + "jobs/only-a") is not None
    assert ha.etcd.get(other.prefix + "jobs/only-a") is None
    for f in (r for r in ha.replicas if r is not la):
        assert refused(f, "GET", "/v1/jobs")[2].get(LEADER_HEADER) == la.url
    for f in (r for r in other.replicas if r is not lb):
        assert refused(f, "GET", "/v1/jobs")[2].get(LEADER_HEADER) == lb.url
    assert {k for _, k, _, _ in fenced(ha)} == {ha.prefix + "jobs/only-a", ha.prefix + "hosts/ha"}
    assert {k for _, k, _, _ in fenced(other)} == {other.prefix + "jobs/only-b"}


async def test_a_write_in_a_lost_term_is_refused_by_etcd(etcd_cluster: EtcdCluster) -> None:
    """The last line of the fence, alone: a replica that still believes it
    leads (its lease alive, so its own checks pass) writes in a term whose
    leader key was replaced behind its back. etcd refuses the transaction
    (the compare on the key's create revision), nothing is written, and the
    replica steps down naming the new leader. (In the process tests above the
    replica's own lease checks stop it first.)"""
    from rdzv_common.errors import NotLeaderError
    from rdzv_server import etcd as etcd_client
    from rdzv_server.ha import Replica as HAReplica

    prefix = "/fence-unit/"
    deposed: list[str] = []
    r = HAReplica(etcd_client.EtcdClient(etcd_cluster.endpoints), "http://127.0.0.1:1", prefix, 2)
    r.on_deposed = deposed.append
    await r.start()
    try:
        deadline = time.monotonic() + 20
        while not r.serving:
            assert time.monotonic() < deadline, "the replica never led"
            await asyncio.sleep(0.05)
        await r.write([etcd_client.put(f"{prefix}jobs/before".encode(), b'{"n":1}')])  # in its term: written
        assert record(etcd_cluster, prefix + "jobs/before") is not None
        # another leadership, behind its back: the key deleted and created again
        etcd_cluster.call("/v3/kv/deleterange", {"key": b64(prefix + "leader")})
        etcd_cluster.put(prefix + "leader", json.dumps({"url": "http://127.0.0.1:2", "id": "other"}))
        assert r.serving  # its lease lives: only etcd can tell
        with pytest.raises(NotLeaderError) as e:
            await r.write([etcd_client.put(f"{prefix}jobs/after".encode(), b'{"n":2}')])
        assert e.value.leader == "http://127.0.0.1:2"
        assert etcd_cluster.get(prefix + "jobs/after") is None
        assert not r.serving and r.role == "follower" and deposed, (r.role, deposed)
    finally:
        await r.stop()
