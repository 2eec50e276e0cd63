"""python -m bench.host_death [--runs K] [--victim plain|rank0] [--no-torchrun] [--bound S] [--out FILE.json]
python -m bench.host_death --soak S [--hogs N]
python -m bench.host_death --lone [--runs K]

A node's host vanishes (issue 23): three agents, each in a network namespace
of its own (tests/helpers/netlab.NetLab: a hub namespace with a bridge, one
veth per node), one worker each; one node's cable is pulled (its hub-side
veth set down: no FIN, no RST, no ICMP). Measured from the cut:

* rdzv, process mode (default flags; the server in the hub namespace):
  both survivors' workers started with world 2 (``start`` line of
  bench/scripts/stamp.py, the same worker compare.py runs), and their first
  all_reduce in world 2 (``step1``);
* rdzv, ``--restart-mode in-place`` (examples/train_inplace.py, whose lines
  carry no time: polled every 10 ms): both survivors' kept workers printed a
  step in world 2;
* torchrun (c10d, ``--rdzv-conf is_host=1`` on node 0, which then must not be
  the victim: its store dies with it), the same worker: both survivors'
  workers started with world 2, if that happens within ``--bound``.

``--lone``: one node alone (no peer can suspect it; the same holds for a
node whose peers are not probing): cut -> the server's round 1 (the node
lost), polled every 10 ms, and the reason. Only the server's own signals can
find it: the silence of its heartbeats (a probe, rdzv_server.pacing) or, 4.6 s
after the cut, its socket's keep-alive.

``--soak S [--hogs N]``: no false eviction, bench/host_soak.py for S seconds
(SIGSTOPs, 300 ms / 5 % loss phases, 256 simulated nodes; its docstring).

Needs root and iproute2 (network namespaces); prints why not otherwise.
Victim ``plain``: a node that is neither group rank 0 nor torchrun's store
host; ``rank0``: rdzv's group rank 0 (it hosts the workers' store; torchrun is
skipped for it).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

from . import _common as C
from . import compare

STEP_RE = re.compile(r"^\[\d+\]: step (\d+) rank (\d+) world (\d+) round (\d+) pid (\d+) ", re.M)
INPLACE_EXAMPLE = C.ROOT / "examples" / "train_inplace.py"


class NsCluster(compare.Cluster):
    """compare.Cluster with the server in the lab's hub namespace and agent i
    in node i's namespace at its address."""

    def __init__(self, launcher: str, tmp: Path, name: str, lab, rdzv_flags: tuple[str, ...] = ()):
        self.lab = lab
        self.rdzv_flags = rdzv_flags
        super().__init__(launcher, tmp, name, server=False)
        self.env["GLOO_SOCKET_IFNAME"] = "rzeth"
        if launcher == "rdzv":
            self.endpoint = f"{lab.hub_addr}:{self.port}"
            self.server = C.Proc(
                "server",
                ["ip", "netns", "exec", lab.hub, *self._server_argv()],
                self.dir / "server.log",
                env=self.env,
                cwd=C.ROOT,
            )
            url = f"http://{self.endpoint}/healthz"
            up = C.wait_until(lambda: lab.in_hub(C.http_get, url, 1.0) or self.server.poll() is not None, 20)
            if not up or self.server.poll() is not None:
                raise RuntimeError("rdzv-server did not start:\n" + self.server.text()[-2000:])
        else:
            self.endpoint = f"{lab.node_addr(0)}:{self.port}"  # agent 0 hosts the c10d store

    def _server_argv(self) -> list[str]:
        # on the hub's address (it exists only in the lab's namespaces): no token needed there
        argv = C.server_argv(self.port, self.dir / "data")
        argv[argv.index("127.0.0.1")] = self.lab.hub_addr
        return [*argv, "--insecure"]

    def launch_ns(self, i: int, cmd: list[str]) -> C.Proc:
        addr = self.lab.node_addr(i)
        if self.launcher == "rdzv":
            argv = [sys.executable, "-m", "rdzv_client.agent", "--endpoint", self.endpoint, "--job-id", self.job]
            argv += ["--line-prefix", *self.rdzv_flags]
        else:
            argv = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend=c10d"]
            argv += [f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.job}", f"--rdzv-conf=is_host={int(i == 0)}"]
        argv += ["--local-addr", addr, "--nnodes", "2:3", "--nproc-per-node", "1", "--max-restarts", "3", *cmd]
        argv = ["ip", "netns", "exec", self.lab.node_ns(i), *argv]
        p = C.Proc(f"agent{i}", argv, self.dir / f"agent{i}.log", env=self.env, cwd=self.dir)
        self.agents.append(p)
        return p

    def job_view(self) -> dict:
        body = self.lab.in_hub(C.http_get, f"http://{self.endpoint}/v1/jobs/{self.job}", 5.0)
        return json.loads(body) if body else {}


def _victim_index(cl: NsCluster, kind: str) -> int:
    if cl.launcher == "torchrun":
        return 2 if kind == "plain" else 0
    view = cl.job_view()
    addr_of = {n["group_rank"]: n["addr"] for n in view.get("nodes", [])}
    want = addr_of.get(0) if kind == "rank0" else addr_of.get(2)
    return next(i for i in range(cl.lab.n) if cl.lab.node_addr(i) == want)


def measure_process(launcher: str, tmp: Path, kind: str, bound: float) -> dict:
    from tests.helpers.netlab import NetLab

    lab = NetLab(3)
    lab.setup()
    cl = None
    try:
        cl = NsCluster(launcher, tmp, f"hd-{kind}", lab)
        for i in range(3):
            cl.launch_ns(i, cl.stamp_cmd("--loop"))
        t, why = compare._wait_started(cl, 3, 120, what="step1")
        if t is None:
            return {"failure": f"setup: {why or 'no world 3'}"}
        time.sleep(0.5)
        victim = _victim_index(cl, kind)
        survivors = [a for i, a in enumerate(cl.agents) if i != victim]
        t_cut = time.time()
        lab.cut(victim)
        t, why = compare._wait_started(cl, 2, bound, after=t_cut, agents=survivors)
        if t is None:
            return {"failure": why or f"no recovery in {bound:g} s"}
        t_step, _ = compare._wait_started(cl, 2, 30, after=t_cut, what="step1", agents=survivors)
        out = {"cut_to_started_s": t - t_cut, "cut_to_first_step_s": (t_step - t_cut) if t_step else None}
        if launcher == "rdzv":
            hist = cl.job_view().get("history", [])
            out["reason"] = hist[1]["reason"] if len(hist) > 1 else None
        return out
    finally:
        if cl is not None:
            cl.close()
        lab.cleanup()


def measure_inplace(tmp: Path, kind: str, bound: float) -> dict:
    from tests.helpers.netlab import NetLab

    lab = NetLab(3)
    lab.setup()
    flags = ("--restart-mode", "in-place", "--in-place-timeout", "5")
    cl = None
    try:
        cl = NsCluster("rdzv", tmp, f"hd-ip-{kind}", lab, rdzv_flags=flags)
        cmd = [str(INPLACE_EXAMPLE), "--steps", "100000", "--step-sleep", "0.05"]
        for i in range(3):
            cl.launch_ns(i, cmd)

        def worlds(a: C.Proc) -> set[tuple[int, int]]:
            return {(int(r), int(w)) for _, _, w, r, _ in STEP_RE.findall(a.text())}

        if not C.wait_until(lambda: all((0, 3) in worlds(a) for a in cl.agents), 120):
            return {"failure": "setup: no world 3"}
        time.sleep(0.5)
        victim = _victim_index(cl, kind)
        survivors = [a for i, a in enumerate(cl.agents) if i != victim]
        t_cut = time.time()
        lab.cut(victim)
        ok = C.wait_until(lambda: all(any(w == 2 for _, w in worlds(a)) for a in survivors), bound, 0.01)
        if not ok:
            return {"failure": f"no world 2 step in {bound:g} s"}
        out = {"cut_to_first_step_s": time.time() - t_cut}
        hist = cl.job_view().get("history", [])
        out["reason"] = hist[1]["reason"] if len(hist) > 1 else None
        return out
    finally:
        if cl is not None:
            cl.close()
        lab.cleanup()


def measure_lone(tmp: Path, bound: float) -> dict:
    from tests.helpers.netlab import NetLab

    lab = NetLab(1)
    lab.setup()
    cl = None
    try:
        cl = NsCluster("rdzv", tmp, "hd-lone", lab)
        argv = [sys.executable, "-m", "rdzv_client.agent", "--endpoint", cl.endpoint, "--job-id", cl.job]
        argv += ["--local-addr", lab.node_addr(0), "--nnodes", "1", "--no-python", "sleep", "600"]
        p = C.Proc("agent0", ["ip", "netns", "exec", lab.node_ns(0), *argv], cl.dir / "agent0.log", env=cl.env)
        cl.agents.append(p)
        if not C.wait_until(lambda: cl.job_view().get("state") == "running", 60):
            return {"failure": "setup: not running"}
        time.sleep(3.0)  # heartbeats at the interval it was told
        t_cut = time.time()
        lab.cut(0)
        if not C.wait_until(lambda: cl.job_view().get("round", 0) >= 1, bound, 0.01):
            return {"failure": f"not lost in {bound:g} s"}
        out: dict = {"cut_to_lost_s": time.time() - t_cut}
        hist = cl.job_view().get("history", [])
        out["reason"] = hist[1]["reason"] if len(hist) > 1 else None
        return out
    finally:
        if cl is not None:
            cl.close()
        lab.cleanup()


def lone(args: argparse.Namespace) -> None:
    runs = []
    with tempfile.TemporaryDirectory(prefix="rdzv-hd-") as d:
        for run in range(args.runs):
            runs.append(measure_lone(Path(d), args.bound))
            print(f"[bench] run {run + 1}: {json.dumps(runs[-1])}", file=sys.stderr)
    vals = [r["cut_to_lost_s"] for r in runs if "cut_to_lost_s" in r]
    cell = f"median {C.fmt_s(C.median(vals))} ({', '.join(C.fmt_s(v) for v in vals)})" if vals else "-"
    fails = [r["failure"] for r in runs if "failure" in r]
    if fails:
        cell += f"; failed: {'; '.join(fails)}"
    print(f"host death of a lone node (no peer probes it), network namespaces, load {C.loadavg()}")
    print(C.md_table(["measure", "seconds", "runs"], [["cut -> node lost (round 1)", cell, str(len(runs))]]))
    for reason in sorted({r["reason"] for r in runs if r.get("reason")}):
        print(f"- round 1's reason: {reason}")
    if args.out:
        args.out.write_text(json.dumps(runs, indent=1))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.host_death", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--victim", choices=("plain", "rank0"), default="plain")
    p.add_argument("--no-torchrun", action="store_true")
    p.add_argument("--bound", type=float, default=30.0, help="seconds to wait for a recovery (torchrun: 5x)")
    p.add_argument("--out", type=Path)
    p.add_argument("--soak", type=float, metavar="S", help="instead: python -m bench.host_soak --seconds S")
    p.add_argument("--hogs", type=int, default=0, help="with --soak: busy processes beside it")
    p.add_argument("--lone", action="store_true", help="instead: a lone node's cable pulled, cut -> node lost")
    args = p.parse_args(argv)
    if args.soak:
        from . import host_soak

        extra = ["--out", str(args.out)] if args.out else []
        host_soak.main(["--seconds", f"{args.soak:g}", "--hogs", str(args.hogs), *extra])
        return
    from tests.helpers.netlab import netns_unavailable

    why = netns_unavailable()
    if why:
        print(f"[bench] host_death needs network namespaces: {why}", file=sys.stderr)
        sys.exit(2)
    if args.lone:
        lone(args)
        return
    res: dict[str, list[dict]] = {"rdzv": [], "rdzv_inplace": [], "torchrun": []}
    with tempfile.TemporaryDirectory(prefix="rdzv-hd-") as d:
        tmp = Path(d)
        for run in range(args.runs):
            res["rdzv"].append(measure_process("rdzv", tmp, args.victim, args.bound))
            res["rdzv_inplace"].append(measure_inplace(tmp, args.victim, args.bound))
            if not args.no_torchrun and args.victim == "plain" and run == 0:  # one run: it is slow
                res["torchrun"].append(measure_process("torchrun", tmp, args.victim, 5 * args.bound))
            print(f"[bench] run {run + 1}: " + json.dumps({k: v[-1] for k, v in res.items() if v}), file=sys.stderr)
    rows = []
    for key, label, field in (
        ("rdzv", "rdzv: cut -> survivors' workers started, world 2", "cut_to_started_s"),
        ("rdzv", "rdzv: cut -> first all_reduce of world 2", "cut_to_first_step_s"),
        ("rdzv_inplace", "rdzv in-place: cut -> kept workers' first step of world 2", "cut_to_first_step_s"),
        ("torchrun", "torchrun c10d: cut -> survivors' workers started, world 2", "cut_to_started_s"),
        ("torchrun", "torchrun c10d: cut -> first all_reduce of world 2", "cut_to_first_step_s"),
    ):
        vals = [r[field] for r in res[key] if r.get(field) is not None]
        fails = [r["failure"] for r in res[key] if "failure" in r]
        cell = f"median {C.fmt_s(C.median(vals))} ({', '.join(C.fmt_s(v) for v in vals)})" if vals else "-"
        if fails:
            cell += f"; failed: {'; '.join(fails)}"
        rows.append([label, cell, str(len(res[key]))])
    print(f"host death ({args.victim} victim), 3 nodes in network namespaces, load {C.loadavg()}")
    print(C.md_table(["measure", "seconds", "runs"], rows))
    reasons = {r.get("reason") for k in ("rdzv", "rdzv_inplace") for r in res[k] if r.get("reason")}
    for reason in sorted(reasons):
        print(f"- round 1's reason: {reason}")
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
