"""rdzv against torchrun, side by side, on this machine.

Each row is measured once per run for each launcher; runs interleave the two
launchers (rdzv first on even runs, torchrun first on odd ones). Every node is
a real agent process with one worker, all on this host, talking over
loopback. Workers are ``bench/scripts/stamp.py``, the same file for both.

rdzv side: a fresh ``python -m rdzv_server --host 127.0.0.1 --port P
--data-dir TMP`` per row and run (started before the clock starts, not
counted), and ``python -m rdzv_client.agent --endpoint 127.0.0.1:P --job-id J
--local-addr 127.0.0.1 --nnodes .. --nproc-per-node 1 --max-restarts 3``.

torchrun side: ``python -m torch.distributed.run --rdzv-backend=c10d
--rdzv-endpoint=127.0.0.1:P --rdzv-id=J --rdzv-conf=is_host=1`` for the first
agent (it hosts the c10d store) and ``is_host=0`` for the others, with the
same ``--nnodes``, ``--nproc-per-node 1``, ``--max-restarts 3`` and
``--local-addr 127.0.0.1``. Defaults that differ and are left as they are:
last call 1 s (rdzv) vs 30 s (torchrun); torchrun's --monitor-interval 0.1 s;
rdzv's heartbeat timeout 6 s vs torchrun's 5 s keep-alive (3 misses).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from . import _common as C

STAMP = C.SCRIPTS / "stamp.py"
TAG_VAR = "RDZV_BENCH_TAG"
LAUNCHERS = ("rdzv", "torchrun")
STEP_BOUND_S = 30.0  # after the restart: until the first all_reduce of the new world
STEP_KEYS = {
    "node_loss": "kill_to_first_step",
    "host_loss": "kill_to_first_step",
    "scale_up": "launch_to_first_step",
    "worker_crash": "crash_to_first_step",
}
_SCRUB_PREFIXES = ("SLURM_", "PET_", "RDZV_", "TORCHELASTIC_", "MASTER_", "TORCH_NCCL_")
_SCRUB = {
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
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(_SCRUB_PREFIXES) and k not in _SCRUB}
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


def _all_started(cl: Cluster, world: int, after: float = 0.0, what: str = "start") -> float | None:
    """The time by which every rank 0..world-1 had a ``what`` line with this
    world size after ``after`` (None: not yet)."""
    first: dict[int, float] = {}
    for ln in cl.lines():
        if ln.what == what and ln.world == world and ln.t > after and 0 <= ln.rank < world:
            first.setdefault(ln.rank, ln.t)
    return max(first.values()) if len(first) == world else None


def _wait_started(
    cl: Cluster, world: int, bound: float, after: float = 0.0, what: str = "start", agents: list[C.Proc] | None = None
) -> tuple[float | None, str | None]:
    """Wait for every rank to start; (time, None) or (None, why not)."""
    watch = agents if agents is not None else cl.agents
    deadline = time.time() + bound
    while time.time() < deadline:
        t = _all_started(cl, world, after, what)
        if t is not None:
            return t, None
        if watch and all(a.poll() is not None for a in watch):
            t = _all_started(cl, world, after, what)
            if t is not None:
                return t, None
            codes = ",".join(str(a.popen.returncode) for a in watch)
            gone = max(a.exited_at or time.time() for a in watch)
            return None, f"job died: every agent exited ({codes}) {gone - (after or watch[0].launched_at):.0f} s in"
        time.sleep(0.02)
    return None, None


# --------------------------------------------------------------------- rows


def row_rendezvous(cl: Cluster, n: int, bound: float) -> Outcome:
    """Last agent launched -> every worker started (stamp before any import)."""
    for _ in range(n):
        cl.launch(str(n), cl.stamp_cmd())
    t_last = cl.agents[-1].launched_at
    t, why = _wait_started(cl, n, bound)
    if t is None:
        return Outcome(None, why or f"> {bound:g} s")
    info = {"first_launch_to_all_started": t - cl.agents[0].launched_at}
    if cl.launcher == "rdzv":
        hist = C.wait_until(lambda: [h for h in cl.history() if h.get("completed_at")], 5) or []
        if hist:
            info["server_first_join_to_complete"] = hist[0]["completed_at"] - hist[0]["started_at"]
    C.wait_until(lambda: all(a.poll() is not None for a in cl.agents), 30)
    info["exit_codes"] = [a.popen.returncode for a in cl.agents]
    return Outcome(t - t_last, info=info)


def row_wall(cl: Cluster, n: int, bound: float) -> Outcome:
    """First agent launched -> every agent exited, worker ``true``."""
    for _ in range(n):
        cl.launch(str(n), ["true"], no_python=True)
    t0 = cl.agents[0].launched_at
    done = C.wait_until(lambda: all(a.poll() is not None for a in cl.agents), bound, 0.01)
    if not done:
        return Outcome(None, f"> {bound:g} s")
    codes = [a.popen.returncode for a in cl.agents]
    if any(codes):
        return Outcome(None, f"agents exited {codes}")
    return Outcome(max(a.exited_at for a in cl.agents) - t0, info={"exit_codes": codes})


def row_elastic(cl: Cluster, bound: float) -> Outcome:
    """--nnodes 2:4 with 2 agents: last launch -> both workers started."""
    for _ in range(2):
        cl.launch("2:4", cl.stamp_cmd())
    t_last = cl.agents[-1].launched_at
    t, why = _wait_started(cl, 2, bound)
    if t is None:
        return Outcome(None, why or f"> {bound:g} s")
    return Outcome(t - t_last)


def _form(cl: Cluster, n: int, nnodes: str, bound: float, extra: tuple[str, ...] = ()) -> Outcome | None:
    """n agents training with --loop; None once every worker did a collective."""
    for _ in range(n):
        cl.launch(nnodes, cl.stamp_cmd("--loop", *extra))
    t, why = _wait_started(cl, n, bound, what="step1")
    if t is None:
        return Outcome(None, f"setup failed: {why or f'no world {n} in {bound:g} s'}")
    return None


class FirstContact:
    """A stand-in for the rendezvous endpoint that only timestamps the first
    contact, on its own thread: for rdzv, the first WebSocket text frame whose
    op is ``join`` (on the real agent path); for torchrun, the first bytes a
    connection sends (its c10d store client, ``is_host=0``)."""

    def __init__(self, port: int, ws: bool) -> None:
        import asyncio
        import threading

        self.port, self.ws = port, ws
        self.at: float | None = None
        self.pid: int | None = None  # the agent's: its CPU time is read at the first contact
        self.cpu_s: float | None = None
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="first-contact", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("first-contact listener did not start")

    def _run(self) -> None:
        import asyncio

        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        self._ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self._stop())
        self.loop.close()

    async def _start(self) -> None:
        import asyncio

        if self.ws:
            from aiohttp import web

            from rdzv_common.protocol import AGENT_PATH

            app = web.Application()
            app.router.add_get(AGENT_PATH, self._on_ws)
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        else:
            self._server = await asyncio.start_server(self._on_raw, "127.0.0.1", self.port)

    async def _stop(self) -> None:
        if self.ws:
            await self._runner.cleanup()
        else:
            self._server.close()
            await self._server.wait_closed()

    async def _on_ws(self, request):
        from aiohttp import WSMsgType, web

        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for msg in ws:
            if msg.type == WSMsgType.TEXT:
                try:
                    op = json.loads(msg.data).get("op")
                except ValueError:
                    op = None
                if op == "join":
                    self._stamp()
                    break
        await ws.close()
        return ws

    async def _on_raw(self, reader, writer) -> None:
        try:
            if await reader.read(1):
                self._stamp()
        finally:
            writer.close()

    def _stamp(self) -> None:
        if self.at is None:
            self.at = time.time()
            ticks = C.cpu_ticks(self.pid) if self.pid else None
            self.cpu_s = ticks / C.CLK_TCK if ticks is not None else None

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def _floor_s(code: str, reps: int = 3) -> float:
    """Best wall time of ``python -c CODE`` (what an import costs by itself here)."""
    import subprocess

    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, cwd=C.ROOT)
        best = min(best, time.perf_counter() - t)
    return best


def row_join_sent(cl: Cluster, bound: float, floor_reps: int = 3) -> Outcome:
    """Agent launched -> its first word reaches the rendezvous endpoint: for
    rdzv the join frame, for torchrun its first bytes to the c10d store. No
    round forms: a listener stands in for the server (FirstContact). The
    import costs beside it are the best of ``floor_reps`` runs each."""
    port = C.free_port()
    listener = FirstContact(port, ws=cl.launcher == "rdzv")
    cl.endpoint = f"127.0.0.1:{port}"
    try:
        agent = cl.launch("1", ["true"], no_python=True, is_host=False)
        listener.pid = agent.pid
        if not C.wait_until(lambda: listener.at is not None or agent.poll() is not None, bound, 0.005):
            return Outcome(None, f"> {bound:g} s")
        if listener.at is None:
            return Outcome(None, f"agent exited {agent.popen.returncode} before it spoke")
        info = {"agent_cpu_s": listener.cpu_s}
        if cl.launcher == "rdzv":
            info.update(
                floor_reps=floor_reps,
                python_floor_s=_floor_s("pass", floor_reps),
                aiohttp_import_s=_floor_s("import aiohttp", floor_reps),
                protocol_import_s=_floor_s("import rdzv_common.protocol", floor_reps),
            )
        return Outcome(listener.at - agent.launched_at, info=info)
    finally:
        listener.close()


def row_node_loss(cl: Cluster, victim_kind: str, bound: float, setup_bound: float) -> Outcome:
    """3 agents (2:3) train; SIGKILL one node (agent + workers) -> both
    survivors' workers started again with world 2.

    victim_kind "plain": a node that is neither rank 0 nor torchrun's store
    host. "host": torchrun's store host (agent 0) / rdzv's group rank 0 (its
    worker hosts the workers' TCPStore; rdzv has no store on the agents)."""
    bad = _form(cl, 3, "2:3", setup_bound)
    if bad:
        return bad
    time.sleep(0.5)
    pid_of = {}
    for ln in cl.lines():
        if ln.what == "step1" and ln.world == 3:
            pid_of[ln.rank] = ln.pid
    owners = {r: cl.agent_of(p) for r, p in pid_of.items()}
    host = cl.agents[0] if cl.launcher == "torchrun" else None
    if victim_kind == "host":
        victim = host if host is not None else owners.get(0)
    else:
        victim = next((owners[r] for r in (2, 1) if owners.get(r) is not None and owners[r] is not host), None)
    if victim is None:
        return Outcome(None, "could not find the victim's agent")
    survivors = [a for a in cl.agents if a is not victim]
    t_kill = time.time()
    C.kill_tree(victim.pid)
    t, why = _wait_started(cl, 2, bound, after=t_kill, agents=survivors)
    if t is None:
        return Outcome(None, why or f"no recovery in {bound:g} s")
    t_step, _ = _wait_started(cl, 2, STEP_BOUND_S, after=t_kill, what="step1", agents=survivors)
    return Outcome(
        t - t_kill, info={"kill_to_first_step": (t_step - t_kill) if t_step else None, "victim": victim.name}
    )


def row_scale_up(cl: Cluster, bound: float, setup_bound: float) -> Outcome:
    """2 agents (2:3) train; a third is launched -> 3 workers started with world 3."""
    bad = _form(cl, 2, "2:3", setup_bound)
    if bad:
        return bad
    time.sleep(0.5)
    third = cl.launch("2:3", cl.stamp_cmd("--loop"))
    t, why = _wait_started(cl, 3, bound, after=third.launched_at)
    if t is None:
        return Outcome(None, why or f"no world 3 in {bound:g} s")
    t_step, _ = _wait_started(cl, 3, STEP_BOUND_S, after=third.launched_at, what="step1")
    return Outcome(
        t - third.launched_at, info={"launch_to_first_step": (t_step - third.launched_at) if t_step else None}
    )


def row_worker_crash(cl: Cluster, bound: float, setup_bound: float) -> Outcome:
    """2 agents (2:2) train; rank 1 exits 1 once after its first step ->
    both workers started again."""
    marker = cl.dir / "crashed"
    for _ in range(2):
        cl.launch("2", cl.stamp_cmd("--loop", "--fail-once", str(marker), "--fail-rank", "1"))
    crash = C.wait_until(lambda: [ln for ln in cl.lines() if ln.what == "crash"], setup_bound)
    if not crash:
        return Outcome(None, f"setup failed: no crash in {setup_bound:g} s")
    t_crash = crash[0].t
    t, why = _wait_started(cl, 2, bound, after=t_crash)
    if t is None:
        return Outcome(None, why or f"no recovery in {bound:g} s")
    t_step, _ = _wait_started(cl, 2, STEP_BOUND_S, after=t_crash, what="step1")
    return Outcome(t - t_crash, info={"crash_to_first_step": (t_step - t_crash) if t_step else None})


def row_footprint(cl: Cluster, window: float) -> Outcome:
    """One agent (nnodes 1) supervising ``sleep``: the agent process only:
    peak RSS (VmHWM, MiB) as value; CPU share over ``window`` s in info."""
    agent = cl.launch("1", ["sleep", str(window + 5)], no_python=True)
    started = C.wait_until(lambda: [p for p in C.descendants(agent.pid) if _comm(p) == "sleep"], 60)
    if not started:
        return Outcome(None, "worker did not start")
    time.sleep(0.5)
    c0, t0 = C.cpu_ticks(agent.pid), time.time()
    time.sleep(window)
    c1, t1 = C.cpu_ticks(agent.pid), time.time()
    hwm = C.status_kb(agent.pid, "VmHWM")
    if None in (c0, c1, hwm):
        return Outcome(None, "agent exited early")
    return Outcome(
        hwm / 1024,
        info={
            "cpu_pct": (c1 - c0) / C.CLK_TCK / (t1 - t0) * 100,
            "rss_mib": (C.status_kb(agent.pid, "VmRSS") or 0) / 1024,
        },
    )


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


# ------------------------------------------------------------------- plan


@dataclass
class Row:
    key: str
    title: str
    fn: Callable[[Cluster], Outcome]
    unit: str = "s"
    launchers: tuple[str, ...] = LAUNCHERS
    slow: bool = False  # torchrun waits out long timeouts here: fewer runs by default
    server: bool = True  # rdzv: start a real rdzv-server for the row


def plan(quick: bool = False, smoke: bool = False) -> list[Row]:
    if smoke:
        return [
            Row(
                "join_sent",
                "0. Start-up: agent launched -> join sent",
                lambda cl: row_join_sent(cl, 30, floor_reps=1),
                launchers=("rdzv",),
                server=False,
            ),
            Row(
                "rdzv_n2",
                "1. Rendezvous N=2: last agent launched -> all workers started",
                lambda cl: row_rendezvous(cl, 2, 30),
                launchers=("rdzv",),
            ),
        ]
    rows = [
        Row(
            "join_sent",
            "0. Start-up: agent launched -> join sent (torchrun: first bytes to its store)",
            lambda cl: row_join_sent(cl, 30),
            server=False,
        )
    ]
    for n in (2, 4) if quick else (2, 4, 8):
        rows.append(
            Row(
                f"rdzv_n{n}",
                f"1. Rendezvous N={n}: last agent launched -> all workers started",
                lambda cl, n=n: row_rendezvous(cl, n, 90),
            )
        )
    for n in (2,) if quick else (2, 4):
        rows.append(
            Row(
                f"wall_n{n}",
                f"2. Whole job N={n} (`--no-python true`): first launch -> all agents exited",
                lambda cl, n=n: row_wall(cl, n, 120),
            )
        )
    b3 = 10 if quick else 45
    rows.append(
        Row(
            "elastic_2_4",
            f"3. `--nnodes 2:4`, 2 nodes: last launch -> workers started (bound {b3} s)",
            lambda cl: row_elastic(cl, b3),
            slow=True,
        )
    )
    b4 = 20 if quick else 90
    rows.append(
        Row(
            "node_loss",
            f"4a. Node loss (SIGKILL a non-rank-0, non-store node of 3, 2:3) -> "
            f"survivors started with world 2 (bound {b4} s)",
            lambda cl: row_node_loss(cl, "plain", b4, 90),
            slow=True,
        )
    )
    if not quick:
        rows.append(
            Row(
                "host_loss",
                f"4b. Node loss: torchrun's c10d store host / rdzv's group rank 0 -> "
                f"survivors started with world 2 (bound {b4} s)",
                lambda cl: row_node_loss(cl, "host", b4, 90),
                slow=True,
            )
        )
        rows.append(
            Row(
                "scale_up",
                "5. Scale-up 2 -> 3 (2:3): third agent launched -> 3 workers started with world 3 (bound 90 s)",
                lambda cl: row_scale_up(cl, 90, 90),
                slow=True,
            )
        )
    b6 = 20 if quick else 90
    rows.append(
        Row(
            "worker_crash",
            f"6. Worker crash (rank 1 exits 1 once, 2 nodes): crash -> both workers started again (bound {b6} s)",
            lambda cl: row_worker_crash(cl, b6, 90),
        )
    )
    w7 = 3 if quick else 10
    rows.append(
        Row(
            "footprint",
            f"7. Agent peak RSS (VmHWM, agent process only), supervising `sleep`; CPU over {w7} s in brackets",
            lambda cl: row_footprint(cl, w7),
            unit="MiB",
        )
    )
    return rows


def measure(
    rows: list[Row], runs: int, tmp: Path, log=print, launchers=LAUNCHERS, slow_runs: int | None = None
) -> dict:
    """Every row ``runs`` times (slow rows ``slow_runs`` times), launchers
    interleaved. Returns raw results."""
    results: dict[str, dict[str, list[Outcome]]] = {r.key: {name: [] for name in launchers} for r in rows}
    slow_runs = runs if slow_runs is None else slow_runs
    for run in range(max(runs, slow_runs)):
        for row in rows:
            if run >= (slow_runs if row.slow else runs):
                continue
            order = [name for name in launchers if name in row.launchers]
            if run % 2:
                order.reverse()
            for launcher in order:
                cl = Cluster(launcher, tmp, row.key, server=row.server)
                t0 = time.time()
                try:
                    out = row.fn(cl)
                except Exception as e:  # a broken measurement must not stop the others
                    out = Outcome(None, f"error: {e!r}"[:200])
                finally:
                    cl.close()
                out.info["load"] = C.loadavg()
                out.info["took_s"] = round(time.time() - t0, 1)
                results[row.key][launcher].append(out)
                shown = f"{out.value:.3f}" if out.value is not None else out.failure
                log(
                    f"[bench] run {run + 1} {row.key} {launcher}: {shown} "
                    f"(took {out.info['took_s']} s, load {out.info['load']})"
                )
    return results


def _cell(outs: list[Outcome], unit: str, row: Row) -> tuple[str, float | None]:
    if not outs:
        return "-", None
    vals = [o.value for o in outs if o.value is not None]
    fails = [o.failure for o in outs if o.value is None]
    parts = []
    med = C.median(vals) if vals else None
    if vals:
        fmt = (lambda v: f"{v:.0f}") if unit == "MiB" else (lambda v: f"{v:.2f}")
        text = f"{fmt(med)} {unit}"
        if len(vals) > 1:
            text += f" ({fmt(min(vals))}-{fmt(max(vals))})"
        if row.key == "footprint":
            cpus = [o.info.get("cpu_pct", 0.0) for o in outs if o.value is not None]
            text += f" [{C.median(cpus):.2f}% CPU]"
        step_key = STEP_KEYS.get(row.key)
        if step_key:
            steps = [o.info.get(step_key) for o in outs if o.value is not None]
            got = [v for v in steps if v is not None]
            text += f" [1st all_reduce {C.median(got):.1f} s" if got else " [1st all_reduce: none"
            text += (
                f", none in {STEP_BOUND_S:g} s in {len(steps) - len(got)} run(s)]"
                if got and len(got) < len(steps)
                else (f" in {STEP_BOUND_S:g} s]" if not got else "]")
            )
        parts.append(text)
    if fails:
        counts: dict[str, list[int]] = {}
        for f in fails:
            m = re.search(r" (\d+) s in$", f)
            key = f[: m.start()] if m else f
            counts.setdefault(key, []).append(int(m.group(1)) if m else -1)
        texts = []
        for f, secs in counts.items():
            known = sorted(x for x in secs if x >= 0)
            when = ""
            if known:
                when = f" {known[0]} s in" if len(set(known)) == 1 else f" {known[0]}-{known[-1]} s in"
            texts.append(f + when + (f" ({len(secs)}/{len(outs)} runs)" if len(outs) > 1 else ""))
        parts.append("; ".join(texts))
    return "; ".join(parts), med if not fails else (med if vals else None)


def table(rows: list[Row], results: dict) -> str:
    body = []
    for row in rows:
        r = results[row.key]
        rc, rm = _cell(r.get("rdzv", []), row.unit, row)
        tc, tm = _cell(r.get("torchrun", []), row.unit, row)
        if "torchrun" not in row.launchers:
            tc = "n/a"
        ratio = (
            f"{rm / tm:.2f}"
            if rm is not None and tm and not any(o.value is None for o in r.get("torchrun", []) + r.get("rdzv", []))
            else "-"
        )
        if ratio == "-" and rm is not None and r.get("torchrun") and all(o.value is None for o in r["torchrun"]):
            bounds = [re.fullmatch(r"> (\d+(?:\.\d+)?) s", o.failure or "") for o in r["torchrun"]]
            ratio = (
                f"< {rm / min(float(m.group(1)) for m in bounds):.2f}" if all(bounds) else "torchrun did not recover"
            )
        body.append([row.title, rc, tc, ratio])
    return C.md_table(["row", "rdzv median (min-max)", "torchrun median (min-max)", "rdzv/torchrun"], body)


def info_lines(results: dict) -> list[str]:
    """Secondary numbers worth a line under the table."""
    out = []
    for key, by in results.items():
        for o in by.get("rdzv", []):
            if "server_first_join_to_complete" in o.info:
                out.append((key, o.info["server_first_join_to_complete"]))
    lines = []
    keys = sorted({k for k, _ in out}, key=lambda k: int(k.split("n")[-1]) if k.split("n")[-1].isdigit() else 0)
    for k in keys:
        vals = [v for kk, v in out if kk == k]
        lines.append(
            f"- rdzv server history, {k}: first join -> round complete (completed_at - started_at), "
            f"median {C.median(vals) * 1000:.0f} ms over {len(vals)} run(s); the rest of row 1 is agent "
            f"start-up (Python imports, connect) and worker spawn"
        )
    floors = [o.info for o in results.get("join_sent", {}).get("rdzv", []) if "aiohttp_import_s" in o.info]
    if floors:
        lines.append(
            f"- row 0, what a bare `python -c` costs here (best of {floors[0].get('floor_reps', 3)}, wall, "
            "per run's median): nothing "
            f"{C.median([f['python_floor_s'] for f in floors]) * 1000:.0f} ms, `import aiohttp` "
            f"{C.median([f['aiohttp_import_s'] for f in floors]) * 1000:.0f} ms, `import "
            f"rdzv_common.protocol` (pydantic and the wire models) "
            f"{C.median([f['protocol_import_s'] for f in floors]) * 1000:.0f} ms: the agent needs neither "
            "before its join frame (its WebSocket client is rdzv_client/wsclient.py; pydantic "
            "comes right after the join)"
        )
    for launcher in LAUNCHERS:
        cpu = [
            o.info["agent_cpu_s"]
            for o in results.get("join_sent", {}).get(launcher, [])
            if o.info.get("agent_cpu_s") is not None
        ]
        if cpu:
            lines.append(
                f"- row 0, {launcher}: the agent's own CPU time (user+sys) when its first word arrived, "
                f"median {C.median(cpu) * 1000:.0f} ms over {len(cpu)} run(s) (less load-dependent "
                "than the wall time)"
            )
    if any(k in results for k in STEP_KEYS):
        lines.append(
            "- rows 4-6, [1st all_reduce]: from the same start of the clock until every worker of the "
            "new world finished its first gloo all_reduce (import torch and init_process_group "
            f"included; waited for up to {STEP_BOUND_S:g} s after the workers started)"
        )
    return lines


def to_json(rows: list[Row], results: dict) -> dict:
    return {
        row.key: {
            "title": row.title,
            "unit": row.unit,
            **{
                name: [{"value": o.value, "failure": o.failure, "info": o.info} for o in outs]
                for name, outs in results[row.key].items()
            },
        }
        for row in rows
    }
