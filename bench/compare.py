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

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import _common as C
from .cluster import Cluster, Outcome
from .first_contact import FirstContact, _floor_s

LAUNCHERS = ("rdzv", "torchrun")
STEP_BOUND_S = 30.0  # after the restart: until the first all_reduce of the new world
STEP_KEYS = {
    "node_loss": "kill_to_first_step",
    "host_loss": "kill_to_first_step",
    "scale_up": "launch_to_first_step",
    "worker_crash": "crash_to_first_step",
}


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
