"""Stock torchrun with ``--rdzv-backend=rdzv`` (our handler,
rdzv_client/torch_plugin.py, found through the ``torchrun.handlers`` entry
point) against a real ``rdzv-server``: :class:`Rig` is a :class:`Cluster`
whose nodes are torchrun processes. Its workers are, by default, the e2e
tests' ``scripts/loop.py`` with ``--on-collective-error exit`` (one
all_reduce per step, checked against the world size, one ``step S rank R
world W restart C pid P`` line per step; a collective that fails because a
peer died exits 1 at once), read back by :meth:`TorchrunProc.steps`.

torchrun's workers lead sessions of their own and outlive a SIGKILLed
torchrun; they carry the rig's tag, and teardown kills them by it.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .cluster import E2E_SCRIPTS, Cluster
from .procs import Proc, Server

WORKER = E2E_SCRIPTS / "loop.py"
WORKER_ARGS = ("--on-collective-error", "exit")
STEP_RE = re.compile(r"^step (\d+) rank (\d+) world (\d+) restart (\d+) pid \d+$", re.M)  # torchrun: no prefix


class TorchrunProc(Proc):
    """A torchrun node, reading loop.py's step lines."""

    def steps(self) -> list[tuple[int, int, int, int]]:  # type: ignore[override]
        """(step, rank, world, restart) of every step line its workers printed."""
        return [tuple(int(g) for g in m.groups()) for m in STEP_RE.finditer(self.text())]  # type: ignore[misc]


@dataclass
class Rig(Cluster):
    """A server (memory only) and torchrun nodes for one test."""

    port: int = 0
    server: Server | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start_server(self, *flags: str, timeout: float = 20.0, data_dir: Path | str | None = "none") -> Server:
        self.server = super().start_server(*flags, timeout=timeout, data_dir=data_dir)
        self.port = self.server.port
        return self.server

    def post(self, path: str) -> tuple[int, Any]:
        assert self.server is not None
        return self.server.request("POST", path)

    def job(self, job_id: str) -> dict | None:
        assert self.server is not None
        return self.server.job(job_id)

    def wait_job(self, job_id: str, pred: Callable[[dict], bool], timeout: float, what: str) -> dict:
        assert self.server is not None
        return self.server.wait_job(job_id, pred, timeout, what)

    def torchrun(
        self,
        name: str,
        job_id: str,
        nnodes: str,
        *worker_args: str,
        conf: str = "",
        script: Path = WORKER,
        max_restarts: int = 3,
        env: dict[str, str] | None = None,
        endpoint: str | None = None,
    ) -> TorchrunProc:
        """``python -m torch.distributed.run --rdzv-backend=rdzv ... SCRIPT WORKER_ARGS``, one worker
        (the default script gets ``--on-collective-error exit`` first); ``endpoint``: another --rdzv-endpoint."""
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--rdzv-backend=rdzv",
            f"--rdzv-endpoint={endpoint or self.endpoint}",
            f"--rdzv-id={job_id}",
            f"--nnodes={nnodes}",
            "--nproc-per-node=1",
            f"--max-restarts={max_restarts}",
            "--monitor-interval=0.1",
            "--local-addr=127.0.0.1",
        ]
        if conf:
            argv.append(f"--rdzv-conf={conf}")
        if script == WORKER:
            worker_args = (*WORKER_ARGS, *worker_args)
        return self.start(name, [*argv, str(script), *worker_args], env, cls=TorchrunProc)
