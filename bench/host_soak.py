"""python -m bench.host_soak [--seconds S] [--hogs N] [--sims K] [--stop-every S] [--impair-every S]
                           [--impair-for S] [--delay S] [--loss P] [--seed N] [--out FILE.json]

No false eviction (issue 23's soak target): 3 real agents (process mode,
default flags, bench/scripts/stamp.py workers doing a gloo all_reduce every
0.1 s), each in a network namespace of its own (tests/helpers/netlab.NetLab),
the server in the hub namespace, and ``--sims`` simulated nodes (bench/
simagents.py, a second job of that many nodes on the same server,
heartbeating, from client processes in the hub namespace), for ``--seconds``:

* ``--hogs`` busy processes (``while True: pass``; one per core loads the machine);
* every ``--stop-every`` s a random real agent process is SIGSTOPped for 1 s
  (its peers stop hearing its probe answers and suspect it; its kernel still
  acknowledges the server's probe);
* every ``--impair-every`` s (the first half-way into the first period), node
  0's link gets ``--delay`` added delay and ``--loss`` loss for
  ``--impair-for`` s. This kernel has no ``sch_netem``: node 0 is linked to
  the hub through tests/helpers/netem.py's userspace forwarder (TUN devices;
  the impairment is netem's on the node's interface: its outgoing packets);
  a UDP echo through it measures the round trip, impaired and not.

Prints a table: duration, SIGSTOPs, impairment phases, the forwarder's
delayed and dropped packets, the RTT it added, probes sent and cleared
(server log), evictions and restarts (the server's /metrics and job views),
worker starts (3: none restarted), the simulated nodes' evictions, restarts
and dropped connections, and the agents' log lines about eviction. The
target: 0 evictions, 0 restarts.

Needs root, iproute2 and /dev/net/tun; prints why not otherwise. The
10-minute run (the defaults; a busy process per core): ``python -m bench.host_soak``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from . import _common as C
from . import compare, simagents
from .host_death import NsCluster

NETEM_NODE = 0
STOP_S = 1.0
RTT_EVERY_S = 2.0  # one echo through the forwarder this often
_MORE = re.compile(r"\((\d+) more like it not logged\)")


class HubClients(simagents.Clients):
    """bench.simagents client processes in the lab's hub namespace."""

    def __init__(self, n: int, url: str, hub: str) -> None:
        self.procs = C.start_clients(n, ["ip", "netns", "exec", hub, sys.executable, "-m", "bench.simagents", url])


def _count(log: str, needle: str) -> int:
    """Lines with ``needle`` in a server log, and those its rate limiter left out."""
    n = 0
    for line in log.splitlines():
        if needle in line:
            m = _MORE.search(line)
            n += 1 + (int(m.group(1)) if m else 0)
    return n


def _metric(text: str, name: str) -> float:
    """The sum of a Prometheus series over its labels."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


class Echo:
    """A UDP echo in the hub and a client in node ``i``'s namespace: round
    trips through the forwarder, one every RTT_EVERY_S (every 0.5 s while
    impaired), each filed under the forwarder's state when it was sent. Both
    ends run in threads reniced as the forwarder is, so that the numbers are
    the path's, not this process's wait for a core."""

    def __init__(self, lab, i: int, fwd) -> None:
        from tests.helpers.netem import socket_in

        self.fwd = fwd
        self.server = lab.in_hub(socket.socket, socket.AF_INET, socket.SOCK_DGRAM)
        self.server.bind((lab.hub_addr, 0))
        self.client = socket_in(lab.node_ns(i))
        self.client.bind((lab.node_addr(i), 0))
        self.rtts: dict[str, list[float]] = {"off": [], "on": []}
        self.lost = {"off": 0, "on": 0}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=f, daemon=True) for f in (self._serve, self._measure)]
        for t in self._threads:
            t.start()

    def _serve(self) -> None:
        _renice()
        while True:
            try:
                data, src = self.server.recvfrom(64)
                self.server.sendto(data, src)
            except OSError:
                return

    def _measure(self) -> None:
        _renice()
        seq = 0
        while not self._stop.is_set():
            phase = "on" if self.fwd.out.delay_s > 0 else "off"
            seq += 1
            r = self._one(b"echo%d" % seq, 2.0)
            if r is None:
                self.lost[phase] += 1
            else:
                self.rtts[phase].append(r)
            self._stop.wait(0.5 if phase == "on" else RTT_EVERY_S)

    def _one(self, tag: bytes, timeout: float) -> float | None:
        t0 = time.monotonic()
        self.client.settimeout(timeout)
        try:
            self.client.sendto(tag, self.server.getsockname())
            while True:
                data, _ = self.client.recvfrom(64)
                if data == tag:
                    return time.monotonic() - t0
                self.client.settimeout(max(0.001, timeout - (time.monotonic() - t0)))
        except (TimeoutError, OSError):
            return None

    def close(self) -> None:
        self._stop.set()
        self._threads[1].join(5)
        self.server.close()
        self.client.close()


def _renice() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), -10)
    except OSError:
        pass


def soak(tmp: Path, a: argparse.Namespace) -> dict:
    from tests.helpers.netem import tun_link
    from tests.helpers.netlab import NetLab

    rng = random.Random(a.seed)
    lab = NetLab(3)
    lab.setup()
    fwd = cl = sims = echo = None
    busy: list[subprocess.Popen] = []
    out: dict = {"seconds": a.seconds, "hogs": a.hogs, "sims": a.sims, "load_start": C.loadavg()}
    try:
        fwd = tun_link(lab, NETEM_NODE, seed=a.seed)
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.hogs)]
        cl = NsCluster("rdzv", tmp, "soak", lab)
        for i in range(3):
            cl.launch_ns(i, cl.stamp_cmd("--loop"))
        t, why = compare._wait_started(cl, 3, 120, what="step1")
        if t is None:
            return {**out, "failure": f"setup: {why or 'no world 3'}"}
        sim_job = f"sims-{cl.job}"
        if a.sims:
            sims = HubClients(max(1, a.sims // 128), f"http://{cl.endpoint}/v1/agent", lab.hub)
            sims.split("connect", simagents.node_specs(sim_job, a.sims))
            joined = sims.same({"cmd": "join"})
            if sum(1 for r in joined for x in r["recv"] if x is not None) < a.sims:
                return {**out, "failure": f"setup: not all {a.sims} simulated nodes were assigned"}
        echo = Echo(lab, NETEM_NODE, fwd)
        out.update(_run(a, rng, cl, fwd))
        out["rtt_off_ms"], out["rtt_on_ms"] = _ms(echo.rtts["off"]), _ms(echo.rtts["on"])
        out["echo_lost"] = dict(echo.lost)
        out["load_end"] = C.loadavg()
        metrics = (lab.in_hub(C.http_get, f"http://{cl.endpoint}/metrics", 5.0) or b"").decode()
        log = cl.server.text() if cl.server else ""
        views = {"real": cl.job_view()}
        if a.sims:
            body = lab.in_hub(C.http_get, f"http://{cl.endpoint}/v1/jobs/{sim_job}", 5.0)
            views["sims"] = json.loads(body) if body else {}
        agent_logs = "".join(p.text() for p in cl.agents)
        out.update(
            {
                "probes": _count(log, "suspected by a peer; probing"),
                "cleared": _count(log, "suspicion cleared"),
                "evicted_by_probe": _count(log, "no answer to probe"),
                "evictions_metric": _metric(metrics, "rdzv_evictions_total"),
                "restarts_metric": _metric(metrics, "rdzv_restarts_total"),
                "rounds": {k: v.get("round") for k, v in views.items()},
                "restarts_view": {k: v.get("restarts") for k, v in views.items()},
                "history": {k: [h.get("reason") for h in v.get("history", [])[1:]] for k, v in views.items()},
                "worker_starts": sum(1 for line in cl.lines() if line.what == "start"),
                "agent_evicted_lines": sum(1 for line in agent_logs.splitlines() if "evicted" in line.lower()),
                "server_cpu_s": _cpu_s(cl.server),
            }
        )
        if sims is not None:
            st = sims.same({"cmd": "stats"})
            out["sim_nodes"] = {k: sum(s[k] for s in st) for k in ("nodes", "evicted", "restart", "dropped", "hb_sent")}
        return out
    finally:
        if sims is not None:
            sims.stop()
        if cl is not None:
            cl.close()
        if echo is not None:
            echo.close()
        if fwd is not None:
            fwd.close()
        for b in busy:
            b.kill()
            b.wait()
        lab.cleanup()


def _cpu_s(proc: C.Proc | None) -> float | None:
    ticks = C.cpu_ticks(proc.popen.pid) if proc is not None else None
    return None if ticks is None else ticks / 100.0


def _run(a: argparse.Namespace, rng: random.Random, cl: NsCluster, fwd) -> dict:
    """The soak's schedule: SIGSTOPs and impairment phases; what was done."""
    t0 = time.monotonic()
    end = t0 + a.seconds
    next_stop = t0 + a.stop_every
    next_impair = t0 + a.impair_every / 2
    impaired_until = None
    stopped: tuple[C.Proc, float] | None = None
    stops = stops_impaired = phases = 0
    while True:
        now = time.monotonic()
        if stopped is not None and now >= stopped[1]:
            stopped[0].popen.send_signal(signal.SIGCONT)
            stopped = None
        if impaired_until is not None and now >= impaired_until:
            fwd.clear()
            impaired_until = None
        if now >= end and stopped is None and impaired_until is None:
            break
        if now < end and stopped is None and now >= next_stop:
            victim = rng.randrange(3)
            cl.agents[victim].popen.send_signal(signal.SIGSTOP)
            stopped = (cl.agents[victim], now + STOP_S)
            stops += 1
            stops_impaired += victim == NETEM_NODE and impaired_until is not None
            next_stop = now + a.stop_every
        if now < end and impaired_until is None and now >= next_impair:
            fwd.impair(a.delay, a.loss)
            impaired_until = now + a.impair_for
            next_impair += a.impair_every
            phases += 1
            print(f"[soak] {now - t0:.0f} s: impairment phase {phases} on node {NETEM_NODE}", file=sys.stderr)
        time.sleep(0.02)
    return {
        "duration_s": time.monotonic() - t0,
        "sigstops": stops,
        "sigstops_of_impaired_node_while_impaired": stops_impaired,
        "impairment_phases": phases,
        "forwarder": fwd.counters(),
    }


def _ms(vals: list[float]) -> dict:
    if not vals:
        return {}
    return {"n": len(vals), "median": round(C.median(vals) * 1000, 1), "p95": round(C.percentile(vals, 95) * 1000, 1)}


def table(r: dict) -> str:
    fw = r.get("forwarder", {}).get("out", {})
    sims = r.get("sim_nodes", {})
    lost = r.get("echo_lost", {})

    def rtt(key: str, phase: str) -> str:
        v = r.get(key, {})
        return f"median {v.get('median')} ms, p95 {v.get('p95')} ms (n={v.get('n')}, lost {lost.get(phase)})"

    stops = f"{r.get('sigstops')} ({r.get('sigstops_of_impaired_node_while_impaired')} of node 0 while impaired)"
    phases = f"{r.get('impairment_phases')} x {r.get('impair_for'):g} s"
    phases += f" ({r.get('delay_ms')} ms, {r.get('loss_pct')}% loss)"
    packets = f"{fw.get('delayed')} / {fw.get('lost')} of {fw.get('packets')} (queue full: {fw.get('overflow')})"
    sim = f"{sims.get('evicted')} / {sims.get('restart')} / {sims.get('dropped')}"
    sim += f" ({sims.get('hb_sent')} heartbeats sent)"
    rows = [
        ["duration", f"{r.get('duration_s', 0):.0f} s (load {r.get('load_start')} -> {r.get('load_end')})"],
        ["busy processes", str(r["hogs"])],
        ["simulated nodes (second job)", str(r["sims"])],
        ["SIGSTOPs of 1 s", stops],
        ["impairment phases on node 0", phases],
        ["node 0's outgoing packets: delayed / dropped", packets],
        ["echo RTT through the forwarder, not impaired", rtt("rtt_off_ms", "off")],
        ["echo RTT through the forwarder, impaired", rtt("rtt_on_ms", "on")],
        ["probes sent / cleared (server log)", f"{r.get('probes')} / {r.get('cleared')}"],
        ["evictions (metric; by probe, log)", f"{r.get('evictions_metric'):.0f} ({r.get('evicted_by_probe')})"],
        ["restarts (metric; job views)", f"{r.get('restarts_metric'):.0f} ({r.get('restarts_view')})"],
        ["rounds (job views)", str(r.get("rounds"))],
        ["worker starts (3: none restarted)", str(r.get("worker_starts"))],
        ["simulated nodes: evicted / restart / dropped", sim],
        ["agents' log lines about eviction", str(r.get("agent_evicted_lines"))],
        ["server CPU", f"{r.get('server_cpu_s')} s"],
    ]
    return C.md_table(["soak", "value"], rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.host_soak", description=__doc__.split("\n\n")[1])
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--hogs", type=int, default=os.cpu_count() or 1, help="busy processes (default: one per core)")
    p.add_argument("--sims", type=int, default=256, help="simulated nodes in a second job (0: none)")
    p.add_argument("--stop-every", type=float, default=3.0, help="a random agent SIGSTOPped for 1 s this often")
    p.add_argument("--impair-every", type=float, default=60.0)
    p.add_argument("--impair-for", type=float, default=10.0)
    p.add_argument("--delay", type=float, default=0.3, help="seconds added to node 0's outgoing packets")
    p.add_argument("--loss", type=float, default=0.05, help="fraction of them dropped")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path)
    p.add_argument("--keep", type=Path, help="keep the logs (server, agents, stamps) under this directory")
    a = p.parse_args(argv)
    if a.stop_every <= STOP_S or a.seconds <= 0 or a.impair_for >= a.impair_every or a.sims < 0:
        p.error(f"--stop-every must exceed {STOP_S:g} s, --impair-for be under --impair-every, --seconds > 0")
    from tests.helpers.netem import tun_unavailable
    from tests.helpers.netlab import netns_unavailable

    why = netns_unavailable() or tun_unavailable()
    if why:
        print(f"[bench] host_soak needs network namespaces and TUN: {why}", file=sys.stderr)
        sys.exit(2)
    if a.keep:
        a.keep.mkdir(parents=True, exist_ok=True)
        r = soak(a.keep, a)
    else:
        with tempfile.TemporaryDirectory(prefix="rdzv-soak-") as d:
            r = soak(Path(d), a)
    r.update(delay_ms=round(a.delay * 1000), loss_pct=round(a.loss * 100, 1), impair_for=a.impair_for)
    if "failure" in r:
        print(f"[bench] soak failed: {r['failure']}", file=sys.stderr)
        print(json.dumps(r))
        sys.exit(1)
    print(f"host soak: 3 agents in network namespaces + {a.sims} simulated nodes, load {C.loadavg()}")
    print(table(r))
    for job, reasons in r.get("history", {}).items():
        for why in reasons:
            print(f"- {job} job re-formed: {why}")
    if a.out:
        a.out.write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
