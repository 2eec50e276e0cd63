"""What the server's CPU pays per node for a re-formation of one big job, in process.

    python -m bench.join_cost [--nodes 16384] [--reps 5] [--backend sqlite|memory] [--profile FILE] [--direct]

One job of N nodes is formed through the real Store (its Metrics and EventLog
as the app makes them, SQLite in a temporary data dir by default, as
deployed), each node with the server's own channel
(rdzv_server.ws_channel.WsChannel) over a stand-in transport that keeps the
frames written to it: no sockets, so what is measured is the server's own
work. Then ``--reps`` node-loss re-formations, each one measured in phases:

restart
    one member leaves: the round opens, ``restart`` goes to every survivor
    (serialized and framed once), the round written to storage;
rejoin
    each survivor's join frame but the last (the JSON the agent sends after
    ``restart``: its node secret, run and probe port) as the agent channel
    takes it: parsed to a JoinMsg (``AGENT_MESSAGE.validate_json``), counted,
    joined through the store (the handler's ``_dispatch``): the round
    machine (no ``joined`` reply: the join names the run, the agent knows
    the round from ``restart``). The parse alone is also measured apart
    (each message dropped at once);
complete
    the last join: the round completes, each member's ``assigned`` is built,
    serialized and framed, the round written to storage.

After the re-formations, ``resume``: every member's connection is lost, then
each one's join with ``resume_round`` on a new connection (a failover's
reconnects, or a dropped link's), parsed, counted and joined, told its
``assigned`` again (written from the round's template, ``forming.told_again``);
the best of 3 passes.

``--direct``: the joins offer direct ports (as rdzv-agent's), so each
re-formation is one step, the leave: the round opens and is formed at once,
each survivor's ``restart`` carrying its place (design.md "Direct
re-formation"); only its total is shown (at most 4 reps: rank 0 offered 4
ports, and the formation took one as the next).

Each phase in CPU microseconds (``time.process_time``) per survivor, the best
of ``--reps``; "total" is the best re-formation as a whole, and the part of
it spent in garbage collections (``gc.callbacks``). Below, one
``assigned`` taken apart, per message over the job's members: building its
text (``rounds.forming.messages``: the round's part validated and written
once, each member's own fields and watch list from the template) and framing
(``text_frame``). The first formation (N
new nodes) is shown for comparison, measured once. The server's garbage
collector thresholds apply (``rdzv_server.gc_policy.tune_gc``; the hold of
round changes, ``GcHold``, stays off, as in any store rdzv-server does not
run, so the collections it would defer are counted here), and logging at
INFO to nowhere, as a server's log at its default level costs.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import io
import json
import logging
import os
import pstats
import shutil
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

from rdzv_common.protocol import AGENT_MESSAGE, JobSpec, JoinMsg
from rdzv_server.agent_conn import _dispatch
from rdzv_server.events import EventLog
from rdzv_server.metrics import Metrics
from rdzv_server.rounds.forming import messages
from rdzv_server.store import Store, StoreSettings
from rdzv_server.ws_channel import WsChannel, text_frame

from . import _common as C

JOB = "big"
PHASES = ("restart", "rejoin", "complete")


class Transport:
    """A connection's transport, as much of it as the channel and the store use:
    the peer it came from, and every frame written (nothing is sent)."""

    def __init__(self, ip: str) -> None:
        self.peer = (ip, 40000)
        self.frames: list[bytes] = []

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.peer if name == "peername" else default

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        self.frames.append(data)

    def abort(self) -> None:
        pass


class Ws:
    """What the channel reads of its aiohttp WebSocket: no compression, open."""

    compress = 0
    closed = False

    async def send_str(self, text: str) -> None:
        pass

    async def close(self, code: int = 1000, message: bytes = b"") -> bool:
        return True


def texts(frames: list[bytes]) -> list[str]:
    """The text of each server frame (unmasked, as ws_channel.text_frame builds them)."""
    out = []
    for f in frames:
        n, head = f[1], 2
        if n == 126:
            n, head = struct.unpack("!H", f[2:4])[0], 4
        elif n == 127:
            n, head = struct.unpack("!Q", f[2:10])[0], 10
        out.append(f[head : head + n].decode())
    return out


def ip_of(i: int) -> str:
    return f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}"


def frame_of(
    i: int,
    spec: JobSpec,
    secret: str | None = None,
    run: int | None = None,
    direct: bool = False,
    resume: int | None = None,
) -> str:
    """Node ``i``'s join as its agent sends it (after ``restart``: its secret and run;
    ``direct``: offering direct ports, as rdzv-agent's; ``resume``: the round its workers
    run, on a new connection)."""
    msg = JoinMsg(
        job_id=JOB,
        node_id=f"node{i:06d}",
        host=f"host{i}",
        addr=ip_of(i),
        local_world_size=8,
        master_port=29500,
        spec=spec,
        node_secret=secret,
        run=run,
        probe_port=29400,
        direct_ports=[29501, 29502, 29503, 29504] if direct else [],
        resume_round=resume,
    )
    return msg.model_dump_json(exclude_none=True)


async def _run(n: int, reps: int, backend: str, profile: cProfile.Profile | None, direct: bool) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="rdzv-bench-join-"))
    clock = [1000.0]
    metrics = Metrics()
    store = Store(
        StoreSettings(data_dir=tmp if backend == "sqlite" else None),
        clock=lambda: clock[0],
        metrics=metrics,
        events=EventLog(clock=lambda: clock[0]),
    )
    store.open()
    counted = metrics.agent_message
    spec = JobSpec(min_nodes=max(1, n - reps - 1), max_nodes=n, heartbeat_timeout_s=3600, join_timeout_s=3600)
    transports = [Transport(ip_of(i)) for i in range(n)]
    chans = [WsChannel(Ws(), t, t.peer[0]) for t in transports]  # type: ignore[arg-type]
    out: dict[str, Any] = {"nodes": n, "reps": reps, "backend": backend, "direct": direct, "load_before": C.loadavg()}
    try:
        # formation: N new nodes (measured once)
        frames = [frame_of(i, spec, direct=direct) for i in range(n)]
        t = time.process_time()
        for i, text in enumerate(frames):
            msg = AGENT_MESSAGE.validate_json(text)
            counted(msg.op)
            _dispatch(store, msg, None, chans[i])  # type: ignore[arg-type]
        out["formation_us"] = (time.process_time() - t) / n * 1e6
        job = store.jobs[JOB]
        assert job.state.value == "running" and len(job.order) == n, job.state
        secrets: dict[int, str] = {}
        for i, tr in enumerate(transports):
            for text in texts(tr.frames):
                if '"op":"joined"' in text:
                    secrets[i] = json.loads(text)["node_secret"]
            tr.frames.clear()
        live = list(range(n))
        best = dict.fromkeys((*PHASES, "parse", "gc", "total"), float("inf"))
        for rep in range(reps):
            clock[0] += 1.0
            lost = live.pop(len(live) // 2)  # (rank 0 stays: the master address does not move)
            run = job.run
            frames = [frame_of(i, spec, secrets[i], run) for i in live]
            t = time.process_time()
            for text in frames:  # the parse alone, apart (each message dropped at once, as the server's)
                AGENT_MESSAGE.validate_json(text)
            parse = time.process_time() - t
            last = len(live) - 1
            with _GcTime() as gc_time:
                if profile is not None:
                    profile.enable()
                t0 = time.process_time()
                store.leave(JOB, f"node{lost:06d}", "bench", chans[lost])
                t1 = time.process_time()
                # each frame as the agent channel takes it: parsed, counted, joined (direct: none)
                for k in range(0 if direct else last):
                    msg = AGENT_MESSAGE.validate_json(frames[k])
                    counted(msg.op)
                    _dispatch(store, msg, None, chans[live[k]])  # type: ignore[arg-type]
                t2 = time.process_time()
                if not direct:
                    msg = AGENT_MESSAGE.validate_json(frames[last])
                    counted(msg.op)
                    _dispatch(store, msg, None, chans[live[last]])  # type: ignore[arg-type]
                t3 = time.process_time()
                if profile is not None:
                    profile.disable()
            spent = {"restart": t1 - t0, "rejoin": t2 - t1, "complete": t3 - t2, "parse": 0.0 if direct else parse}
            spent |= {"gc": gc_time.spent, "total": t3 - t0}
            for phase, sec in spent.items():
                best[phase] = min(best[phase], sec / len(live) * 1e6)
            job = store.jobs[JOB]
            assert job.state.value == "running" and job.round == rep + 1 and len(job.order) == len(live)
            told = sum(len(transports[i].frames) for i in live)
            each = 1 if direct else 2
            assert told == each * len(live), f"{told} frames for {len(live)} survivors: restart (and assigned) each"
            for i in live:
                transports[i].frames.clear()
        out.update({f"{k}_us": v for k, v in best.items()})
        out["resume_us"] = _resumes(store, job, spec, secrets, live, transports, direct)
        out.update(_assigned_parts(store, job))
        out["load_after"] = C.loadavg()
        return out
    finally:
        await store.stop()
        shutil.rmtree(tmp, ignore_errors=True)


class _GcTime:
    """CPU seconds the garbage collector spent in collections while the block ran."""

    def __init__(self) -> None:
        self.spent = 0.0
        self._at = 0.0

    def __enter__(self) -> _GcTime:
        gc.callbacks.append(self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._note)

    def _note(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._at = time.process_time()
        else:
            self.spent += time.process_time() - self._at


def _resumes(
    store: Store, job: Any, spec: JobSpec, secrets: dict[int, str], live: list[int], transports: list, direct: bool
) -> float:
    """Each member reconnects and resumes the running round (its join with ``resume_round``
    on a new connection, as after a failover or a dropped link): parsed, counted, joined;
    told its ``assigned`` again. CPU µs per member, the best of 3 passes; before each,
    every member's connection is lost (not measured)."""
    frames = [frame_of(i, spec, secrets[i], job.run, direct, resume=job.round) for i in live]
    best = float("inf")
    for _ in range(3):
        for i in live:
            nid = f"node{i:06d}"
            store.disconnected(JOB, nid, store.channels[(JOB, nid)])
        for i in live:
            transports[i].frames.clear()  # (what the losses told the others: their heartbeat pace)
        chans = [WsChannel(Ws(), transports[i], transports[i].peer[0]) for i in live]  # type: ignore[arg-type]
        t = time.process_time()
        for k, text in enumerate(frames):
            msg = AGENT_MESSAGE.validate_json(text)
            store.metrics.agent_message(msg.op)  # type: ignore[union-attr]
            _dispatch(store, msg, None, chans[k])  # type: ignore[arg-type]
        best = min(best, (time.process_time() - t) / len(live) * 1e6)
        told = [texts(transports[i].frames) for i in live]
        assert all(sum(x.startswith('{"op":"assigned"') for x in t) == 1 for t in told), told[0]
        for i in live:
            transports[i].frames.clear()
    return best


def _assigned_parts(store: Store, job: Any) -> dict[str, float]:
    """One ``assigned`` per member of the running round, as its completion writes them
    (rounds.forming.messages), taken apart: build (the text), frame (µs each)."""
    members = [job.nodes[nid] for nid in job.order]
    best = {"build": float("inf"), "frame": float("inf")}
    for _ in range(3):
        t0 = time.process_time()
        out = [m.text for m in messages(job, members)]
        t1 = time.process_time()
        for text in out:
            text_frame(text)
        t2 = time.process_time()
        for k, s in (("build", t1 - t0), ("frame", t2 - t1)):
            best[k] = min(best[k], s / len(members) * 1e6)
    return {f"assigned_{k}_us": v for k, v in best.items()} | {"assigned_bytes": len(out[len(out) // 2])}


def run(
    n: int, reps: int = 5, backend: str = "sqlite", profile: cProfile.Profile | None = None, direct: bool = False
) -> dict[str, Any]:
    return asyncio.run(_run(n, reps, backend, profile, direct))


_RESUME_ROW = "resume (each member's join with resume_round on a new connection: assigned again)"


def table(r: dict[str, Any]) -> str:
    if r.get("direct"):
        return _direct_table(r)
    rows = [
        ["restart (a member leaves: the round opens, restart to every survivor)", f"{r['restart_us']:.1f}"],
        ["rejoin (each survivor's join frame parsed, counted and joined; no joined reply)", f"{r['rejoin_us']:.1f}"],
        ["- of which the parse, JSON -> JoinMsg (measured apart)", f"{r['parse_us']:.1f}"],
        ["complete (the last join: each assigned built, serialized, framed; round written)", f"{r['complete_us']:.1f}"],
        ["total", f"{r['total_us']:.1f}"],
        ["- of which in garbage collections", f"{r['gc_us']:.1f}"],
    ]
    rows += [[f"one assigned: {k}", f"{r[f'assigned_{k}_us']:.1f}"] for k in ("build", "frame")]
    rows.append(["formation (the first joins, once)", f"{r['formation_us']:.1f}"])
    rows.append([_RESUME_ROW, f"{r['resume_us']:.1f}"])
    head = f"{r['nodes']:,} nodes, {r['backend']}, best of {r['reps']}: CPU µs per survivor"
    return (
        C.md_table([head, "µs"], rows)
        + f"\n\nassigned: {r['assigned_bytes']} bytes; load average {r['load_before']} -> {r['load_after']}"
    )


def _direct_table(r: dict[str, Any]) -> str:
    rows = [
        ["a member leaves: the round opens and is formed, each survivor's restart carries its place", ""],
        ["total", f"{r['total_us']:.1f}"],
        ["- of which in garbage collections", f"{r['gc_us']:.1f}"],
        ["formation (the first joins, once)", f"{r['formation_us']:.1f}"],
        [_RESUME_ROW, f"{r['resume_us']:.1f}"],
    ]
    head = f"{r['nodes']:,} nodes, {r['backend']}, direct re-formation, best of {r['reps']}: CPU µs per survivor"
    return C.md_table([head, "µs"], rows) + f"\n\nload average {r['load_before']} -> {r['load_after']}"


def main() -> None:
    from rdzv_server.gc_policy import tune_gc

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=16384)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--backend", choices=("sqlite", "memory"), default="sqlite")
    p.add_argument("--profile", metavar="FILE", help="cProfile the re-formations; stats to FILE, top 40 printed")
    p.add_argument("--out", default=None)
    p.add_argument("--direct", action="store_true", help="joins offer direct ports (as rdzv-agent's): one phase")
    a = p.parse_args()
    with open(os.devnull, "w") as null:
        logging.basicConfig(level=logging.INFO, stream=null)  # the server's default level, written nowhere
        tune_gc()
        prof = cProfile.Profile() if a.profile else None
        r = run(a.nodes, min(a.reps, 4) if a.direct else a.reps, a.backend, prof, a.direct)
        print(table(r))
        if prof is not None:
            prof.dump_stats(a.profile)
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(40)
            print(s.getvalue())
        if a.out:
            Path(a.out).write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
