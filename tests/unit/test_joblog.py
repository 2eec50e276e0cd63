"""A job in storage as a base and deltas (rdzv_server.joblog, issue 24): what
a round change writes, measured at the seam (the SQL the database runs, the
operations the etcd replica sends), that records of the older layout load,
and that a write spanning several etcd requests never shows half a round.

The etcd side runs the real Replica and EtcdBackend over an in-memory
stand-in for etcd's transactions (a unit); tests/ha/test_job_layout.py runs
them against a real etcd cluster."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from hypothesis.stateful import invariant

from rdzv_common.protocol import JobSpec
from rdzv_server import etcd, joblog, rounds
from rdzv_server.database import Database
from rdzv_server.ha import Replica
from rdzv_server.storage import EtcdBackend
from rdzv_server.store import Store, StoreSettings
from tests.unit.test_rounds_property import PHASES, RoundsMachine
from tests.unit.test_store_runs import Recorder, join

OLD_RECORD = Path(__file__).parent / "data" / "job_record_v1.json"  # written by the code before this layout
VOLATILE = ("last_seen", "connected", "lost_deadline", "dropped", "graced")


def kept(job: rounds.Job) -> dict[str, Any]:
    """The job's record less what only matters while connected (restored on load)."""
    rec = json.loads(json.dumps(rounds.to_record(job)))
    for node in rec["nodes"]:
        for name in VOLATILE:
            node.pop(name)
    return rec


def ids(n: int) -> list[str]:
    return [f"n{i:05d}" for i in range(n)]


def form(store: Store, n: int) -> tuple[dict[str, Recorder], JobSpec]:
    """Job j of ``n`` nodes, running; their channels."""
    spec = JobSpec(min_nodes=n - 1, max_nodes=n)
    chans = {nid: Recorder() for nid in ids(n)}
    for nid, chan in chans.items():
        store.join(join(nid, spec), chan)
    assert store.jobs["j"].state.value == "running" and len(store.jobs["j"].order) == n
    return chans, spec


def secrets_of(chans: dict[str, Recorder]) -> dict[str, str]:
    """The node secrets the nodes were told (once their joins were written)."""
    return {nid: next(m.node_secret for m in c.msgs if m.op == "joined") for nid, c in chans.items()}


def lose_one(store: Store, n: int, chans: dict[str, Recorder], secrets: dict[str, str], spec: JobSpec) -> str:
    """A node-loss round change: a member in the middle leaves, the others rejoin, the round completes."""
    lost = ids(n)[n // 2]
    store.leave("j", lost, "bye", chans[lost])
    for nid in ids(n):
        if nid != lost:
            store.join(join(nid, spec, node_secret=secrets[nid]), chans[nid])
    job = store.jobs["j"]
    assert job.state.value == "running" and job.round == 1 and len(job.order) == n - 1
    return lost


# ------------------------------------------------------- the seam: SQLite


@pytest.mark.parametrize("n", [64, 512])
def test_a_node_loss_round_change_writes_only_the_lost_node_to_sqlite(tmp_path: Path, n: int) -> None:
    """What the database is told to write (the SQL it runs, values bound) names
    only the lost node, and its size does not grow with the job (before:
    every node's record, twice: ~300 bytes a node)."""
    store = Store(StoreSettings(data_dir=tmp_path), clock=lambda: 1000.0)
    store.open()
    chans, spec = form(store, n)
    secrets = secrets_of(chans)
    db = store.db
    assert db is not None
    statements: list[str] = []
    db.conn.set_trace_callback(statements.append)
    lost = lose_one(store, n, chans, secrets, spec)
    db.conn.set_trace_callback(None)
    written = "".join(statements)
    assert {i for i in ids(n) if i in written} == {lost}
    assert len(written) < 4000, len(written)
    job = store.jobs["j"]
    store.backend.close()
    again = Database(tmp_path)
    assert kept(again.load()["j"]) == kept(job)
    again.close()


def test_a_record_of_the_older_layout_loads_and_its_next_write_is_a_base(tmp_path: Path) -> None:
    """A data dir written before this layout (its schema, one row holding the
    whole record, as the code before wrote it) loads as it did; the next write
    makes a base, and that loads the same."""
    text = OLD_RECORD.read_text().strip()
    conn = sqlite3.connect(tmp_path / "rdzv.db")  # the tables as the code before made them
    conn.execute("CREATE TABLE jobs (job_id TEXT PRIMARY KEY, record TEXT NOT NULL, updated_at REAL NOT NULL)")
    conn.execute("CREATE TABLE hosts (host TEXT PRIMARY KEY, record TEXT NOT NULL, updated_at REAL NOT NULL)")
    conn.execute("INSERT INTO jobs VALUES ('j', ?, 1012.0)", (text,))
    conn.commit()
    conn.close()
    db = Database(tmp_path)
    job = db.load()["j"]
    assert rounds.to_record(job) == json.loads(text)  # exactly as it was written
    assert db.last("j") is not None and kept(db.last("j")) == kept(job)
    job.nodes["n1"].note = "changed"
    db.save(job, 1013.0)
    pointer = json.loads(db.conn.execute("SELECT record FROM jobs").fetchone()[0])
    assert pointer == {"layout": 2, "gen": 1, "base": 1, "chunks": 1}
    db.close()
    db = Database(tmp_path)
    assert kept(db.load()["j"]) == kept(job)
    db.close()


def test_the_chain_is_compacted_into_a_base_and_old_blobs_go(tmp_path: Path) -> None:
    """Deltas accumulate until they are as large as the base; then a base is
    written and every blob below it deleted (in the same transaction)."""
    db = Database(tmp_path)
    job = rounds.new_job("j", JobSpec(min_nodes=1, max_nodes=1), 0.0)
    gens = []
    for i in range(40):
        job.restarts = i  # one small change a write
        db.save(job, float(i))
        gens.append(db.written["j"].gen - db.written["j"].base)
        stored = {g for (g,) in db.conn.execute("SELECT gen FROM job_data")}
        w = db.written["j"]
        assert stored == set(range(w.base, w.gen + 1))  # nothing but what the pointer names
    assert max(gens) > 1 and 0 in gens[1:]  # deltas, and bases again
    db.close()
    db = Database(tmp_path)
    assert kept(db.load()["j"]) == kept(job)
    db.delete(["j"])  # the pointer and every blob
    assert db.conn.execute("SELECT count(*) FROM job_data").fetchone()[0] == 0 and db.last("j") is None
    db.close()


# --------------------------------------------------------- the seam: etcd


class MemEtcd:
    """etcd's key space and transactions in memory (what Replica uses of the
    client); ``fail_at``: the n-th transaction from now raises, as an etcd
    that timed out; ``txns``: every transaction's operations."""

    def __init__(self) -> None:
        self.kv: dict[bytes, bytes] = {}
        self.txns: list[list[dict[str, Any]]] = []
        self.fail_at: int | None = None
        self.timeout_s = etcd.DEFAULT_TIMEOUT_S  # a request's time limit, as the client's (Replica.write_timeout)

    async def txn(
        self, compare: Any, success: list[dict[str, Any]], failure: Any = None, timeout_s: float | None = None
    ) -> etcd.TxnResult:
        if self.fail_at is not None:
            self.fail_at -= 1
            if self.fail_at < 0:
                self.fail_at = None
                raise etcd.EtcdUnavailable("injected: a transaction timed out")
        self.txns.append(success)
        for op in success:
            if "request_put" in op:
                body = op["request_put"]
                self.kv[etcd.unb64(body["key"])] = etcd.unb64(body["value"])
            else:
                body = op["request_delete_range"]
                start = etcd.unb64(body["key"])
                end = etcd.unb64(body["range_end"]) if "range_end" in body else None
                for k in [k for k in self.kv if k == start or (end is not None and start <= k < end)]:
                    del self.kv[k]
        return etcd.TxnResult(True, len(self.txns), [])

    async def revision(self, key: bytes) -> int:
        return len(self.txns)

    async def range_prefix(self, prefix: bytes, revision: int = 0) -> tuple[list[etcd.KeyValue], int]:
        assert revision in (0, len(self.txns)), "no history kept: only the newest revision reads"
        found = sorted((k, v) for k, v in self.kv.items() if k.startswith(prefix))
        return [etcd.KeyValue(k, v, 1, 1, 0) for k, v in found], len(self.txns)


def leading(mem: MemEtcd) -> Replica:
    replica = Replica(mem, "http://127.0.0.1:9", "/t/", replica_id="r1")  # type: ignore[arg-type]
    replica.role, replica.ready, replica.term, replica._lease_until = "leader", True, 7, float("inf")
    return replica


def etcd_store(mem: MemEtcd) -> Store:
    store = Store(StoreSettings(), clock=lambda: 1000.0)
    store.replica = replica = leading(mem)
    store.backend = EtcdBackend(replica, store._write_failed)
    return store


def sent(mem: MemEtcd, since: int) -> str:
    """Every key and value the transactions since ``since`` carried, as text."""
    out = []
    for ops in mem.txns[since:]:
        for op in ops:
            body = next(iter(op.values()))
            out.append(etcd.unb64(body["key"]).decode() + etcd.unb64(body.get("value")).decode())
    return "".join(out)


async def loaded(mem: MemEtcd) -> dict[str, rounds.Job]:
    """What a new leader loads."""
    found, _ = await leading(mem).load()
    return {j: job for j, (job, _) in found.items()}


@pytest.mark.parametrize("n", [64, 512])
async def test_a_node_loss_round_change_sends_etcd_only_the_lost_node(n: int) -> None:
    """The same, at the etcd replica: one transaction per round change (each
    fenced, under the limits), naming only the lost node."""
    mem = MemEtcd()
    store = etcd_store(mem)
    chans, spec = form(store, n)
    await store.flushed("j")
    secrets = secrets_of(chans)
    before = len(mem.txns)
    lost = lose_one(store, n, chans, secrets, spec)
    await store.flushed("j")
    written = sent(mem, before)
    assert {i for i in ids(n) if i in written} == {lost}
    assert len(written) < 4000 and len(mem.txns) - before <= 2, (len(written), len(mem.txns) - before)
    assert kept((await loaded(mem))["j"]) == kept(store.jobs["j"])


async def test_a_write_over_one_request_commits_only_with_its_pointer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A base larger than a request goes in several transactions, the pointer
    in the last: one that fails half-way leaves etcd showing the round before
    (what a new leader loads), and the retry commits the new one."""
    monkeypatch.setattr(joblog, "CHUNK_CHARS", 3000)
    monkeypatch.setattr(etcd, "MAX_TXN_BYTES", 9000)
    mem = MemEtcd()
    store = etcd_store(mem)
    form(store, 40)
    await store.flushed("j")
    before = kept(store.jobs["j"])
    assert kept((await loaded(mem))["j"]) == before
    job = store.jobs["j"]
    # the next write: a base (a change as large as the job), cut into several transactions; the 2nd fails
    for node in job.nodes.values():
        node.note = "x" * 100
    mem.fail_at = 1
    n = len(mem.txns)
    store.backend.write_job(job, 1001.0)
    with pytest.raises(Exception, match="could not be saved"):
        await store.flushed("j")
    assert len(mem.txns) == n + 1  # one transaction went through: blobs only
    assert kept((await loaded(mem))["j"]) == before  # not half a round: the round before
    store.backend.write_job(job, 1002.0)  # (put back by the failure; written again)
    await store.flushed("j")
    assert len(mem.txns) - (n + 1) >= 3  # several transactions, none over the limit
    for ops in mem.txns[n + 1 :]:
        size = sum(len(etcd.unb64(next(iter(op.values())).get("value"))) for op in ops)
        assert size <= 9000 * 2
    assert kept((await loaded(mem))["j"]) == kept(job)


async def test_an_etcd_record_of_the_older_layout_loads_and_is_replaced() -> None:
    old = json.loads(OLD_RECORD.read_text())
    mem = MemEtcd()
    mem.kv[b"/t/jobs/j"] = json.dumps({"by": "old", "term": 3, "record": old}).encode()
    store = etcd_store(mem)
    backend = store.backend
    assert isinstance(backend, EtcdBackend)
    jobs, _ = await backend.load()
    assert rounds.to_record(jobs["j"]) == old
    backend.loaded(jobs)
    store._loaded(jobs, [], "etcd")
    store.close_job("j")
    await store.flushed("j")
    assert json.loads(mem.kv[b"/t/jobs/j"])["pointer"]["layout"] == 2
    assert kept((await loaded(mem))["j"]) == kept(store.jobs["j"])
    store.backend.remove_jobs(["j"])
    await store.flushed("j")
    assert mem.kv == {}  # the pointer and every blob


# ----------------------------------------- every record the machine makes


def test_what_a_row_is_made_of_is_immutable() -> None:
    """A row is reused while what it is made of compares equal: those fields must
    hold values that cannot change in place (a list or dict there would be missed)."""
    node = rounds.Node("n", "h", "a", 1, 2, None, 0.0, state=rounds.RUNNING, note="x", replaced="y")
    for name in joblog._ROW_FIELDS + joblog._PLACED:
        assert isinstance(getattr(node, name), (str, int, float, type(None))), name


class LoggedRounds(RoundsMachine):
    """The round machine's random sequences (test_rounds_property), each state
    written through the chain: what storage holds after each write is the job,
    exactly (less what only matters while connected)."""

    written: joblog.Written | None = None
    blobs: dict[tuple[int, int], str]

    @invariant()
    def storage_holds_the_job(self) -> None:
        if self.written is None:
            self.blobs = {}
        snap = joblog.snapshot(self.job, self.now, self.written.snap if self.written is not None else None)
        assert snap == joblog.snapshot(self.job, self.now)  # rows reused from the last are the rows made anew
        plan = joblog.plan(self.written, snap)
        self.blobs.update({(g, c): t for g, c, t in plan.blobs})
        if plan.drop_below is not None:
            self.blobs = {k: v for k, v in self.blobs.items() if k[0] >= plan.drop_below}
        got = joblog.assemble(plan.pointer, self.blobs)
        assert got == plan.written
        assert kept(joblog.to_job(got.snap)) == kept(self.job)
        self.written = plan.written


LoggedRounds.TestCase.settings = settings(
    max_examples=30, stateful_step_count=40, deadline=None, phases=PHASES, report_multiple_bugs=False
)
TestLoggedRounds = pytest.mark.timeout(300)(LoggedRounds.TestCase)


def test_a_node_gone_and_back_between_two_writes_keeps_its_new_place() -> None:
    """A node lost and joined again between two writes is last in the job's
    nodes; a delta would leave it where it was, so a base is written."""
    spec = JobSpec(min_nodes=3, max_nodes=3)
    job = rounds.new_job("j", spec, 0.0)
    for nid in ("a", "b", "c"):
        rounds.join(job, join(nid, spec), 1.0, "s")
    first = joblog.plan(None, joblog.snapshot(job, 1.0))
    node = job.nodes.pop("a")  # (as the machine's move to None does), then back
    job.nodes["a"] = node
    again = joblog.plan(first.written, joblog.snapshot(job, 2.0))
    assert again.drop_below is not None  # a base
    got = joblog.to_job(joblog.assemble(again.pointer, {(g, c): t for g, c, t in again.blobs}).snap)
    assert list(got.nodes) == ["b", "c", "a"]


@pytest.mark.parametrize(
    "value",
    [
        {"node_id": "n1", "host": "gpu-07", "at": 1733300000.123456, "r": None, "ok": True, "ports": [1, 2]},
        {"host": "h\u00f6st-\u4e2d", "quote": 'a"b\\c\n\x00', "tiny": 5e-324, "big": 2**70, "neg": -0.0},
        [1e16, 1e15, 0.1, 1.7976931348623157e308, float("inf"), "\U0001f600"],
    ],
)
def test_storage_json_is_jsons_own_text_and_all_ascii(value: Any) -> None:
    """joblog._dumps writes what ``json.dumps(separators=(",", ":"))`` writes, character for
    character, for what rows hold (a row written before reads back as the same text), and only
    ASCII: a blob is cut in characters into chunks whose size bounds an etcd request, so a
    character is a byte."""
    text = joblog._dumps(value)
    assert text == json.dumps(value, separators=(",", ":")) and text.isascii()


@pytest.mark.parametrize("value", [[1e-7, 2e-05, 0.0001], {"del": "a\x7fb"}, {"lone": "a\ud800b"}])
def test_storage_json_where_its_text_differs_gives_the_same_values_in_ascii(value: Any) -> None:
    """Where pydantic_core's text is not json's (a float under 1e-4, DEL raw) the values read back
    the same and the text is ASCII; what it refuses (a lone surrogate) is json's text."""
    text = joblog._dumps(value)
    assert text.isascii() and json.loads(text) == value
    if "lone" in value:
        assert text == json.dumps(value, separators=(",", ":"))


def test_a_loaded_job_is_the_job_written_and_a_damaged_row_is_refused(tmp_path: Path) -> None:
    """A load parses the node rows in one go and takes each saved state by lookup: the job comes
    back as written; a row that is no JSON object, or a state that is none, is an error (the
    store then refuses the data dir), never a job half read."""
    store = Store(StoreSettings(data_dir=tmp_path))
    store.open()
    form(store, 5)
    store.backend.close()
    db = Database(tmp_path)
    loaded = db.load()["j"]
    snap = db.written["j"].snap
    again = joblog.snapshot(loaded, snap.at)  # what storage keeps of the job loaded: the same
    assert (again.head, again.nodes) == (snap.head, snap.nodes) and len(snap.nodes) == 5
    db.close()
    damaged = [dict(snap.nodes, n00001='{"node_id":"n00001"},{"x":1}'), dict(snap.nodes, n00001="7")]
    for nodes in damaged:
        with pytest.raises((ValueError, TypeError, KeyError)):
            joblog.to_job(joblog.Snapshot(snap.head, nodes, snap.at))
    row = json.loads(snap.nodes["n00002"])
    bad = dict(snap.nodes, n00002=json.dumps({**row, "state": "dancing"}, separators=(",", ":")))
    with pytest.raises(ValueError, match="dancing"):
        joblog.to_job(joblog.Snapshot(snap.head, bad, snap.at))
