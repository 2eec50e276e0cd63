"""The store's database: one SQLite file in the data dir, a job as a pointer row
and the blobs it names (:mod:`rdzv_server.joblog`: a base and deltas, so that a
round change writes what changed), and the checks that make a data dir usable
(writable, locked, not corrupt). A job row of the older layout (its whole
record) loads as it always did.

Synchronous on purpose: writes are small and rare (once per round change), and
must finish before anyone is told (see :mod:`rdzv_server.store`)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import sqlite3
from pathlib import Path

from rdzv_common.protocol import RdzvError

from . import joblog, rounds
from .hosts import HostRecord
from .rounds import Job


class DataDirError(RdzvError):
    """The data directory or its database cannot be used; the server must not start."""


_SQLITE_CORRUPT, _SQLITE_NOTADB = 11, 26  # primary result codes that mean a damaged or foreign file


def _is_corruption(e: sqlite3.DatabaseError) -> bool:
    code = getattr(e, "sqlite_errorcode", None)  # Python 3.11+
    if code is not None:
        return code & 0xFF in (_SQLITE_CORRUPT, _SQLITE_NOTADB)
    text = str(e).lower()
    return "not a database" in text or "malformed" in text


def free_bytes(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _free_space(path: Path) -> str:
    try:
        st = os.statvfs(path)
    except OSError:
        return "free space unknown"
    return f"{st.f_bavail * st.f_frsize} bytes free"


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _lock_data_dir(data_dir: Path) -> int:
    """Take ``<data dir>/rdzv.lock`` (flock, exclusive, non-blocking) and write
    our pid into it; return its descriptor, held (and the lock with it) until
    closed. One server per data dir: a second one would split the jobs' state."""
    path = data_dir / "rdzv.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise DataDirError(f"cannot create lock file {path}: {e.strerror or e}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        try:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        except OSError:
            holder = "unknown"
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise DataDirError(
                f"data dir {data_dir} is in use by another rdzv-server (pid {holder}, "
                f"lock {path}); stop it first, or use another --data-dir"
            ) from e
        raise DataDirError(f"cannot lock {path}: {e.strerror or e}") from e
    pid = f"{os.getpid()}\n".encode()
    try:  # in place, then cut: a full disk keeps the file's block
        os.pwrite(fd, pid, 0)
        os.ftruncate(fd, len(pid))
    except OSError:
        pass  # the lock holds anyway; a second server just cannot name us
    return fd


class Database:
    """A pointer row per job and the blobs it names (``job_data``), one
    transaction per write. Synchronous: writes are small and rare (once per
    round change), and must finish before anyone is told.

    The data dir is locked for the database's life (``rdzv.lock``), and the
    database file is created 0600 (SQLite gives its -wal and -shm the same mode)."""

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / "rdzv.db"
        self.lock_fd: int | None = None
        try:
            data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise DataDirError(f"cannot create data dir {data_dir}: {e.strerror or e}") from e
        if not os.access(data_dir, os.W_OK | os.X_OK):
            if _read_only(data_dir):
                raise DataDirError(f"data dir {data_dir} is on a read-only file system")
            raise DataDirError(f"data dir {data_dir} is not writable by this user (uid {os.getuid()})")
        existed = self.path.exists()
        self.lock_fd = _lock_data_dir(data_dir)
        conn: sqlite3.Connection | None = None
        try:
            self._private_file()
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            ok = conn.execute("PRAGMA quick_check").fetchone()[0]
            if ok != "ok":
                raise DataDirError(f"database {self.path} is corrupt ({ok}); move it away to start empty")
            conn.execute(
                "CREATE TABLE IF NOT EXISTS jobs"
                " (job_id TEXT PRIMARY KEY, record TEXT NOT NULL, updated_at REAL NOT NULL)"
            )
            conn.execute(
                "CREATE TABLE IF NOT EXISTS job_data (job_id TEXT NOT NULL, gen INTEGER NOT NULL,"
                " chunk INTEGER NOT NULL, data TEXT NOT NULL, PRIMARY KEY (job_id, gen, chunk))"
            )
            conn.execute(
                "CREATE TABLE IF NOT EXISTS hosts "
                "(host TEXT PRIMARY KEY, record TEXT NOT NULL, updated_at REAL NOT NULL)"
            )
        except (sqlite3.DatabaseError, DataDirError) as e:
            if conn is not None:
                conn.close()
            self._unlock()
            if isinstance(e, DataDirError):
                raise
            if existed and not _is_corruption(e):
                # A full, read-only or failing file system: the file may be fine.
                # Never tell the operator to throw away a database that holds jobs.
                raise DataDirError(
                    f"cannot open database {self.path} ({e}): the file system refused "
                    f"({_free_space(data_dir)}); is it full or read-only? Fix that and start again; "
                    "keep the file, it holds the jobs' state"
                ) from e
            raise DataDirError(
                f"cannot open database {self.path} ({e}); "
                + (
                    "it exists but is unreadable or corrupt: move it away to start empty, or restore a backup"
                    if existed
                    else "check the data dir"
                )
            ) from e
        self.conn: sqlite3.Connection = conn
        self.written: dict[str, joblog.Written] = {}  # each job as the database holds it (filled by load)
        self.written_rows = self.written_chars = 0  # node rows and characters written, for benches

    def _private_file(self) -> None:
        """Create the database file 0600 (SQLite would use 0644 under the usual
        umask); tighten an existing one and its -wal/-shm."""
        for path in (
            self.path,
            self.path.with_name(self.path.name + "-wal"),
            self.path.with_name(self.path.name + "-shm"),
        ):
            try:
                if path == self.path and not path.exists():
                    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
                elif path.exists() and path.stat().st_mode & 0o077:
                    path.chmod(0o600)
            except OSError:
                pass  # a read-only or full file system: the open below says so

    def _unlock(self) -> None:
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None

    def load(self) -> dict[str, Job]:
        """Every job (raises DataDirError on one that cannot be read)."""
        jobs = {}
        try:
            rows = self.conn.execute("SELECT job_id, record, updated_at FROM jobs").fetchall()
            data: dict[str, dict[tuple[int, int], str]] = {}
            for job_id, gen, chunk, text in self.conn.execute("SELECT job_id, gen, chunk, data FROM job_data"):
                data.setdefault(job_id, {})[(gen, chunk)] = text
        except sqlite3.DatabaseError as e:
            raise DataDirError(f"cannot read database {self.path}: {e}") from e
        for job_id, record, updated_at in rows:
            try:
                d = json.loads(record)
                if joblog.is_pointer(d):
                    written = joblog.assemble(d, data.get(job_id, {}))
                    job = joblog.to_job(written.snap)
                else:  # the older layout: the whole record; the next write makes a base
                    job = rounds.from_record(d)
                    written = joblog.Written(joblog.snapshot(job, float(updated_at)))
            except Exception as e:  # any shape error means the file is not ours or damaged
                raise DataDirError(f"database {self.path}: job {job_id!r} cannot be loaded ({e!r})") from e
            jobs[job_id] = job
            self.written[job_id] = written
        return jobs

    def last(self, job_id: str) -> Job | None:
        """The job as last written (None: never, or removed)."""
        written = self.written.get(job_id)
        return None if written is None else joblog.to_job(written.snap)

    def save(self, job: Job, now: float) -> None:
        """Write what changed since the job was last written, in one transaction."""
        prev = self.written.get(job.job_id)
        plan = joblog.plan(prev, joblog.snapshot(job, now, prev.snap if prev is not None else None))
        self.conn.execute("BEGIN")
        try:
            self.conn.executemany(
                "INSERT OR REPLACE INTO job_data (job_id, gen, chunk, data) VALUES (?, ?, ?, ?)",
                [(job.job_id, gen, chunk, text) for gen, chunk, text in plan.blobs],
            )
            self.conn.execute(
                "INSERT INTO jobs (job_id, record, updated_at) VALUES (?, ?, ?) "
                "ON CONFLICT(job_id) DO UPDATE SET record=excluded.record, updated_at=excluded.updated_at",
                (job.job_id, json.dumps(plan.pointer, separators=(",", ":")), now),
            )
            if plan.drop_below is not None:
                self.conn.execute("DELETE FROM job_data WHERE job_id=? AND gen<?", (job.job_id, plan.drop_below))
            self.conn.execute("COMMIT")
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.written[job.job_id] = plan.written
        self.written_rows += plan.nodes
        self.written_chars += plan.chars

    def delete(self, job_ids: list[str]) -> None:
        """Remove jobs' rows, all in one transaction (one sync to disk)."""
        self.conn.execute("BEGIN")
        try:
            self.conn.executemany("DELETE FROM jobs WHERE job_id=?", [(j,) for j in job_ids])
            self.conn.executemany("DELETE FROM job_data WHERE job_id=?", [(j,) for j in job_ids])
            self.conn.execute("COMMIT")
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        for job_id in job_ids:
            self.written.pop(job_id, None)

    def load_hosts(self) -> list[HostRecord]:
        try:
            rows = self.conn.execute("SELECT host, record FROM hosts").fetchall()
        except sqlite3.DatabaseError as e:
            raise DataDirError(f"cannot read database {self.path}: {e}") from e
        out = []
        for host, record in rows:
            try:
                out.append(HostRecord.from_record(json.loads(record)))
            except Exception as e:  # any shape error means the file is not ours or damaged
                raise DataDirError(f"database {self.path}: host {host!r} cannot be loaded ({e!r})") from e
        return out

    def save_hosts(self, records: list[HostRecord], removed: list[str]) -> None:
        """Write changed host records and delete evicted ones, in one transaction."""
        self.conn.execute("BEGIN")
        try:
            self.conn.executemany("DELETE FROM hosts WHERE host=?", [(h,) for h in removed])
            self.conn.executemany(
                "INSERT INTO hosts (host, record, updated_at) VALUES (?, ?, ?) "
                "ON CONFLICT(host) DO UPDATE SET record=excluded.record, updated_at=excluded.updated_at",
                [(r.host, json.dumps(r.to_record(), separators=(",", ":")), r.updated_at) for r in records],
            )
            self.conn.execute("COMMIT")
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self.conn.close()
        self._unlock()
