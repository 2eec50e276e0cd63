"""Processes a test starts and waits on, for every test folder.

* :func:`wait_until`: poll a condition with a deadline (never a bare sleep);
* :func:`free_port`: a free loopback port below the kernel's ephemeral range;
* :func:`descendants`, :func:`tagged_pids`, :func:`alive`, :func:`kill_pid`,
  :func:`killpg`: the /proc readings and the by-pid kills that teardown uses
  (never a kill by name);
* :func:`clean_env`: the runner's environment without the variables that
  would change what an agent, torchrun or a worker does, plus the tag that
  lets teardown find orphaned workers;
* :func:`spawn`: a process in a session of its own, stdout and stderr into a
  log file;
* :class:`Proc`: such a process and its log (wait for a line, for its exit);
* :class:`Server`: an ``rdzv-server`` process and its REST API, and
  :func:`wait_healthy` for its ``/healthz``.

Stdlib only: the helpers cost nothing to import.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
POLL_S = 0.05
TAG_VAR = "RDZV_E2E_TAG"

# Variables of the test runner's own environment that would change what an
# agent or a worker does; agents start without them unless a test sets them.
_SCRUB_PREFIXES = ("SLURM_", "PET_", "RDZV_", "TORCHELASTIC_", "MASTER_", "TORCH_NCCL_")
_SCRUB_NAMES = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "OMP_NUM_THREADS",
}

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


# The ports free_port hands out lie below the kernel's ephemeral range
# (net.ipv4.ip_local_port_range, 32768-60999 by default), which the kernel never
# gives to a connection's source port or to a bind of port 0: a port a test
# frees to start a server on it again (kill -9 and restart, an etcd member's
# restart) stays free for it, where an ephemeral one was taken by some other
# connection under load (an etcd member died on "address already in use").
# Each xdist worker walks its own slice from a random start.
PORT_RANGE = (20000, 32000)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _port_slice() -> tuple[int, int]:
    lo, hi = PORT_RANGE[0], min(PORT_RANGE[1], _ephemeral_low())
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    index = int(worker) if worker.isdigit() else 0
    size = (hi - lo) // max(count, 1)
    return lo + index * size, lo + (index + 1) * size


_port_order = itertools.count(random.randrange(1 << 16))


def free_port() -> int:
    """A loopback port free now, out of the kernel's ephemeral range (above);
    one the kernel hands out where the host leaves no room below that range."""
    lo, hi = _port_slice()
    for _ in range(max(hi - lo, 0)):
        port = lo + next(_port_order) % (hi - lo)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses
    return int(stat[stat.rfind(")") + 2 :].split()[1])


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


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def killpg(pgid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_pid(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def scrubbed(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without the variables that would change what an agent or a
    worker does (the bench's processes start from it too)."""
    return {k: v for k, v in environ.items() if not k.startswith(_SCRUB_PREFIXES) and k not in _SCRUB_NAMES}


def clean_env(tag: str | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The runner's environment for a child: without the variables that would
    change what it does, with ROOT on PYTHONPATH, unbuffered output, ``tag``
    in ``RDZV_E2E_TAG`` (workers inherit it: teardown finds them by it), and
    ``extra`` on top."""
    env = scrubbed(os.environ)
    if tag is not None:
        env[TAG_VAR] = tag
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONWARNINGS"] = "ignore"  # torch's "numpy is missing" noise in every worker
    env.update(extra or {})
    return env


def spawn(argv: list[str], log_path: Path, env: dict[str, str], cwd: Path) -> subprocess.Popen:
    """``argv`` in a session of its own (its process group is its pid), stdout
    and stderr into ``log_path``."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )


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
            raise AssertionError(
                f"{self.name} did not exit within {timeout:g}s\n--- log tail ---\n{self.text()[-3000:]}"
            ) from None

    def stop(self, timeout: float = 5.0) -> int:
        """SIGTERM, then SIGKILL if it has not exited after ``timeout`` seconds; its exit code."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
        return self.popen.wait(timeout)

    def steps(self) -> list[Step]:
        """The ``step`` lines its workers printed (scripts/loop.py)."""
        return [Step(*(int(g) for g in m.groups()[1:])) for m in STEP_RE.finditer(self.text())]


@dataclass
class Server(Proc):
    port: int = 0
    host: str = "127.0.0.1"  # the address REST calls and agents reach it at

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def request(self, method: str, path: str, timeout: float = 5.0, token: str | None = None) -> tuple[int, Any]:
        """One REST call (with ``token`` as the bearer token): (HTTP status, decoded JSON body)."""
        req = urllib.request.Request(
            self.url + path,
            method=method,
            data=b"" if method == "POST" else None,
            headers={"Authorization": f"Bearer {token}"} if token else {},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            with e:
                return e.code, json.loads(e.read() or b"null")

    def get(self, path: str, token: str | None = None) -> Any:
        """GET ``path``: its JSON body, which must come with 200."""
        status, body = self.request("GET", path, token=token)
        assert status == 200, (path, status, body)
        return body

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


def start_server(
    tmp: Path,
    *flags: str,
    data_dir: Path | str = "none",
    env: dict[str, str] | None = None,
    timeout: float = 20.0,
    started: list[Proc] | None = None,
) -> Server:
    """A real rdzv-server on a free loopback port, in ``tmp`` (its log
    ``tmp/server.log``; ``--data-dir none``: memory only, by default);
    returns once /healthz answers. A server that exits first most likely lost
    its port to another process meanwhile: another port is tried (3 in all).
    Every process started is appended to ``started`` (for teardown)."""
    for attempt in range(3):
        name = f"server{attempt}" if attempt else "server"
        port = free_port()
        argv = [
            sys.executable,
            "-m",
            "rdzv_server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--data-dir",
            str(data_dir),
            *flags,
        ]
        log_path = tmp / f"{name}.log"
        server = Server(name, spawn(argv, log_path, env if env is not None else clean_env(), tmp), log_path, port=port)
        if started is not None:
            started.append(server)
        if wait_healthy(server, timeout):
            return server
    raise AssertionError(f"server would not start:\n{server.text()[-3000:]}")


def wait_healthy(server: Server, timeout: float) -> bool:
    """Wait until ``server`` answers /healthz (True) or its process exits
    (False); fail with its log after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and server.popen.poll() is None:
        if server.healthy():
            return True
        time.sleep(POLL_S)
    if server.popen.poll() is not None:
        return False
    raise AssertionError(
        f"server {server.name} did not answer /healthz on port {server.port} in {timeout:g}s:\n{server.text()[-3000:]}"
    )
