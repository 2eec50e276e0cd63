"""The stock torchrun with ``--rdzv-backend=rdzv``: our rendezvous handler
(rdzv_client/torch_plugin.py, found through the ``torchrun.handlers`` entry
point) against a real ``rdzv-server`` subprocess, with real gloo workers
(plugin_scripts/allreduce_loop.py: one all_reduce per step, checked against
the world size, one ``step S rank R world W restart C`` line per step).

Every process is started in a session of its own and carries this test's tag
in its environment; teardown SIGKILLs, by pid, every process group and every
tagged process (torchrun's workers lead sessions of their own and outlive a
SIGKILLed torchrun). Every wait is on a condition with a deadline.
"""

from __future__ import annotations

import json
import os
import re
import signal
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

pytest.importorskip("torch")

from .conftest import POLL_S, TAG_VAR, descendants, free_port, tagged_pids, wait_until  # noqa: E402
from .conftest import Proc as BaseProc  # noqa: E402

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "plugin_scripts" / "allreduce_loop.py"
STEP_RE = re.compile(r"^step (\d+) rank (\d+) world (\d+) restart (\d+)$", re.M)
# the runner's own variables that would change what torchrun or a worker does
_SCRUB_PREFIXES = ("SLURM_", "PET_", "RDZV_", "TORCHELASTIC_", "MASTER_", "TORCH_NCCL_")
_SCRUB_NAMES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "OMP_NUM_THREADS"}


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def _sigkill(pid: int) -> None:
    for fn in (os.killpg, os.kill):
        try:
            fn(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class Proc(BaseProc):
    """The e2e conftest's process, reading this module's step lines."""

    def steps(self) -> list[tuple[int, int, int, int]]:  # type: ignore[override]
        """(step, rank, world, restart) of every step line its workers printed."""
        return [tuple(int(g) for g in m.groups()) for m in STEP_RE.finditer(self.text())]


@dataclass
class Rig:
    """A server and torchrun nodes for one test; :meth:`close` kills them all."""

    tmp: Path
    tag: str = field(default_factory=lambda: uuid.uuid4().hex)
    procs: list[Proc] = field(default_factory=list)
    port: int = 0

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(_SCRUB_PREFIXES) and k not in _SCRUB_NAMES}
        env.update({TAG_VAR: self.tag, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore",
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))})
        return env

    def spawn(self, name: str, argv: list[str]) -> Proc:
        log = self.tmp / f"{name}.log"
        with open(log, "wb") as f:
            popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                     env=self.env(), cwd=self.tmp, start_new_session=True)
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start_server(self) -> Proc:
        for attempt in range(3):
            self.port = free_port()
            server = self.spawn(f"server{attempt}", [sys.executable, "-m", "rdzv_server", "--host", "127.0.0.1",
                                                     "--port", str(self.port), "--data-dir", "none"])
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and server.popen.poll() is None:
                try:
                    if self.get("/healthz", timeout=1.0)[0] == 200:
                        return server
                except OSError:
                    pass
                time.sleep(POLL_S)
            if server.popen.poll() is None:
                raise AssertionError(f"server did not answer /healthz:\n{server.text()[-3000:]}")
        raise AssertionError(f"server would not start:\n{server.text()[-3000:]}")

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}{path}", timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            with e:
                return e.code, json.loads(e.read() or b"null")

    def post(self, path: str) -> tuple[int, Any]:
        req = urllib.request.Request(f"http://{self.endpoint}{path}", method="POST", data=b"")
        try:
            with urllib.request.urlopen(req, timeout=5.0) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            with e:
                return e.code, json.loads(e.read() or b"null")

    def job(self, job_id: str) -> dict | None:
        status, body = self.get(f"/v1/jobs/{job_id}")
        if status == 404:
            return None
        assert status == 200, (status, body)
        return body

    def wait_job(self, job_id: str, pred: Callable[[dict], bool], timeout: float, what: str) -> dict:
        last: list[dict | None] = [None]

        def check():
            last[0] = self.job(job_id)
            return last[0] if last[0] is not None and pred(last[0]) else None

        try:
            return wait_until(check, timeout, what)
        except AssertionError as e:
            raise AssertionError(f"{e}\njob view: {json.dumps(last[0], indent=1)[:4000]}") from None

    def torchrun(self, name: str, job_id: str, nnodes: str, *worker_args: str, conf: str = "") -> Proc:
        argv = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend=rdzv",
                f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={job_id}", f"--nnodes={nnodes}",
                "--nproc-per-node=1", "--max-restarts=3", "--monitor-interval=0.1", "--local-addr=127.0.0.1"]
        if conf:
            argv.append(f"--rdzv-conf={conf}")
        return self.spawn(name, [*argv, str(WORKER), *worker_args])

    def kill_node(self, proc: Proc) -> None:
        """The node dies: SIGKILL torchrun's process group and its workers
        (each the leader of a session of its own) at once."""
        victims = [proc.pid, *descendants(proc.pid)]
        for pid in victims:
            _sigkill(pid)
        proc.wait_exit(10)

    def close(self) -> None:
        for proc in self.procs:
            if proc.popen.poll() is None:
                for pid in [proc.pid, *descendants(proc.pid)]:
                    _sigkill(pid)
        for _ in range(20):  # orphaned workers: they carry the tag
            pids = tagged_pids(self.tag)
            if not pids:
                break
            for pid in pids:
                _sigkill(pid)
            time.sleep(POLL_S)
        for proc in self.procs:
            try:
                proc.popen.wait(10)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture
def rig(tmp_path: Path):
    r = Rig(tmp_path)
    try:
        yield r
    finally:
        r.close()
        for proc in r.procs:  # captured: pytest shows it only when the test failed
            print(f"\n===== {proc.name} (exit {proc.popen.returncode}) =====\n{proc.text()[-5000:]}")


def _at(proc: Proc, world: int, step: int = 1) -> bool:
    return any(w == world and s >= step for s, _, w, _ in proc.steps())


# --------------------------------------------------------------------- tests


@pytest.mark.timeout(40)
def test_registry_finds_the_handler_and_it_rendezvouses(rig: Rig) -> None:
    """torch's registry creates our handler from the entry point; one
    next_rendezvous against a live server gives rank 0 of 1, a working store
    and a master port; shutdown marks the job succeeded."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from rdzv_client.torch_plugin import RdzvRendezvousHandler

    rig.start_server()
    params = RendezvousParameters(backend="rdzv", endpoint=rig.endpoint, run_id="unit", min_nodes=1,
                                  max_nodes=1, local_addr="127.0.0.1")
    handler = get_rendezvous_handler(params)
    assert type(handler) is RdzvRendezvousHandler
    assert handler.get_backend() == "rdzv"
    assert handler.use_agent_store is False
    assert handler.get_run_id() == "unit"
    assert handler.is_closed() is False
    assert handler.num_nodes_waiting() == 0
    try:
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        info.store.set("k", b"v")
        assert info.store.get("k") == b"v"
        boot = info.bootstrap_store_info
        assert boot is not None and 0 < boot.master_port < 65536 and boot.master_addr
        assert handler.num_nodes_waiting() == 0
        view = rig.wait_job("unit", lambda v: v["state"] == "running", 5, "job running")
        assert (view["world_size"], len(view["nodes"]), view["nodes"][0]["group_rank"]) == (1, 1, 0)
    finally:
        assert handler.shutdown() is True
    rig.wait_job("unit", lambda v: v["state"] == "succeeded", 5, "job succeeded after shutdown")


@pytest.mark.timeout(60)
def test_two_nodes_form_train_and_succeed(rig: Rig) -> None:
    """(a) two torchrun nodes form one round of world 2, REST shows the job
    running with both; (c) both torchruns exit 0 and the job has succeeded."""
    rig.start_server()
    # a long last call: the two nodes form one round together however slowly torch imports
    nodes = [rig.torchrun(f"node{i}", "form", "1:2", "--steps", "30", "--interval", "0.1",
                          conf="last_call_timeout=20") for i in range(2)]
    wait_until(lambda: all(_at(n, world=2, step=2) for n in nodes), 40, "both nodes' workers at step 2, world 2")
    view = rig.job("form")
    assert view["state"] == "running", view
    assert (view["round"], view["world_size"], len(view["nodes"])) == (0, 2, 2), view
    assert sorted(n["group_rank"] for n in view["nodes"]) == [0, 1]
    assert {n["state"] for n in view["nodes"]} == {"running"}
    ranks = {r for n in nodes for _, r, _, _ in n.steps()}
    assert ranks == {0, 1}
    for n in nodes:
        assert n.wait_exit(30) == 0, n.text()[-3000:]
        assert all(w == 2 for _, _, w, _ in n.steps())
        assert re.search(r"^done rank \d world 2 restart 0$", n.text(), re.M), n.text()[-2000:]
    view = rig.wait_job("form", lambda v: v["state"] == "succeeded", 5, "job succeeded")
    assert [r["round"] for r in view["history"]] == [0]


@pytest.mark.timeout(75)
def test_killing_the_store_host_costs_one_round(rig: Rig) -> None:
    """(b) SIGKILL group rank 0 (torchrun, which hosts the round's TCPStore,
    and its worker): torchrun's own c10d backend cannot survive this. Here the
    survivor re-forms alone (nnodes 1:2) with world 1 and trains on; REST
    history shows round 1, opened because that node was lost, and no restart
    spent. (c) the survivor then finishes: exit 0, job succeeded."""
    rig.start_server()
    nodes = [rig.torchrun(f"node{i}", "kill", "1:2", "--steps", "40", "--interval", "0.1",
                          conf="last_call_timeout=20") for i in range(2)]
    wait_until(lambda: all(_at(n, world=2, step=2) for n in nodes), 40, "both nodes' workers at step 2, world 2")
    view = rig.job("kill")
    assert (view["state"], view["round"], view["world_size"]) == ("running", 0, 2), view
    victim_id = next(n["node_id"] for n in view["nodes"] if n["group_rank"] == 0)
    # the node whose worker is rank 0 is group rank 0 (one worker per node); its id names its pid
    victim = next(n for n in nodes if any(r == 0 for _, r, _, _ in n.steps()))
    assert f"-{victim.pid}-" in victim_id, (victim_id, victim.pid)
    survivor = next(n for n in nodes if n is not victim)
    old_master = (view["master_addr"], view["master_port"])
    killed_at = time.time()
    rig.kill_node(victim)

    view = rig.wait_job("kill", lambda v: v["round"] >= 1 and v["state"] == "running", 20, "round 1 running")
    assert view["round"] == 1, view["history"]
    opened = view["history"][-1]
    assert victim_id in opened["reason"] and "lost" in opened["reason"], opened["reason"]
    assert opened["started_at"] - killed_at < 5, f"round 1 opened {opened['started_at'] - killed_at:.2f}s after"
    assert (view["world_size"], len(view["nodes"])) == (1, 1), view
    assert view["nodes"][0]["group_rank"] == 0 and view["nodes"][0]["node_id"] != victim_id
    assert view["restarts"] == 0, "losing a node is not a worker failure"
    assert (view["master_addr"], view["master_port"]) != old_master
    wait_until(lambda: _at(survivor, world=1, step=3), 30, "the survivor's worker at step 3 with world 1")

    assert survivor.wait_exit(30) == 0, survivor.text()[-3000:]
    assert re.search(r"^done rank 0 world 1 restart \d+$", survivor.text(), re.M), survivor.text()[-2000:]
    view = rig.wait_job("kill", lambda v: v["state"] == "succeeded", 5, "job succeeded")
    assert [r["round"] for r in view["history"]] == [0, 1]


@pytest.mark.timeout(45)
def test_closing_the_job_stops_torchrun(rig: Rig) -> None:
    """``POST /v1/jobs/{id}/close`` (``rdzv close``) while torchrun trains:
    torchrun stops its worker and exits non-zero, naming the closed job."""
    rig.start_server()
    node = rig.torchrun("node0", "closing", "1:1", "--steps", "1000", "--interval", "0.05")
    wait_until(lambda: _at(node, world=1, step=2), 40, "the worker at step 2")
    workers = descendants(node.pid)
    assert workers
    status, body = rig.post("/v1/jobs/closing/close")
    assert (status, body["state"]) == (200, "closed"), body
    rc = node.wait_exit(20)
    assert rc != 0, node.text()[-3000:]
    assert "RendezvousClosedError: job closing closed: " in node.text(), node.text()[-3000:]
    wait_until(lambda: not any(_alive(pid) for pid in workers), 10, "its worker gone")
    assert rig.job("closing")["state"] == "closed"
