"""Fixtures for fault-injection tests: real server, agents and gloo workers,
killed, restarted, cut off and loaded on purpose.

The process machinery comes from ``tests/e2e/conftest.py`` (:class:`Cluster`,
its :class:`Proc` and :class:`Server`, :func:`wait_until`); this module adds
what faults need:

* :meth:`FaultCluster.start_server_at`: a server on a *given* port and data
  dir, so that a restart after ``kill -9`` is the same server to its agents;
* :meth:`FaultCluster.kill9` / :meth:`FaultCluster.restart_server`;
* :class:`NetLab`: network namespaces joined by a bridge, for partitions;
* :class:`Ticks`: the ``tick round R rank r node N ...`` lines of
  ``scripts/ranks.py`` workers, as seen in every agent's log.

Everything started is stopped by pid (the e2e Cluster's teardown), and every
namespace created is deleted, on failure too.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

_TESTS = str(Path(__file__).resolve().parents[1])
if _TESTS not in sys.path:  # pytest's default (prepend) import mode has put it there already
    sys.path.insert(0, _TESTS)

from e2e.conftest import (  # noqa: E402 - after the path fix above
    POLL_S,
    Cluster,
    Proc,
    Server,
    descendants,
    free_port,
    managed,
    wait_until,
)

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
RANKS = SCRIPTS / "ranks.py"
TRAIN = ROOT / "examples" / "train_ddp.py"

__all__ = ["FaultCluster", "NetLab", "Proc", "Server", "Ticks", "descendants", "free_port", "wait_until",
           "RANKS", "TRAIN", "SCRIPTS", "ROOT", "POLL_S"]

TICK_RE = re.compile(r"tick round (\d+) rank (\d+) node (\S+) pid (\d+) step (\d+) world (\d+)")
ASSIGNED_RE = re.compile(r"node (\S+): round (\d+): group rank (\d+) of (\d+)")


@dataclass(frozen=True)
class Tick:
    round: int
    rank: int
    node: str
    pid: int
    step: int
    world: int


class Ticks:
    """Parsed ``tick`` lines of a set of agents' logs."""

    @staticmethod
    def of(*agents: Proc) -> list[Tick]:
        out = []
        for a in agents:
            for m in TICK_RE.finditer(a.text()):
                r, k, node, pid, step, world = m.groups()
                out.append(Tick(int(r), int(k), node, int(pid), int(step), int(world)))
        return out

    @staticmethod
    def last_step(agent: Proc, round_no: int | None = None) -> int:
        steps = [t.step for t in Ticks.of(agent) if round_no is None or t.round == round_no]
        return max(steps, default=0)

    @staticmethod
    def rank_owners(*agents: Proc) -> dict[tuple[int, int], set[str]]:
        """(round, rank) -> every node label whose worker ticked as that rank of that round."""
        owners: dict[tuple[int, int], set[str]] = {}
        for t in Ticks.of(*agents):
            owners.setdefault((t.round, t.rank), set()).add(t.node)
        return owners


def assigned_ranks(*agents: Proc) -> dict[tuple[int, int], set[str]]:
    """(round, group rank) -> node ids, from the agents' own "round R: group rank g" lines."""
    owners: dict[tuple[int, int], set[str]] = {}
    for a in agents:
        for m in ASSIGNED_RE.finditer(a.text()):
            node, r, g, _ = m.groups()
            owners.setdefault((int(r), int(g)), set()).add(node)
    return owners


@dataclass
class FaultCluster(Cluster):
    """The e2e Cluster, plus servers on fixed ports (restartable) and agents in namespaces."""

    def start_server_at(self, port: int, data_dir: Path | str, *flags: str, host: str = "127.0.0.1",
                        name: str | None = None, netns: str | None = None, url_host: str | None = None,
                        request_via=None, timeout: float = 20.0) -> Server:
        """``rdzv-server --host H --port PORT --data-dir DATA_DIR``; returns once /healthz answers.
        Fails (with its log) if it exits first."""
        name = name or f"server{sum(isinstance(p, Server) for p in self.procs)}"
        argv = [sys.executable, "-m", "rdzv_server", "--host", host, "--port", str(port),
                "--data-dir", str(data_dir), *flags]
        if netns:
            argv = ["ip", "netns", "exec", netns, *argv]
        cls = NsServer if request_via else Server
        server = cls(name, self._spawn(name, argv, self.env()), self.tmp / f"{name}.log", port=port)
        if request_via:
            server.host, server.via = url_host or host, request_via
        self.procs.append(server)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and server.popen.poll() is None:
            if server.healthy():
                return server
            time.sleep(POLL_S)
        raise AssertionError(f"server {name} did not come up on port {port} (exit {server.popen.poll()}):\n"
                             f"{server.text()[-3000:]}")

    def kill9(self, proc: Proc, timeout: float = 10.0) -> None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait_exit(timeout)

    def run_server(self, *argv: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
        """``python -m rdzv_server ARGV`` to its end (refusals)."""
        proc = subprocess.Popen([sys.executable, "-m", "rdzv_server", *argv], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env(),
                                cwd=self.tmp, start_new_session=True)
        self.procs.append(Proc("run_server", proc, self.tmp / "run_server.log"))
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"rdzv-server {argv} did not exit within {timeout:g}s:\n{out}\n{err}") from None
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def start_ranks_agent(self, server_endpoint: str, job_id: str, node: str, stop_file: Path, *,
                          nnodes: str = "2", interval: float = 0.1, flags: tuple[str, ...] = (),
                          netns: str | None = None, env: dict[str, str] | None = None,
                          worker_args: tuple[str, ...] = ()) -> Proc:
        """An agent whose one worker runs scripts/ranks.py, labelled ``node``."""
        argv = [sys.executable, "-m", "rdzv_client.agent", "--endpoint", server_endpoint, "--job-id", job_id,
                "--local-addr", "127.0.0.1", "--nnodes", nnodes, "--nproc-per-node", "1", "--stop-timeout", "3",
                *flags, str(RANKS), "--label", node, "--stop-file", str(stop_file), "--interval", str(interval),
                *worker_args]
        if netns:
            argv = ["ip", "netns", "exec", netns, *argv]
        proc = Proc(node, self._spawn(node, argv, self.env(env)), self.tmp / f"{node}.log")
        self.procs.append(proc)
        return proc

    def start_train_agent(self, endpoint: str, job_id: str, name: str, ckpt_dir: Path, *train_args: str,
                          nnodes: str, flags: tuple[str, ...] = ()) -> Proc:
        """An agent whose one worker runs examples/train_ddp.py."""
        argv = [sys.executable, "-m", "rdzv_client.agent", "--endpoint", endpoint, "--job-id", job_id,
                "--local-addr", "127.0.0.1", "--nnodes", nnodes, "--nproc-per-node", "1", "--stop-timeout", "3",
                *flags, str(TRAIN), "--ckpt-dir", str(ckpt_dir), *train_args]
        proc = Proc(name, self._spawn(name, argv, self.env()), self.tmp / f"{name}.log")
        self.procs.append(proc)
        return proc


@dataclass
class NsServer(Server):
    """A server inside a network namespace: REST calls go through a thread
    that lives in that namespace (``via``), to the address it listens on."""

    host: str = ""
    via: Any = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def request(self, method: str, path: str, timeout: float = 5.0):
        return self.via(Server.request, self, method, path, timeout)


# ------------------------------------------------------------------ netns

_CLONE_NEWNET = 0x40000000


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def netns_unavailable() -> str | None:
    """Why namespaces cannot be used here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); running as uid %d" % os.geteuid()
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) on this machine"
    probe = f"rzprobe{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    try:
        r = _ip("-n", probe, "link", "add", "rzb", "type", "bridge", check=False)
        if r.returncode != 0:
            return f"cannot create a bridge in a namespace: {r.stderr.strip()}"
        r = _ip("-n", probe, "link", "add", "rzv0", "type", "veth", "peer", "name", "rzv1", check=False)
        if r.returncode != 0:
            return f"cannot create a veth pair: {r.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


@dataclass
class NetLab:
    """A private network: a hub namespace with a bridge at ``SUBNET.1``, and
    one namespace per node, each joined to the bridge by a veth pair (node
    side ``rzeth`` at ``SUBNET.(10+i)``, hub side ``rzh<i>``). Every address
    exists only inside these namespaces; nothing is created in the caller's
    namespace, and deleting the namespaces deletes every link."""

    n: int
    subnet: str = "10.213.7"
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    created: list[str] = field(default_factory=list)
    _pool: ThreadPoolExecutor | None = None

    @property
    def hub(self) -> str:
        return f"rzf-{self.tag}-hub"

    def node_ns(self, i: int) -> str:
        return f"rzf-{self.tag}-n{i}"

    def node_addr(self, i: int) -> str:
        return f"{self.subnet}.{10 + i}"

    @property
    def hub_addr(self) -> str:
        return f"{self.subnet}.1"

    def hub_link(self, i: int) -> str:
        return f"rzh{i}"

    def setup(self) -> None:
        for ns in [self.hub, *(self.node_ns(i) for i in range(self.n))]:
            _ip("netns", "add", ns)
            self.created.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", self.hub, "link", "add", "rzbr", "type", "bridge")
        _ip("-n", self.hub, "addr", "add", f"{self.hub_addr}/24", "dev", "rzbr")
        _ip("-n", self.hub, "link", "set", "rzbr", "up")
        for i in range(self.n):
            ns, hub_side = self.node_ns(i), self.hub_link(i)
            # both ends are born inside namespaces: nothing appears in ours
            _ip("-n", self.hub, "link", "add", hub_side, "type", "veth", "peer", "name", "rzeth", "netns", ns)
            _ip("-n", self.hub, "link", "set", hub_side, "master", "rzbr")
            _ip("-n", self.hub, "link", "set", hub_side, "up")
            _ip("-n", ns, "addr", "add", f"{self.node_addr(i)}/24", "dev", "rzeth")
            _ip("-n", ns, "link", "set", "rzeth", "up")
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="in-hub", initializer=_enter_netns,
                                        initargs=(self.hub,))

    def cut(self, i: int) -> None:
        """Node i's cable is pulled: silent loss, no RST, no ICMP."""
        _ip("-n", self.hub, "link", "set", self.hub_link(i), "down")

    def heal(self, i: int) -> None:
        _ip("-n", self.hub, "link", "set", self.hub_link(i), "up")

    def in_hub(self, fn, *args):
        """Run ``fn(*args)`` in a thread that lives in the hub namespace (sockets it opens are there)."""
        assert self._pool is not None
        return self._pool.submit(fn, *args).result()

    def cleanup(self) -> list[str]:
        """Delete every namespace created (and with them every veth and the bridge); return errors."""
        errors = []
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for ns in reversed(self.created):
            r = _ip("netns", "del", ns, check=False)
            if r.returncode != 0:
                errors.append(f"{ns}: {r.stderr.strip()}")
        self.created.clear()
        return errors


def _enter_netns(name: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:  # a thread can change its own network namespace
            err = ctypes.get_errno()
            raise OSError(err, f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)


# --------------------------------------------------------------- fixtures


@pytest.fixture
def fcluster(tmp_path: Path, request: pytest.FixtureRequest):
    yield from managed(FaultCluster(tmp=tmp_path), request)


@pytest.fixture
def netlab(request: pytest.FixtureRequest):
    """A NetLab with ``request.param`` nodes (default 3); skipped where namespaces cannot be made.
    Ask for it before ``fcluster``, so that the processes in the namespaces are
    stopped before the namespaces are deleted."""
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    lab = NetLab(getattr(request, "param", 3))
    try:
        lab.setup()
        yield lab
    finally:
        errors = lab.cleanup()
        assert not errors, f"could not delete namespaces: {errors}"
