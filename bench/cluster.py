"""The processes of one bench measurement (a server, agents, their workers)
and the stamp lines their workers write; every process stopped by pid."""

from __future__ import annotations

import json
import os
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers.procs import scrubbed

from . import _common as C

STAMP = C.SCRIPTS / "stamp.py"
TAG_VAR = "RDZV_BENCH_TAG"


@dataclass
class Outcome:
    """One measurement: a number of seconds (or other unit), or why not."""

    value: float | None
    failure: str | None = None  # e.g. "no recovery in 90 s"
    info: dict = field(default_factory=dict)


@dataclass
class Line:
    what: str
    rank: int
    world: int
    restart: str
    t: float
    pid: int


def read_lines(path: Path) -> list[Line]:
    out = []
    try:
        text = path.read_text()
    except OSError:
        return out
    for raw in text.splitlines():
        p = raw.split()
        if len(p) != 6:
            continue
        try:
            out.append(Line(p[0], int(p[1]), int(p[2]), p[3], float(p[4]), int(p[5])))
        except ValueError:
            continue
    return out


# ------------------------------------------------------------------ cluster


class Cluster:
    """Processes of one measurement; everything is stopped by pid in close()."""

    def __init__(self, launcher: str, tmp: Path, name: str, server: bool = True):
        self.launcher = launcher
        self.dir = tmp / f"{name}-{launcher}-{uuid.uuid4().hex[:6]}"
        self.dir.mkdir(parents=True)
        self.out = self.dir / "stamps.txt"
        self.tag = uuid.uuid4().hex
        self.job = f"bench-{name}-{uuid.uuid4().hex[:8]}"
        self.agents: list[C.Proc] = []
        self.server: C.Proc | None = None
        self.port = C.free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.env = scrubbed(os.environ)
        self.env.update(
            {TAG_VAR: self.tag, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(C.ROOT), "RDZV_LOG_LEVEL": "INFO"}
        )
        if launcher == "rdzv" and server:
            self._start_server()

    def _start_server(self) -> None:
        self.server = C.Proc(
            "server",
            C.server_argv(self.port, self.dir / "data"),
            self.dir / "server.log",
            env=self.env,
            cwd=C.ROOT,
        )
        url = f"http://{self.endpoint}/healthz"
        if not C.wait_until(lambda: C.http_get(url, 1.0) or self.server.poll() is not None, 20):
            raise RuntimeError("rdzv-server did not start:\n" + self.server.text()[-2000:])
        if self.server.poll() is not None:
            raise RuntimeError("rdzv-server exited:\n" + self.server.text()[-2000:])

    def launch(
        self,
        nnodes: str,
        cmd: list[str],
        no_python: bool = False,
        is_host: bool | None = None,
        rdzv_flags: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> C.Proc:
        """An agent; ``rdzv_flags`` go to rdzv-agent only, ``env`` is added to this agent's."""
        i = len(self.agents)
        is_host = i == 0 if is_host is None else is_host
        if self.launcher == "rdzv":
            argv = [
                sys.executable,
                "-m",
                "rdzv_client.agent",
                "--endpoint",
                self.endpoint,
                "--job-id",
                self.job,
                "--local-addr",
                "127.0.0.1",
            ]
        else:
            argv = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.endpoint}",
                f"--rdzv-id={self.job}",
                f"--rdzv-conf=is_host={int(is_host)}",
                "--local-addr",
                "127.0.0.1",
            ]
        argv += ["--nnodes", nnodes, "--nproc-per-node", "1", "--max-restarts", "3"]
        if self.launcher == "rdzv":
            argv += rdzv_flags
        if no_python:
            argv.append("--no-python")
        argv += cmd
        p = C.Proc(f"agent{i}", argv, self.dir / f"agent{i}.log", env={**self.env, **(env or {})}, cwd=self.dir)
        self.agents.append(p)
        return p

    def stamp_cmd(self, *extra: str) -> list[str]:
        return [str(STAMP), str(self.out), *extra]

    def lines(self) -> list[Line]:
        return read_lines(self.out)

    def history(self) -> list[dict]:
        body = C.http_get(f"http://{self.endpoint}/v1/jobs/{self.job}", 5)
        return json.loads(body).get("history", []) if body else []

    def agent_of(self, pid: int) -> C.Proc | None:
        for a in self.agents:
            if pid in C.descendants(a.pid):
                return a
        return None

    def close(self) -> None:
        for a in self.agents:
            a.stop(3.0)
        # workers lead their own process groups and may outlive their agent
        for pid in _tagged(self.tag):
            C.kill_tree(pid)
        if self.server is not None:
            self.server.stop(3.0)


def _tagged(tag: str) -> list[int]:
    needle = f"{TAG_VAR}={tag}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        pids.append(int(entry))
            except OSError:
                pass
    return pids
