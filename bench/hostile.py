"""Hostile clients (issue 19): the issue's attacks, re-run against a real rdzv-server.

    python -m bench.hostile [--quick] [--seconds S] [--only 1,5] [--out FILE.json]

Each probe starts its own ``rdzv-server`` on 127.0.0.1 (``bench/_common.py``'s
BenchServer, a data dir in a temporary directory, extra flags where the probe
needs them), attacks it as a script would (aiohttp or raw sockets speaking the
wire protocol: rdzv_common/wire.py, rdzv_common/protocol.py), measures, and
stops it by pid. Every attack is bounded in count and in time and stops by
itself; an attack the server refuses is a result ("refused: <code>"), never a
crash of the bench. While an attack runs, a separate process polls
``/healthz`` (one request at a time, each on a new connection, 20 ms apart) and
a thread samples the server's VmRSS (/proc/PID/status) every 20 ms.

The probes (1-3, 10: bench/hostile_probes.py; 4-8: bench/hostile_access.py; 9 and its
fake servers: bench/hostile_fakes.py):

1. failure loop: one joined client loops ``failed`` reports (8 exit records
   of 4-byte characters, as big as a frame allows) for S seconds;
2. replays: the same loop fills the event ring, then ``GET /v1/events?since=0``
   and K event streams replaying from id 0 whose sockets are never read;
3. waiting-jobs lever: one client makes waiting jobs (join 1:1 with a 7-day
   join timeout, then leave) as fast as it can, then a new job from another
   address (127.0.0.2) joins;
4. reused job id: run 1 of "nightly" ends; a stranger's fresh join (no job
   secret, its own settings) with and without a job secret on run 1;
5. cross-origin: the agent WebSocket upgrade with ``Origin: http://evil.example``,
   ``POST close`` with ``Host: evil.example`` (no token), and with a token, the
   /ui cookie on the agent channel from another port's page;
6. host records: health reports for made-up hosts, made-up cordons until the
   table is full, then an operator's cordon of a real host;
7. slots: ``--max-connections 300`` held by 300 joined WebSockets of one
   address, then a real join from another; 1,000 event streams that never
   read, then a dashboard's stream;
8. throttle: job-secret guesses a token holder makes in a few seconds
   (reconnecting when closed for errors); 20 wrong tokens from 127.0.0.1,
   then the right one; whether a 1-character ``--token`` is taken;
9. broken servers: a real ``rdzv-agent --server-timeout 5`` against fake
   servers that close after the upgrade, never answer the join, or answer
   ``unavailable``: does it exit within 10 s (and, not judged: how often it
   rejoins a server that answers every join with ``evicted``);
10. heartbeat flood: one joined client sends heartbeat frames as fast as it
    can for S seconds: server CPU and ``/healthz``.

Targets are the issue's: server RSS < 300 MB whatever one client does,
``/healthz`` p99 < 100 ms throughout, a single client cannot make a legitimate
new job wait, a reused job id cannot be taken without the previous run's
credential, no cross-origin page can join or change anything, every agent
exits within ``--server-timeout`` + 5 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import _common as C

TARGET_RSS_MB = 300.0
TARGET_HEALTHZ_P99_S = 0.100
OTHER_ADDR = "127.0.0.2"  # "another client": loopback, but not the attacker's address
MAX_TIMEOUT_S = 7 * 24 * 3600.0
ANSWER_S = 10.0  # how long the bench waits for any one answer


@dataclass
class Result:
    """One row: what the probe did, what it measured, the target, met (None: not judged)."""

    key: str
    did: str
    measured: str
    target: str
    met: bool | None
    info: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass
class Ctx:
    tmp: Path
    seconds: float  # how long a timed attack runs
    quick: bool
    log: Callable[[str], None]

    def server(self, name: str, *extra: str) -> C.BenchServer:
        d = self.tmp / name
        d.mkdir(parents=True, exist_ok=True)
        return C.BenchServer(d, extra=list(extra), quotas=True)  # the per-address limits are under test


# ------------------------------------------------------------------ watching


_POLLER = r"""
import json, sys, threading, time, urllib.request
url, bound = sys.argv[1], float(sys.argv[2])
lat, errors, stop = [], 0, threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
print("ready", flush=True)
end = time.monotonic() + bound
while not stop.is_set() and time.monotonic() < end:
    t = time.perf_counter()
    try:
        urllib.request.urlopen(url, timeout=30).read()
    except Exception:
        errors += 1
    lat.append(time.perf_counter() - t)
    stop.wait(0.02)
print(json.dumps({"lat": lat, "errors": errors}), flush=True)
"""


class Watch:
    """While an attack runs: /healthz latency from another process, the
    server's VmRSS sampled from a thread, its CPU ticks. ``stop()`` -> numbers."""

    def __init__(self, server: C.BenchServer, bound_s: float = 600.0) -> None:
        self.pid = server.proc.pid
        self.poller = subprocess.Popen(
            [sys.executable, "-c", _POLLER, server.url + "/healthz", str(bound_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert self.poller.stdout is not None
        self.poller.stdout.readline()
        self.rss_start = C.status_kb(self.pid, "VmRSS") or 0
        self.rss_peak = self.rss_start
        self.done = threading.Event()
        self.sampler = threading.Thread(target=self._sample, daemon=True)
        self.t0, self.cpu0 = time.monotonic(), C.cpu_ticks(self.pid) or 0
        self.sampler.start()

    def _sample(self) -> None:
        while not self.done.wait(0.02):
            kb = C.status_kb(self.pid, "VmRSS")
            if kb is not None:
                self.rss_peak = max(self.rss_peak, kb)

    def rss_mb(self) -> float:
        return (C.status_kb(self.pid, "VmRSS") or 0) / 1024

    def stop(self) -> dict[str, Any]:
        wall = time.monotonic() - self.t0
        cpu = ((C.cpu_ticks(self.pid) or 0) - self.cpu0) / C.CLK_TCK
        self.done.set()
        self.sampler.join(2)
        out: dict[str, Any] = {"lat": [], "errors": 0}
        try:
            out = json.loads(self.poller.communicate("stop\n", timeout=40)[0].splitlines()[-1])
        except (subprocess.TimeoutExpired, IndexError, ValueError):
            C.kill_tree(self.poller.pid)
            self.poller.wait(2)
        lat = out["lat"]
        return {
            "rss_start_mb": self.rss_start / 1024,
            "rss_peak_mb": self.rss_peak / 1024,
            "healthz_n": len(lat),
            "healthz_errors": out["errors"],
            "healthz_p50_s": C.percentile(lat, 50) if lat else None,
            "healthz_p99_s": C.percentile(lat, 99) if lat else None,
            "healthz_max_s": max(lat) if lat else None,
            "cpu_share": cpu / wall if wall > 0 else None,
            "wall_s": wall,
        }


def hz(w: dict[str, Any]) -> str:
    """The /healthz part of a measured cell."""
    if not w.get("healthz_n"):
        return "/healthz: no answer"
    err = f", {w['healthz_errors']} errors" if w["healthz_errors"] else ""
    return (
        f"/healthz p50 {C.fmt_s(w['healthz_p50_s'])} p99 {C.fmt_s(w['healthz_p99_s'])} "
        f"max {C.fmt_s(w['healthz_max_s'])} ({w['healthz_n']} polls{err})"
    )


def hz_ok(w: dict[str, Any]) -> bool:
    p99 = w.get("healthz_p99_s")
    return p99 is not None and p99 < TARGET_HEALTHZ_P99_S and not w.get("healthz_errors")


# ------------------------------------------------------------------ wire


def join_text(
    job: str,
    node: str,
    *,
    nnodes: tuple[int, int] = (1, 1),
    host: str = "h1",
    job_secret: str | None = None,
    node_secret: str | None = None,
    run: int | None = None,
    **spec: Any,
) -> str:
    """A join frame as an agent sends it (rdzv_common.wire, no pydantic)."""
    from rdzv_common.wire import check_spec, join_fields

    fields = join_fields(
        job_id=job,
        node_id=node,
        host=host,
        addr="127.0.0.1",
        local_world_size=1,
        master_port=29500,
        spec=check_spec(min_nodes=nnodes[0], max_nodes=nnodes[1], **spec),
        job_secret=job_secret,
        node_secret=node_secret,
        run=run,
    )
    return json.dumps(fields)


async def until(ws: Any, ops: set[str], timeout: float) -> dict[str, Any] | None:
    """The next frame whose op is in ``ops`` or is an ``error`` (None: closed or timed out)."""
    import aiohttp

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        left = deadline - loop.time()
        if left <= 0:
            return None
        try:
            frame = await ws.receive(timeout=left)
        except (asyncio.TimeoutError, aiohttp.ClientError, ConnectionError):
            return None
        if frame.type != aiohttp.WSMsgType.TEXT:
            if frame.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                return None
            continue
        msg: dict[str, Any] = json.loads(frame.data)
        if msg.get("op") in ops or msg.get("op") == "error":
            return msg


def refused(msg: dict[str, Any] | None, ws: Any = None) -> str:
    """How a refusal reads in the table: ``refused: <code>``."""
    if msg is None:
        code = getattr(ws, "close_code", None)
        return f"refused: connection closed (code {code})" if code is not None else "refused: no answer"
    return f"refused: {msg.get('code')}"


def session(local_addr: str | None = None, **kw: Any) -> Any:
    """An aiohttp client session (from ``local_addr`` when given: another client)."""
    import aiohttp

    conn = aiohttp.TCPConnector(limit=0, force_close=True, local_addr=(local_addr, 0) if local_addr else None)
    return aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=30), **kw)


def never_reading(port: int, request: bytes) -> socket.socket | None:
    """A connected socket that sent ``request`` and will never read (a tiny receive buffer)."""
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(5)
        s.connect(("127.0.0.1", port))
        s.sendall(request)
        return s
    except OSError:
        s.close()
        return None


# ------------------------------------------------------------------ table


def md_cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def table(results: list[Result]) -> str:
    rows = [
        [
            md_cell(r.key + ". " + r.did),
            md_cell(r.measured),
            md_cell(r.target),
            "n/a" if r.met is None else ("met" if r.met else "NOT met"),
        ]
        for r in results
    ]
    return C.md_table(["probe", "measured", "target", "met"], rows)


Probe = Callable[[Ctx], Awaitable[Result]]


def plan() -> dict[str, tuple[str, Probe]]:
    from . import hostile_access, hostile_fakes, hostile_probes

    probes = {**hostile_probes.PROBES, **hostile_access.PROBES, **hostile_fakes.PROBES}
    return {k: probes[k] for k in sorted(probes, key=int)}


def run(keys: list[str], seconds: float, quick: bool, log: Callable[[str], None] = print) -> list[Result]:
    C.raise_nofile()
    probes = plan()
    tmp = Path(tempfile.mkdtemp(prefix="rdzv-bench-hostile-"))
    out = []
    try:
        for key in keys:
            title, probe = probes[key]
            ctx = Ctx(tmp / f"p{key}", seconds, quick, log)
            ctx.tmp.mkdir()
            log(f"[hostile] {key}. {title} (load {C.loadavg()})")
            t0 = time.monotonic()
            try:
                res = asyncio.run(probe(ctx))
            except Exception as e:  # a probe that broke is a row that says so, not a crashed bench
                log(traceback.format_exc())
                res = Result(key, title, f"probe error: {type(e).__name__}: {str(e)[:200]}", "", None)
            res.seconds = time.monotonic() - t0
            log(f"[hostile] {key}: {res.measured} ({res.seconds:.1f} s)")
            out.append(res)
    finally:
        if os.environ.get("BENCH_KEEP_TMP"):
            log(f"[hostile] kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.hostile", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 s per timed attack, smaller counts (a smoke test)")
    p.add_argument("--seconds", type=float, default=None, help="seconds per timed attack (default 10; --quick 2)")
    p.add_argument("--only", default=None, help="comma-separated probe numbers (1-10)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args(argv)
    keys = list(plan())
    if a.only:
        want = [k.strip() for k in a.only.split(",") if k.strip()]
        bad = [k for k in want if k not in keys]
        if bad:
            p.error(f"--only: no probe {', '.join(bad)} (there are {', '.join(keys)})")
        keys = [k for k in keys if k in want]
    seconds = a.seconds if a.seconds is not None else (2.0 if a.quick else 10.0)
    if not 0 < seconds <= 600:
        p.error("--seconds must be in (0, 600]")
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    started, load0 = time.time(), C.loadavg()
    results = run(keys, seconds, a.quick, log)
    text = table(results)
    print(text)
    print()
    print(
        f"- {seconds:g} s per timed attack{' (--quick)' if a.quick else ''}; {os.cpu_count()} CPU(s); "
        f"load average {load0} at start, {C.loadavg()} at end; {time.time() - started:.0f} s in all"
    )
    if a.out:
        Path(a.out).write_text(
            json.dumps(
                {
                    "results": [r.__dict__ for r in results],
                    "seconds": seconds,
                    "quick": a.quick,
                    "load_start": load0,
                    "load_end": C.loadavg(),
                    "table": text,
                },
                indent=1,
                default=str,
            )
        )


if __name__ == "__main__":
    main()
