"""Helpers shared by the benchmarks: processes, /proc readings, tables.

Everything here is stdlib only (the benchmarks run with the repo's venv, but
the helpers must not import torch or rdzv so that they cost nothing).
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
CLK_TCK = os.sysconf("SC_CLK_TCK")
NETNS_VAR = "RDZV_BENCH_NETNS"


# ------------------------------------------------------------------ process


def raise_nofile() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_ticks(pid: int) -> int | None:
    """utime + stime of one process, in clock ticks (None: gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of stat(5)


def status_kb(pid: int, key: str) -> int | None:
    """A /proc/PID/status value in kB (VmRSS, VmHWM)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                text = f.read()
        except OSError:
            continue
        ppid = int(text[text.rindex(")") + 2 :].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def descendants(pid: int) -> list[int]:
    kids = children_map()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in kids.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> list[int]:
    """SIGKILL a process, every descendant and their process groups: a node
    dies (workers lead groups of their own, so a group kill alone misses them)."""
    pids = [pid, *descendants(pid)]
    groups = set()
    for p in pids:
        try:
            groups.add(os.getpgid(p))
        except OSError:
            pass
    for p in pids:
        try:
            os.kill(p, sig)
        except OSError:
            pass
    own = os.getpgrp()
    for g in groups:
        if g != own and g > 1:
            try:
                os.killpg(g, sig)
            except OSError:
                pass
    return pids


class Proc:
    """A subprocess in its own session, output to a log file."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict | None = None, cwd: Path | None = None):
        self.name, self.argv, self.log = name, argv, log
        self.log_f = open(log, "wb")  # noqa: SIM115
        self.launched_at = time.time()
        self.popen = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self.log_f,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
        self.pid = self.popen.pid
        self.exited_at: float | None = None

    def poll(self) -> int | None:
        rc = self.popen.poll()
        if rc is not None and self.exited_at is None:
            self.exited_at = time.time()
        return rc

    def text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, grace: float = 3.0) -> None:
        """SIGTERM the group, then SIGKILL everything left of the tree."""
        tree = [self.pid, *descendants(self.pid)] if self.popen.poll() is None else descendants(self.pid)
        if self.popen.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGTERM)
            except OSError:
                pass
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        for p in tree:
            if pid_alive(p):
                kill_tree(p)
        if self.popen.poll() is None:
            kill_tree(self.pid)
            try:
                self.popen.wait(2)
            except subprocess.TimeoutExpired:
                pass
        self.log_f.close()


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"
    except OSError:
        return False


def wait_until(fn: Callable[[], Any], timeout: float, interval: float = 0.02) -> Any:
    """fn's first truthy value, or None after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if v:
            return v
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval)


def http_get(url: str, timeout: float = 5.0) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read()
    except Exception:
        return None


def http_post(url: str, timeout: float = 5.0) -> bytes | None:
    try:
        req = urllib.request.Request(url, data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read()
    except Exception:
        return None


def venv_python() -> str:
    return sys.executable


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


# ---------------------------------------------------------------- netns


def in_private_netns() -> bool:
    return os.environ.get(NETNS_VAR) == "1"


def reexec_in_netns(module: str, argv: list[str], backlog: int | None = None) -> None:
    """Run ``python -m module argv`` again inside a private network namespace
    with only loopback (torch's TCPStore listens on every interface). Returns
    only when that is impossible (not root, no unshare): then we stay here.
    ``backlog``: the namespace's accept and SYN queues raised to it
    (``net.core.somaxconn``, ``net.ipv4.tcp_max_syn_backlog``, as deploy/README.md
    tells operators of big jobs to set them; the host's stay as they are)."""
    if in_private_netns() or os.environ.get("RDZV_BENCH_NO_NETNS"):
        return
    probe = subprocess.run(["unshare", "-n", "sh", "-c", "ip link set lo up"], capture_output=True)
    if probe.returncode != 0:
        print("[bench] no private network namespace (unshare -n failed); using plain loopback", file=sys.stderr)
        return
    env = dict(os.environ, **{NETNS_VAR: "1"})
    setup = "ip link set lo up"
    if backlog is not None:  # (a kernel that refuses says so on stderr; the run goes on)
        setup += "".join(
            f" && {{ echo {int(backlog)} > /proc/sys/net/{name} || true; }}"
            for name in ("core/somaxconn", "ipv4/tcp_max_syn_backlog")
        )
    cmd = ["unshare", "-n", "sh", "-c", f'{setup} && exec "$@"', "sh", sys.executable, "-m", module, *argv]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe("unshare", cmd, env)


# ---------------------------------------------------------------- numbers


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = max(0, min(len(s) - 1, round(q / 100.0 * len(s) + 0.5) - 1))
    return s[k]


def median(values: Iterable[float]) -> float:
    v = list(values)
    return statistics.median(v) if v else float("nan")


def fmt_s(v: float | None) -> str:
    if v is None:
        return "-"
    if v < 0.1:
        return f"{v * 1000:.1f} ms"
    return f"{v:.2f} s"


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def server_argv(port: int, data_dir: Path, python: str = sys.executable, quotas: bool = False) -> list[str]:
    """An rdzv-server on loopback with its state in ``data_dir``: how every bench starts one.
    Its simulated agents share one address (127.0.0.1): no per-address limits, unless ``quotas``
    (the server's defaults: bench.hostile measures them)."""
    lifted = ("--max-connections-per-address", "0", "--max-waiting-jobs-per-address", "0")
    return [
        *(python, "-m", "rdzv_server", "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data_dir)),
        *(() if quotas else lifted),
    ]


class BenchServer:
    """A real rdzv-server process, healthy once constructed; ``stop()`` ends it.
    ``extra``: more server flags (``--token T``, ``--max-connections N``); ``quotas``: see server_argv."""

    def __init__(
        self, tmp: Path, python: str = sys.executable, extra: list[str] | None = None, quotas: bool = False
    ) -> None:
        self.data = tmp / "data"
        self.log = tmp / "server.log"
        self.port = free_port()
        argv = server_argv(self.port, self.data, python, quotas) + list(extra or [])
        self.proc = Proc("server", argv, self.log, cwd=ROOT)
        self.url = f"http://127.0.0.1:{self.port}"
        if not wait_until(lambda: http_get(self.url + "/healthz", 1.0) or self.proc.poll() is not None, 20):
            raise RuntimeError("server did not start:\n" + self.proc.text()[-2000:])
        if self.proc.poll() is not None:
            raise RuntimeError("server exited:\n" + self.proc.text()[-2000:])

    def stop(self) -> None:
        self.proc.stop(5)


async def serve_commands(handle: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> None:
    """A simulated-client process's loop (bench/simagents.py, bench/bigagents.py): says
    ``{"ready": true}``, then answers each JSON command read from stdin with one JSON
    line on stdout until ``{"cmd": "exit"}`` or the end of stdin."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**26)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print(json.dumps({"ready": True}), flush=True)
    while line := await reader.readline():
        cmd = json.loads(line)
        if cmd["cmd"] == "exit":
            break
        print(json.dumps(await handle(cmd)), flush=True)


def start_clients(n: int, argv: list[str]) -> list[subprocess.Popen]:
    """``n`` client processes of ``argv`` (a serve_commands loop each), once every one said ready."""
    procs = [
        subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True
        )
        for _ in range(n)
    ]
    for p in procs:
        assert p.stdout is not None and json.loads(p.stdout.readline()).get("ready")
    return procs
