"""A test's processes as one object: :class:`Cluster` (a real server, real
agents, their workers) and :class:`FaultCluster` (plus servers on fixed ports
that can be killed and restarted, agents in network namespaces).

Everything a cluster starts is a subprocess in a session of its own, with
stdout and stderr in one log file per process under the test's tmp dir:

* the server: ``python -m rdzv_server --host 127.0.0.1 --port <free>
  --data-dir <tmp>``; :meth:`Cluster.start_server` returns once ``/healthz``
  answers;
* agents: ``python -m rdzv_client.agent --endpoint ... --job-id ...
  --local-addr 127.0.0.1 ...``.

:meth:`Cluster.close` kills by pid only, never by name: every agent's process
group with SIGKILL, then every process that carries this cluster's tag in its
environment (``RDZV_E2E_TAG``, inherited by the workers, which lead process
groups of their own and outlive a SIGKILLed agent), then the server.
:func:`managed` is the body of a fixture: it yields the cluster, closes it,
and prints the logs when the test failed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from .procs import (
    POLL_S,
    ROOT,
    Proc,
    Server,
    clean_env,
    descendants,
    free_port,
    kill_pid,
    killpg,
    spawn,
    start_server,
    tagged_pids,
    wait_healthy,
)

E2E_SCRIPTS = ROOT / "tests" / "e2e" / "scripts"
FAULT_SCRIPTS = ROOT / "tests" / "faults" / "scripts"
RANKS = FAULT_SCRIPTS / "ranks.py"
TRAIN = ROOT / "examples" / "train_ddp.py"


@dataclass
class Cluster:
    """Everything one test started; :meth:`close` kills it all."""

    tmp: Path
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    procs: list[Proc] = field(default_factory=list)
    _n: int = 0

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return clean_env(self.tag, extra)

    def start(
        self, name: str, argv: list[str], env: dict[str, str] | None = None, cls: type[Proc] = Proc, **fields: Any
    ) -> Any:
        """Start ``argv`` (logged to ``tmp/NAME.log``, tagged, in a session of
        its own), register it for teardown and return it as a ``cls``."""
        proc = cls(name, self._spawn(name, argv, self.env(env)), self.tmp / f"{name}.log", **fields)
        self.procs.append(proc)
        return proc

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        """``argv`` logged to ``tmp/NAME.log``, not registered (:meth:`start` does both)."""
        return spawn(argv, self.tmp / f"{name}.log", env, self.tmp)

    def _server(
        self,
        name: str,
        port: int,
        data_dir: Path | str,
        flags: tuple[str, ...],
        host: str = "127.0.0.1",
        netns: str | None = None,
        cls: type[Server] = Server,
    ) -> Server:
        argv = [
            sys.executable,
            "-m",
            "rdzv_server",
            "--host",
            host,
            "--port",
            str(port),
            "--data-dir",
            str(data_dir),
            *flags,
        ]
        if netns:
            argv = ["ip", "netns", "exec", netns, *argv]
        return self.start(name, argv, cls=cls, port=port)

    def start_server(self, *flags: str, timeout: float = 20.0, data_dir: Path | str | None = None) -> Server:
        """A real rdzv-server on a free loopback port (its data in ``data_dir``,
        default ``tmp/server-data``); returns once /healthz answers."""
        return start_server(
            self.tmp,
            *flags,
            data_dir=data_dir or self.tmp / "server-data",
            env=self.env(),
            timeout=timeout,
            started=self.procs,
        )

    @staticmethod
    def agent_argv(
        endpoint: str | None, job_id: str, nnodes: str, nproc: int = 1, flags: tuple[str, ...] = ()
    ) -> list[str]:
        """``python -m rdzv_client.agent`` with the flags every test agent has, up to its script."""
        argv = [sys.executable, "-m", "rdzv_client.agent"]
        if endpoint is not None:
            argv += ["--endpoint", endpoint, "--job-id", job_id]
        return [
            *argv,
            "--local-addr",
            "127.0.0.1",
            "--nnodes",
            nnodes,
            "--nproc-per-node",
            str(nproc),
            "--stop-timeout",
            "3",
            "--line-prefix",  # the tests read "[RANK]: " lines (Proc.steps)
            *flags,
        ]

    def start_agent(
        self,
        server: Server | None,
        job_id: str,
        script: str | Path,
        *script_args: str,
        nnodes: str = "2",
        nproc: int = 1,
        flags: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        name: str | None = None,
    ) -> Proc:
        """A real rdzv-agent running ``script`` (a path, or a name in tests/e2e/scripts)."""
        self._n += 1
        name = name or f"agent{self._n}"
        script_path = Path(script) if os.sep in str(script) else E2E_SCRIPTS / script
        argv = self.agent_argv(server.endpoint if server is not None else None, job_id, nnodes, nproc, flags)
        return self.start(name, [*argv, str(script_path), *script_args], env)

    def run_module(
        self, module: str, *argv: str, env: dict[str, str] | None = None, timeout: float = 30.0
    ) -> subprocess.CompletedProcess:
        """Run ``python -m MODULE ARGV`` to its end, output captured (usage errors, refusals)."""
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=self.env(env),
            cwd=self.tmp,
            start_new_session=True,
        )
        self.procs.append(Proc(f"run {module}", proc, self.tmp / f"run-{module}.log"))
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"{module} {argv} did not exit within {timeout:g}s:\n{out}\n{err}") from None
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def run_agent(
        self,
        *argv: str,
        env: dict[str, str] | None = None,
        timeout: float = 30.0,
    ) -> subprocess.CompletedProcess:
        """Run ``python -m rdzv_client.agent ARGV`` to its end (usage errors)."""
        return self.run_module("rdzv_client.agent", *argv, env=env, timeout=timeout)

    def workers_of(self, agent: Proc) -> list[int]:
        """The worker processes an agent runs now (its live descendants)."""
        return descendants(agent.pid)

    def kill_node(self, agent: Proc) -> list[int]:
        """A node dies: SIGKILL the agent's process group and every worker's
        group at once (workers lead groups of their own). Returns the pids."""
        victims = [agent.pid, *descendants(agent.pid)]
        for pid in victims:
            kill_pid(pid)
            killpg(pid)
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
                killpg(proc.pid)
        for _ in range(20):  # workers (own groups) and anything they started
            pids = tagged_pids(self.tag)
            if not pids:
                break
            for pid in pids:
                killpg(pid)
                kill_pid(pid)
            time.sleep(POLL_S)
        for server in servers:
            kill_pid(server.pid)
        for proc in self.procs:
            try:
                proc.popen.wait(10)
            except subprocess.TimeoutExpired:
                pass


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

    def start_server_at(
        self,
        port: int,
        data_dir: Path | str,
        *flags: str,
        host: str = "127.0.0.1",
        name: str | None = None,
        netns: str | None = None,
        url_host: str | None = None,
        request_via=None,
        timeout: float = 20.0,
    ) -> Server:
        """``rdzv-server --host H --port PORT --data-dir DATA_DIR``; returns once /healthz answers.
        Fails (with its log) if it exits first."""
        name = name or f"server{sum(isinstance(p, Server) for p in self.procs)}"
        server = self._server(name, port, data_dir, flags, host, netns, NsServer if request_via else Server)
        if request_via:
            server.host, server.via = url_host or host, request_via
        if wait_healthy(server, timeout):
            return server
        raise AssertionError(
            f"server {name} did not come up on port {port} (exit {server.popen.poll()}):\n{server.text()[-3000:]}"
        )

    def start_hub_server(self, netlab: Any, data_dir: Path | str, *flags: str, port: int | None = None) -> Server:
        """``rdzv-server --insecure`` (no token) in ``netlab``'s hub namespace, on the hub's
        address, which exists only in the test's private namespaces; asked through the hub."""
        return self.start_server_at(
            port or free_port(),
            data_dir,
            "--insecure",
            *flags,
            host=netlab.hub_addr,
            name="server",
            netns=netlab.hub,
            request_via=netlab.in_hub,
        )

    def kill9(self, proc: Proc, timeout: float = 10.0) -> None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait_exit(timeout)

    def run_server(self, *argv: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
        """``python -m rdzv_server ARGV`` to its end (refusals)."""
        return self.run_module("rdzv_server", *argv, timeout=timeout)

    def start_ranks_agent(
        self,
        server_endpoint: str,
        job_id: str,
        node: str,
        stop_file: Path,
        *,
        nnodes: str = "2",
        interval: float = 0.1,
        flags: tuple[str, ...] = (),
        netns: str | None = None,
        env: dict[str, str] | None = None,
        worker_args: tuple[str, ...] = (),
    ) -> Proc:
        """An agent whose one worker runs scripts/ranks.py, labelled ``node``."""
        argv = [
            *self.agent_argv(server_endpoint, job_id, nnodes, 1, flags),
            str(RANKS),
            "--label",
            node,
            "--stop-file",
            str(stop_file),
            "--interval",
            str(interval),
            *worker_args,
        ]
        if netns:
            argv = ["ip", "netns", "exec", netns, *argv]
        return self.start(node, argv, env)

    def start_train_agent(
        self,
        endpoint: str,
        job_id: str,
        name: str,
        ckpt_dir: Path,
        *train_args: str,
        nnodes: str,
        flags: tuple[str, ...] = (),
    ) -> Proc:
        """An agent whose one worker runs examples/train_ddp.py."""
        argv = [
            *self.agent_argv(endpoint, job_id, nnodes, 1, flags),
            str(TRAIN),
            "--ckpt-dir",
            str(ckpt_dir),
            *train_args,
        ]
        return self.start(name, argv)


@dataclass
class NsServer(Server):
    """A server inside a network namespace: REST calls go through a thread
    that lives in that namespace (``via``), to the address it listens on."""

    via: Any = None

    def request(self, method: str, path: str, timeout: float = 5.0, token: str | None = None) -> tuple[int, Any]:
        return self.via(Server.request, self, method, path, timeout, token)
