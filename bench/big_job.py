"""One big job: N simulated nodes of ONE job against a real rdzv-server.

    python -m bench.big_job --nodes 4096 [--clients 2] [--live-s 10] [--out results.json]

The server is ``python -m rdzv_server`` with its state in SQLite (as
deployed). The nodes are bench/bigagents.py clients in ``--clients``
separate processes; the job is ``N-1:N`` (``last_call_s`` 1 s,
``scale_up_window_s`` 0.1 s, ``heartbeat_timeout_s`` 30 s: heartbeats every
2 s as by default, but no false evictions on a loaded machine), so that it re-forms without the lost node and
a node added later is a scale-up. Measured, in order, on one job:

connect
    every node opens its agent WebSocket, none joins (the upgrades a reconnect
    storm makes): the server's CPU from the first connect to
    ``CONNECT_SETTLE_S`` after the last (what it defers past them counts), per
    upgrade;
formation
    then every node sends its join:
    first join sent -> every node holds its round-0 assignment;
heartbeats
    every node heartbeating (``heartbeat_s`` from the server: it sizes it to
    the nodes it has, rdzv_server.rounds.pace; 2 s from 10,000 nodes)
    and pinging (every ``rdzv_client.client.WS_PING_S``, 15 s: the agent's link pings
    after that long without a frame from the server) for ``--live-s`` seconds: the server
    process's CPU (utime+stime, /proc) and RSS;
node loss
    one node's connection cut (TCP abort, no close frame) -> every survivor
    holds its round-1 assignment. Includes the server's disconnect grace
    (``--disconnect-grace``, 0.5 s by default), after which a node whose
    connection stays lost is out;
scale-up
    one new node joins -> all N hold their round-2 assignment (includes the
    0.1 s scale-up window);
storage per round change
    over the node loss and the scale-up: write requests the server sent
    (``rdzv_storage_write_requests_total``) and bytes the server process
    wrote to disk (/proc/PID/io ``write_bytes``: the WAL's pages and fsyncs,
    less what its log file grew).

With ``--etcd`` (bench/big_job_etcd.py): the nodes follow the leader of the
replicas as the agent does, and after the scale-up the leader is killed
(``leader kill``: kill -9 -> every node back on the new leader and the round
complete); the largest request sent to etcd is shown.

The clients share the cores with the server (a real node has its own
machine): their CPU is reported, and the load average.
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

from rdzv_client.client import WS_PING_S
from rdzv_server.conns import LISTEN_BACKLOG

from . import _common as C
from .server_scale import Server
from .simagents import Clients

TIMEOUT_S = 120.0  # any one step: formation, a re-formation
CONNECT_SETTLE_S = 1.0  # after the connect phase, before the joins: the server's CPU counted to here
# Every node connects before any joins: the join deadline outlasts the connect phase (3-10 s at
# 16,384 nodes), and is no longer than the idle timeout (60 s by default), as with the server's
# defaults (10 s, 60 s): a join then moves no timer (rdzv_server.silence), as in a deployment.
JOIN_DEADLINE_S = 60
# Nodes still heartbeat every 2 s (as with the default 6 s); the longer timeout keeps a server
# that reads late on a loaded shared machine from evicting nodes that did send.
SPEC = {"heartbeat_timeout_s": 30.0}


class BigClients(Clients):
    """bench/bigagents.py processes, driven like bench/simagents.py's."""

    def __init__(self, n: int, url: str, follow: bool = False, classic: bool = False) -> None:
        argv = [sys.executable, "-m", "bench.bigagents", url, *(["--follow"] if follow else [])]
        self.procs = C.start_clients(n, [*argv, "--classic"] if classic else argv)

    def one(self, i: int, cmd: dict) -> dict:
        p = self.procs[i]
        p.stdin.write(json.dumps(cmd) + "\n")
        p.stdin.flush()
        line = p.stdout.readline()
        if not line:
            raise RuntimeError("a client process died")
        return json.loads(line)

    def cpu(self) -> int:
        """The client processes' CPU time, in clock ticks."""
        return sum(C.cpu_ticks(p.pid) or 0 for p in self.procs)

    def wait(self, round_no: int) -> dict:
        ans = self.same({"cmd": "wait", "round": round_no, "timeout": TIMEOUT_S})
        lasts = [a["last"] for a in ans if a["last"] is not None]
        return {"last": max(lasts) if lasts else None, "behind": sum(a["behind"] for a in ans)}


def io_written(pid: int) -> int:
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    return 0


class BigServer(Server):
    def written(self, io_written) -> tuple[int, int]:
        """Bytes this process wrote to disk, and its log's size (the log is in the first)."""
        return io_written(self.pid), self.log.stat().st_size

    def stop(self, grace: float = 5) -> None:
        self.proc.stop(grace)


class Storage:
    """What the server wrote to storage between two readings."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.mark = self._read()

    def _read(self) -> tuple[float, int, int]:
        reqs = self.server.metrics().get("rdzv_storage_write_requests_total", 0.0)
        return reqs, *self.server.written(io_written)

    def delta(self) -> dict:
        time.sleep(0.3)  # the page cache: write_bytes counts pages as they are dirtied, fsync'd at commit
        now = self._read()
        out = {
            "requests": int(now[0] - self.mark[0]),
            "bytes": max(0, (now[1] - self.mark[1]) - (now[2] - self.mark[2])),
            "log_bytes": now[2] - self.mark[2],
        }
        self.mark = self._read()
        return out


def _profiled(tmp: Path, profile: str, per_pid: bool = False) -> str:
    """A "python" that runs the server under cProfile (its stats written to ``profile`` at exit;
    ``per_pid``: to ``profile.PID``, one file per replica)."""
    wrapper = tmp / "python-profiled"
    out = f"{Path(profile).resolve()}" + (".$$" if per_pid else "")
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} -m cProfile -o {out} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def run(
    n: int,
    n_clients: int = 2,
    live_s: float = 10.0,
    log=print,
    profile: str | None = None,
    etcd: int | None = None,
    lease_ttl: int | None = None,
    classic: bool = False,
    kill_after: float | None = None,
) -> dict:
    """One job of ``n`` nodes; ``etcd``: on that many ``--etcd`` replicas (bench/big_job_etcd.py,
    ``--etcd-lease-ttl lease_ttl``), else SQLite."""
    C.raise_nofile()
    tmp = Path(tempfile.mkdtemp(prefix="rdzv-bench-big-"))
    job = f"big{n}-{os.getpid()}"
    spec = {"min_nodes": n - 1, "max_nodes": n, "last_call_s": 1.0, "scale_up_window_s": 0.1, **SPEC}
    out: dict = {"nodes": n, "clients": n_clients, "load_before": C.loadavg(), "classic": classic}
    python = _profiled(tmp, profile, per_pid=bool(etcd)) if profile else sys.executable
    if etcd:
        from .big_job_etcd import EtcdServer

        server: BigServer | EtcdServer = EtcdServer(tmp, etcd, python, lease_ttl)
    else:
        server = BigServer(tmp, python=python, extra=["--join-deadline", str(JOIN_DEADLINE_S)])
    out["storage"] = f"etcd, {etcd} replica(s)" if etcd else "SQLite"
    clients = None
    try:
        if isinstance(server, BigServer):
            clients = BigClients(n_clients, server.url + "/v1/agent", classic=classic)
        else:  # every replica: the nodes follow the leader (bench/big_job_etcd.py)
            clients = BigClients(n_clients, server.endpoint, follow=True, classic=classic)
        ids = [[f"n{i}", i] for i in range(n)]
        t0, cpu, ccpu = time.time(), C.cpu_ticks(server.pid), clients.cpu()
        clients.all(
            [{"cmd": "connect", "job": job, "spec": spec, "nodes": ids[i::n_clients]} for i in range(n_clients)]
        )
        out["connect_s"] = time.time() - t0
        out["connect_client_cpu_s"] = (clients.cpu() - ccpu) / C.CLK_TCK
        time.sleep(CONNECT_SETTLE_S)  # what the server defers past the storm (its GC) counts too
        out["connect_cpu_s"] = (C.cpu_ticks(server.pid) - cpu) / C.CLK_TCK
        # formation
        cpu, ccpu = C.cpu_ticks(server.pid), clients.cpu()
        sent = [s for a in clients.same({"cmd": "join", "nodes": None}) for s in a["sent"]]
        got = clients.wait(0)
        out["formation_s"] = got["last"] - min(sent) if got["last"] and not got["behind"] else None
        out["formation_behind"] = got["behind"]
        out["formation_cpu_s"] = (C.cpu_ticks(server.pid) - cpu) / C.CLK_TCK
        out["formation_client_cpu_s"] = (clients.cpu() - ccpu) / C.CLK_TCK
        log(f"[big_job] N={n}: formation {out['formation_s']} s (load {C.loadavg()})")
        # heartbeats, steady state
        time.sleep(3.0)
        c0 = [s["cpu_ticks"] for s in clients.same({"cmd": "stats"})]
        t_start, s0 = time.time(), C.cpu_ticks(server.pid)
        time.sleep(live_s)
        s1, wall = C.cpu_ticks(server.pid), time.time() - t_start
        stats = clients.same({"cmd": "stats"})
        c1 = [s["cpu_ticks"] for s in stats]
        out["hb_s"] = sorted({t for s in stats for t in s.get("hb_s", [])})  # the intervals the server told
        out["hb_server_cpu"] = (s1 - s0) / C.CLK_TCK / wall
        out["hb_client_cpu"] = sum(b - a for a, b in zip(c0, c1, strict=True)) / C.CLK_TCK / wall
        out["server_rss_mb"] = C.status_kb(server.pid, "VmRSS") / 1024
        out["hb_load"] = C.loadavg()
        log(
            f"[big_job] N={n}: heartbeats {out['hb_server_cpu'] * 100:.1f}% of a core, "
            f"RSS {out['server_rss_mb']:.0f} MB"
        )
        # node loss: the last node (rank 0 stays: its master address does not move)
        storage = Storage(server)
        victim = n - 1
        out["dropped_before_loss"] = sum(a["dropped"] for a in clients.same({"cmd": "stats"}))
        cpu, ccpu = C.cpu_ticks(server.pid), clients.cpu()
        t_drop = clients.one(victim % n_clients, {"cmd": "drop", "node": f"n{victim}"})["t"]
        got = clients.wait(1)
        out["node_loss_s"] = got["last"] - t_drop if got["last"] and not got["behind"] else None
        out["node_loss_behind"] = got["behind"]
        out["node_loss_cpu_s"] = (C.cpu_ticks(server.pid) - cpu) / C.CLK_TCK
        out["node_loss_client_cpu_s"] = (clients.cpu() - ccpu) / C.CLK_TCK
        out["node_loss_storage"] = storage.delta()
        log(f"[big_job] N={n}: node loss {out['node_loss_s']} s, storage {out['node_loss_storage']}")
        # scale-up: one new node
        clients.one(0, {"cmd": "connect", "job": job, "spec": spec, "nodes": [[f"n{n}", n]]})
        cpu, ccpu = C.cpu_ticks(server.pid), clients.cpu()
        t_join = clients.one(0, {"cmd": "join", "nodes": [f"n{n}"]})["sent"][0]
        got = clients.wait(2)
        out["scale_up_s"] = got["last"] - t_join if got["last"] and not got["behind"] else None
        out["scale_up_behind"] = got["behind"]
        out["scale_up_cpu_s"] = (C.cpu_ticks(server.pid) - cpu) / C.CLK_TCK
        out["scale_up_client_cpu_s"] = (clients.cpu() - ccpu) / C.CLK_TCK
        out["scale_up_storage"] = storage.delta()
        log(f"[big_job] N={n}: scale-up {out['scale_up_s']} s, storage {out['scale_up_storage']}")
        if not isinstance(server, BigServer):
            from .big_job_etcd import RUNNING_S, leader_kill

            if etcd and etcd > 1:
                running_s = RUNNING_S if kill_after is None else kill_after
                out["leader_kill"] = leader_kill(server, clients, job, n, log, running_s)
            out["max_request_bytes"] = server.max_request_bytes()
        view = server.job(job) or {}
        out["final_round"], out["final_world"] = view.get("round"), view.get("world_size")
        out["stalls"] = server.stalls()
        server.close_job(job)
    finally:
        if clients is not None:
            clients.stop()
        server.stop(60 if profile else 5)  # a profiled server writes its stats as it exits
        if os.environ.get("BENCH_KEEP_TMP"):
            log(f"[big_job] kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    out["load_after"] = C.loadavg()
    return out


def _s(v: float | None) -> str:
    return "did not complete" if v is None else f"{v:.2f} s"


def _cpu(r: dict, phase: str) -> str:
    """A phase's time, and the server's and clients' CPU time meanwhile (less inflated by a loaded machine)."""
    return (
        _s(r[f"{phase}_s"]) + f" (CPU: server {r[f'{phase}_cpu_s']:.2f} s, clients {r[f'{phase}_client_cpu_s']:.2f} s)"
    )


def _st(d: dict) -> str:
    return f"{d['requests']} requests, {d['bytes'] / 1024:.0f} KiB (log {d['log_bytes'] / 1024:.0f} KiB)"


def table(results: list[dict]) -> str:
    rows = []
    for r in results:
        n = r["nodes"]
        rows += [
            [
                f"N={n} connect: N agent WebSockets opened, none joined (the upgrades of a reconnect storm)",
                _cpu(r, "connect") + f", {r['connect_cpu_s'] / n * 1e6:.0f} us of server CPU per upgrade"
                f" (incl. {CONNECT_SETTLE_S:g} s after)",
            ],
            [
                f"N={n} formation: first join -> all assigned",
                _cpu(r, "formation")
                + (f" ({r['dropped_before_loss']} connections lost)" if r["dropped_before_loss"] else ""),
            ],
            [f"N={n} node loss: connection cut -> all survivors reassigned (incl. 0.5 s grace)", _cpu(r, "node_loss")],
            [f"N={n} scale-up: one node joins -> all N reassigned (incl. 0.1 s window)", _cpu(r, "scale_up")],
            [f"N={n} storage written, node-loss round change", _st(r["node_loss_storage"])],
            [f"N={n} storage written, scale-up round change", _st(r["scale_up_storage"])],
            [
                f"N={n} all heartbeating ({'/'.join(f'{t:g}' for t in r.get('hb_s', [])) or '?'} s) "
                f"and pinging ({WS_PING_S:g} s)",
                f"server CPU {r['hb_server_cpu'] * 100:.1f}% of a core, RSS {r['server_rss_mb']:.0f} MB "
                f"(clients {r['hb_client_cpu'] * 100:.0f}%, load {r['hb_load']})",
            ],
        ]
        if "max_request_bytes" in r:
            from .big_job_etcd import rows as etcd_rows

            rows += etcd_rows(r)
    how = ", classic round changes" if results[0].get("classic") else ""
    return C.md_table([f"big job ({results[0]['storage']}{how})", "result"], rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.big_job", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="4096", help="comma-separated N (one job each, a fresh server each)")
    p.add_argument("--clients", type=int, default=2, help="client processes")
    p.add_argument("--live-s", type=float, default=10.0, help="seconds of heartbeats measured")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument(
        "--profile",
        default=None,
        help="run the server under cProfile; its stats go to this file (--etcd: each replica's to FILE.PID)",
    )
    p.add_argument("--etcd", action="store_true", help="on rdzv-server --etcd replicas and a 3-member etcd")
    p.add_argument("--replicas", type=int, default=3, help="with --etcd: how many replicas")
    p.add_argument(
        "--lease-ttl", type=int, default=None, help="with --etcd: the replicas' --etcd-lease-ttl (default: bench.ha's)"
    )
    p.add_argument(
        "--classic",
        action="store_true",
        help="nodes offer no direct ports: every round change is restart, join again, assigned (as before)",
    )
    p.add_argument(
        "--kill-after",
        type=float,
        default=None,
        help="with --etcd: seconds the job runs after its last round change before the leader kill "
        "(default: bench/big_job_etcd.py's RUNNING_S, by when the successor's copy of the state is current)",
    )
    a = p.parse_args(argv)
    # a network namespace of its own, with the accept queue deploy/README.md asks of big jobs' hosts
    # (else a reconnect storm of more than the host's somaxconn, 4096 by default, is turned away
    # in part and waits out SYN retries of 1 s, 3 s: the kernel's queue measured, not the server)
    C.reexec_in_netns("bench.big_job", sys.argv[1:] if argv is None else argv, backlog=LISTEN_BACKLOG)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # the server and clients are stopped on the way out
    ns = [int(x) for x in a.nodes.split(",") if x.strip()]
    if any(n < 2 for n in ns):
        p.error("--nodes: each N must be at least 2")
    log = lambda s: print(s, file=sys.stderr)  # noqa: E731
    if a.profile and len(ns) > 1:
        p.error("--profile: one N at a time")
    results = [
        run(
            n, a.clients, a.live_s, log, a.profile, a.replicas if a.etcd else None, a.lease_ttl, a.classic, a.kill_after
        )
        for n in ns
    ]
    print(table(results))
    print(f"\nload average before/after: {results[0]['load_before']} / {results[-1]['load_after']}")
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
