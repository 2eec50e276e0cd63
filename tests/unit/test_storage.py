"""The storage seam (rdzv_server.storage): the SQLite backend against a real
file, and the store's one put-back path driven through a backend whose writes
fail on demand (an in-memory backend that keeps what it was given). The etcd
backend is exercised against a real etcd cluster in tests/ha."""

from __future__ import annotations

import sqlite3

import pytest

from rdzv_common.protocol import JobSpec, JobState, UnavailableError
from rdzv_server import rounds
from rdzv_server.database import Database
from rdzv_server.rounds import Job
from rdzv_server.storage import MemoryBackend, SqliteBackend, WriteError, decode, record_text
from rdzv_server.store import Store, StoreSettings
from tests.unit.test_store_runs import Recorder, join


class Closing(Recorder):
    def __init__(self) -> None:
        super().__init__()
        self.dropped = False

    def drop(self) -> None:
        self.dropped = True


class Kept(MemoryBackend):
    """In memory, but keeping every record it was given; ``fail``: the next writes fail at once."""

    durable = True

    def __init__(self) -> None:
        self.records: dict[str, str] = {}
        self.fail = False

    def write_job(self, job: Job, now: float) -> None:
        if self.fail:
            raise WriteError("injected: disk full")
        self.records[job.job_id] = record_text(job)

    def remove_jobs(self, job_ids: list[str]) -> None:
        if self.fail:
            raise WriteError("injected: disk full")
        for job_id in job_ids:
            self.records.pop(job_id, None)

    def last(self, job_id: str) -> Job | None:
        return decode(self.records.get(job_id))


def test_sqlite_backend_writes_reads_back_and_removes(tmp_path) -> None:
    db = Database(tmp_path)
    backend = SqliteBackend(db)
    job = rounds.new_job("j", JobSpec(min_nodes=1, max_nodes=2), 5.0)
    assert backend.durable and backend.last("j") is None and backend.where == str(db.path)
    backend.write_job(job, 5.0)
    again = backend.last("j")
    assert again is not None and rounds.to_record(again) == rounds.to_record(job)
    ran: list[str] = []
    backend.after("j", lambda: ran.append("published"))
    assert ran == ["published"]  # durable at once
    backend.remove_jobs(["j"])
    assert backend.last("j") is None
    backend.close()


def test_a_failed_sqlite_write_is_a_write_error(tmp_path, monkeypatch) -> None:
    db = Database(tmp_path)
    backend = SqliteBackend(db)

    def broken(job: Job, now: float) -> None:
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(db, "save", broken)
    with pytest.raises(WriteError, match="disk I/O error"):
        backend.write_job(rounds.new_job("j", JobSpec(min_nodes=1, max_nodes=1), 0.0), 0.0)
    backend.close()


def test_a_failed_write_puts_the_job_back_as_last_written() -> None:
    """One put-back path: a report whose write fails leaves the job as its
    backend last holds it, its agents reconnect, and nothing is published."""
    clock = [100.0]
    store = Store(StoreSettings(), clock=lambda: clock[0])
    store.backend = backend = Kept()
    spec = JobSpec(min_nodes=2, max_nodes=2)
    a, b = Closing(), Closing()
    store.join(join("a", spec), a)
    store.join(join("b", spec), b)  # the round completes: written
    assert store.jobs["j"].state == JobState.RUNNING and "j" in backend.records
    published = store.events.next_id
    backend.fail = True
    with pytest.raises(UnavailableError):
        store.succeed("j", "a", 0)
    job = store.jobs["j"]
    assert job.state == JobState.RUNNING and job.nodes["a"].state == rounds.RUNNING  # as last written
    assert a.dropped and b.dropped and not store.channels  # they reconnect and re-send
    assert store.events.next_id == published  # nothing said of the refused step
    assert "j" in store.active and "j" in store.due  # due again for the tick


def test_a_new_job_whose_write_fails_is_forgotten_and_its_agent_told_why() -> None:
    store = Store(StoreSettings(), clock=lambda: 50.0)
    store.backend = backend = Kept()
    backend.fail = True
    chan = Closing()
    with pytest.raises(UnavailableError):
        store.join(join("a", JobSpec(min_nodes=1, max_nodes=1)), chan)
    assert "j" not in store.jobs and "j" not in store.active and not store.reads.summaries()[0]
    assert chan.dropped and chan.msgs[-1].op == "error" and chan.msgs[-1].code == "unavailable"


def test_a_removal_that_fails_keeps_the_job() -> None:
    store = Store(StoreSettings(), clock=lambda: 50.0)
    store.backend = backend = Kept()
    store.join(join("a", JobSpec(min_nodes=1, max_nodes=1)), Closing())
    store.succeed("j", "a", 0)
    backend.fail = True
    with pytest.raises(UnavailableError, match="cannot delete"):
        store.retention.delete_job("j")
    assert store.jobs["j"].finished and [s.job_id for s in store.reads.summaries()[0]] == ["j"]
    backend.fail = False
    store.retention.delete_job("j")
    assert "j" not in store.jobs and "j" not in backend.records
