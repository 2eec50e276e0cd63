"""Fixtures for end-to-end tests: a real ``rdzv-server``, real ``rdzv-agent``
processes and real torch gloo workers (scripts in ``tests/e2e/scripts``).

Each test gets a :class:`Cluster`. Everything it starts is a subprocess:

* the server: ``python -m rdzv_server --host 127.0.0.1 --port <free>
  --data-dir <tmp>``; :meth:`Cluster.start_server` returns once ``/healthz``
  answers;
* agents: ``python -m rdzv_client.agent --endpoint ... --job-id ...
  --local-addr 127.0.0.1 ...``, each in its own session (so its process group
  is its pid), stdout and stderr into one log file per agent.

Teardown kills by pid only, never by name: every agent's process group with
SIGKILL, then every process that carries this cluster's tag in its
environment (``RDZV_E2E_TAG``, inherited by the workers, which lead process
groups of their own and outlive a SIGKILLed agent), then the server.

Waiting is always on a condition with a deadline (:func:`wait_until`, a log
line, an exit, a REST field), polled every few tens of milliseconds.

Network isolation is best effort. torch's TCPStore (hosted by rank 0's worker
on MASTER_PORT) listens on every interface, so two jobs on one host could only
meet through a port collision; ports here are free ports picked by the kernel,
and every test has its own server and job ids, which is enough. A private
network namespace per test would also need the test process itself (its REST
calls) inside that namespace, which costs more machinery than it buys. To run
the whole e2e tree in one private namespace anyway::

    unshare -rn sh -c 'ip link set lo up && RDZV_TEST_NETNS=1 exec .venv/bin/pytest tests/e2e'

(``unshare -n`` as root.) The session fixture below only records which way the
suite runs; it never re-executes anything.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
POLL_S = 0.05
TAG_VAR = "RDZV_E2E_TAG"

# Variables of the test runner's own environment that would change what an
# agent or a worker does; agents start without them unless a test sets them.
_SCRUB_PREFIXES = ("SLURM_", "PET_", "RDZV_", "TORCHELASTIC_", "MASTER_", "TORCH_NCCL_")
_SCRUB_NAMES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "OMP_NUM_THREADS"}

STEP_RE = re.compile(r"^\[(\d+)\]: step (\d+) rank (\d+) world (\d+) restart (\d+) pid (\d+)$", re.M)


@dataclass(frozen=True)
class Step:
    """One ``step ...`` line printed by scripts/loop.py."""

    step: int
    rank: int
    world: int
    restart: int
    pid: int


def wait_until(fn: Callable[[], Any], timeout: float, what: str, interval: float = POLL_S) -> Any:
    """Poll ``fn`` until it returns something truthy; return that, or fail
    after ``timeout`` seconds saying ``what`` was awaited (and the last value)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = fn()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what} (last: {last!r})")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses
    return int(stat[stat.rfind(")") + 2:].split()[1])


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (workers and their children)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            parent = _ppid(int(entry))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def tagged_pids(tag: str) -> list[int]:
    """Live processes (not zombies) whose environment carries ``RDZV_E2E_TAG=tag``."""
    needle = f"{TAG_VAR}={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if needle in env.split(b"\0") and state[state.rfind(")") + 2] != "Z":
            found.append(int(entry))
    return found


def _killpg(pgid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class Proc:
    """A process we started, its log file, and ways to wait on either."""

    name: str
    popen: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_log(self, pattern: str, timeout: float, count: int = 1) -> list[re.Match]:
        """Wait until ``pattern`` (a regex, multiline) matched ``count`` times in the log."""
        rx = re.compile(pattern, re.M)

        def found():
            hits = list(rx.finditer(self.text()))
            return hits if len(hits) >= count else None

        try:
            return wait_until(found, timeout, f"{count}x {pattern!r} in {self.name}'s log")
        except AssertionError as e:
            raise AssertionError(f"{e}\n--- {self.name} log tail ---\n{self.text()[-3000:]}") from None

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} did not exit within {timeout:g}s\n--- log tail ---\n"
                                 f"{self.text()[-3000:]}") from None

    def steps(self) -> list[Step]:
        """The ``step`` lines its workers printed (scripts/loop.py)."""
        return [Step(*(int(g) for g in m.groups()[1:])) for m in STEP_RE.finditer(self.text())]


@dataclass
class Server(Proc):
    port: int = 0

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def request(self, method: str, path: str, timeout: float = 5.0) -> tuple[int, Any]:
        """One REST call: (HTTP status, decoded JSON body)."""
        req = urllib.request.Request(self.url + path, method=method, data=b"" if method == "POST" else None)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            with e:
                return e.code, json.loads(e.read() or b"null")

    def job(self, job_id: str) -> dict | None:
        """GET /v1/jobs/{job_id}; None while the job does not exist."""
        status, body = self.request("GET", f"/v1/jobs/{job_id}")
        if status == 404:
            return None
        assert status == 200, (status, body)
        return body

    def wait_job(self, job_id: str, pred: Callable[[dict], bool], timeout: float, what: str) -> dict:
        """Poll the job's REST view until ``pred`` holds; return that view."""
        last: list[dict | None] = [None]

        def check():
            last[0] = self.job(job_id)
            return last[0] if last[0] is not None and pred(last[0]) else None

        try:
            return wait_until(check, timeout, what)
        except AssertionError as e:
            raise AssertionError(f"{e}\njob view: {json.dumps(last[0], indent=1)[:4000]}") from None

    def close_job(self, job_id: str) -> dict:
        status, body = self.request("POST", f"/v1/jobs/{job_id}/close")
        assert status == 200, (status, body)
        return body

    def healthy(self) -> bool:
        try:
            return self.request("GET", "/healthz", timeout=1.0)[0] == 200
        except (OSError, ValueError):
            return False


@dataclass
class Cluster:
    """Everything one test started; :meth:`close` kills it all."""

    tmp: Path
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    procs: list[Proc] = field(default_factory=list)
    _n: int = 0

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(_SCRUB_PREFIXES) and k not in _SCRUB_NAMES}
        env[TAG_VAR] = self.tag
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONWARNINGS"] = "ignore"  # torch's "numpy is missing" noise in every worker
        env.update(extra or {})
        return env

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        log_path = self.tmp / f"{name}.log"
        with open(log_path, "wb") as log:
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=env, cwd=self.tmp, start_new_session=True)

    def start_server(self, *flags: str, timeout: float = 20.0) -> Server:
        """A real rdzv-server on a free loopback port; returns once /healthz answers."""
        data_dir = self.tmp / "server-data"
        for attempt in range(3):
            port = free_port()
            name = f"server{attempt}" if attempt else "server"
            argv = [sys.executable, "-m", "rdzv_server", "--host", "127.0.0.1", "--port", str(port),
                    "--data-dir", str(data_dir), *flags]
            server = Server(name, self._spawn(name, argv, self.env()), self.tmp / f"{name}.log", port=port)
            self.procs.append(server)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and server.popen.poll() is None:
                if server.healthy():
                    return server
                time.sleep(POLL_S)
            if server.popen.poll() is None:
                raise AssertionError(f"server did not answer /healthz in {timeout:g}s:\n{server.text()[-3000:]}")
            # it exited: most likely the port was taken in the meantime; try another
        raise AssertionError(f"server would not start:\n{server.text()[-3000:]}")

    def start_agent(self, server: Server | None, job_id: str, script: str | Path, *script_args: str,
                    nnodes: str = "2", nproc: int = 1, flags: tuple[str, ...] = (),
                    env: dict[str, str] | None = None, name: str | None = None) -> Proc:
        """A real rdzv-agent running ``script`` (a path, or a name in tests/e2e/scripts)."""
        self._n += 1
        name = name or f"agent{self._n}"
        script_path = Path(script) if os.sep in str(script) else SCRIPTS / script
        argv = [sys.executable, "-m", "rdzv_client.agent"]
        if server is not None:
            argv += ["--endpoint", server.endpoint, "--job-id", job_id]
        argv += ["--local-addr", "127.0.0.1", "--nnodes", nnodes, "--nproc-per-node", str(nproc),
                 "--stop-timeout", "3", *flags, str(script_path), *script_args]
        agent = Proc(name, self._spawn(name, argv, self.env(env)), self.tmp / f"{name}.log")
        self.procs.append(agent)
        return agent

    def run_agent(self, *argv: str, env: dict[str, str] | None = None, timeout: float = 30.0,
                  ) -> subprocess.CompletedProcess:
        """Run ``python -m rdzv_client.agent ARGV`` to its end (usage errors)."""
        proc = subprocess.Popen([sys.executable, "-m", "rdzv_client.agent", *argv], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env(env),
                                cwd=self.tmp, start_new_session=True)
        self.procs.append(Proc("run_agent", proc, self.tmp / "run_agent.log"))
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def workers_of(self, agent: Proc) -> list[int]:
        """The worker processes an agent runs now (its live descendants)."""
        return descendants(agent.pid)

    def kill_node(self, agent: Proc) -> list[int]:
        """A node dies: SIGKILL the agent's process group and every worker's
        group at once (workers lead groups of their own). Returns the pids."""
        victims = [agent.pid, *descendants(agent.pid)]
        for pid in victims:
            _kill(pid)
            _killpg(pid)
        agent.wait_exit(10)
        return victims

    def leftovers(self) -> list[int]:
        """Processes started by this cluster that still live, agents excluded."""
        agents = {p.pid for p in self.procs}
        return [pid for pid in tagged_pids(self.tag) if pid not in agents]

    def close(self) -> None:
        servers = [p for p in self.procs if isinstance(p, Server)]
        for proc in self.procs:
            if not isinstance(proc, Server) and proc.popen.poll() is None:
                _killpg(proc.pid)
        for _ in range(3):  # workers (own groups) and anything they started
            pids = tagged_pids(self.tag)
            if not pids:
                break
            for pid in pids:
                _killpg(pid)
                _kill(pid)
            time.sleep(POLL_S)
        for server in servers:
            _kill(server.pid)
        for proc in self.procs:
            try:
                proc.popen.wait(10)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture(scope="session", autouse=True)
def _network_isolation() -> str:
    """Say whether the suite runs in a private network namespace (see the
    module docstring); loopback with free ports otherwise."""
    return "netns" if os.environ.get("RDZV_TEST_NETNS") else "loopback"


def managed(c, request: pytest.FixtureRequest):
    """Yield the cluster ``c``; afterwards kill everything it started and, if
    the test failed, print its processes' logs (they explain the failure)."""
    try:
        yield c
    finally:
        c.close()
        rep = getattr(request.node, "rep_call", None)
        if rep is not None and rep.failed:
            for proc in c.procs:
                print(f"\n===== {proc.name} ({proc.log_path}) =====\n{proc.text()[-6000:]}")


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest):
    yield from managed(Cluster(tmp=tmp_path), request)
