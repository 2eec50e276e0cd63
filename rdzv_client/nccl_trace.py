"""Which rank lags in collective count: the zero-code fallback for lock-step
stragglers on GPU (issue 22, item 4). Standard library only.

Workers that call neither ``worker.compute()`` nor the library's group send no
timings; on NCCL there are two places that still say who is behind:

* NCCL's RAS (2.24+, on by default: ``NCCL_RAS_ENABLE``): a thread in every
  NCCL process answers on ``localhost:28028`` (``NCCL_RAS_ADDR``) with the
  whole job's view, every communicator's ranks and how many collectives of
  each kind each launched. :func:`ras_query` speaks its client protocol (what
  the ``ncclras`` tool sends); :func:`parse_ras_json` reads the JSON form
  (``SET FORMAT json``, newer NCCL), :func:`parse_ras_text` the text form
  (every version: its ``MISMATCH`` warnings list the ranks whose counts differ).
* torch's Flight Recorder (``TORCH_FR_BUFFER_SIZE``, or
  ``TORCH_NCCL_TRACE_BUFFER_SIZE``): a rank's JSON dump
  (``torch._C._distributed_c10d._dump_nccl_trace_json``, ``_dump_fr_trace_json``,
  or the 2.13 worker server's ``fr_trace_json`` / ``dump_nccl_trace_json``
  handlers) has per process group ``pg_status.last_enqueued_collective``:
  :func:`parse_fr` reads it, :func:`fr_snapshot` compares ranks' dumps. Pickle
  dumps are not read (unpickling runs code); the JSON ones hold the same fields.

One reading is a :data:`Snapshot`: per communicator, its ranks and how many
collectives each launched fewer than the most common count (RAS's own
reference; 0: not behind). In lock-step training a healthy rank launches its
next collective with its peers, so it is seldom seen behind (a reading is not
one instant on every rank: launch jitter shows as 1 behind now and then); a
rank whose host-side step is longer is behind for that much of each step, and
a hung one always. A single reading decides nothing: :class:`LagTracker`
flags a rank behind in at least ``LAG_SHARE`` of the readings over a window
(and ``MIN_SAMPLES`` of them) AND in ``LAG_RATIO`` times the share of the
median other rank of its communicator (where every rank jitters, the one at
the edge of the jitter is no straggler). What
it cannot see: a rank whose GPU alone is slow while its host keeps launching
ahead (launch counts are host-side); the timings (:mod:`rdzv_client.steptime`)
see that one.

``python -m rdzv_client.nccl_trace ras [--port P] [--json]`` or
``... fr DUMP.json ...`` prints one reading (``scripts/gpu-check`` runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

RAS_PORT = 28028  # NCCL's default RAS client port (NCCL_RAS_CLIENT_PORT)
RAS_PROTOCOL = 2  # NCCL_RAS_CLIENT_PROTOCOL that this client speaks
MAX_REPLY_BYTES = 8 << 20  # a RAS reply or a dump read at most this much (a 4,096-rank job's JSON is ~2 MB)
MAX_COMMS = 4096  # communicators read from one reading; the rest are left out
MAX_RANKS = 65536  # ranks per communicator read
MAX_SAMPLES = 600  # readings a tracker keeps (its window cuts them first)
MIN_SAMPLES = 5  # readings in the window before anyone is flagged
LAG_SHARE = 0.3  # behind in at least this share of the readings: flagged ...
LAG_RATIO = 3.0  # ... and in this many times the share of the median other rank of its communicator
READINGS_PER_WINDOW = 10  # an agent's RAS readings per straggler window (at most one a second)

# One reading: per communicator id, {its rank: (collectives behind, 0 if none; pid or 0)}. The text form
# lists only the ranks whose counts differ: its communicators have only those.
Snapshot = dict[str, dict[int, tuple[int, int]]]


class TraceError(ValueError):
    """A reply or dump that is not what NCCL or torch writes."""


@dataclass(frozen=True, order=True)
class Flag:
    """A rank behind in ``share`` of ``samples`` readings over the window."""

    comm: str
    rank: int
    pid: int
    share: float
    samples: int
    behind: int  # the most collectives it was behind in one reading


def _reference(values: Iterable[int]) -> int:
    """The most common value (ties: the highest), RAS's reference count."""
    seen: dict[int, int] = {}
    for v in values:
        seen[v] = seen.get(v, 0) + 1
    return max(seen, key=lambda v: (seen[v], v))


def _int(v: object, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise TraceError(f"{what}: not an integer: {v!r:.40}")
    try:
        return int(v)
    except ValueError:
        raise TraceError(f"{what}: not an integer: {v!r:.40}") from None


def parse_ras_json(text: str) -> Snapshot:
    """NCCL RAS's JSON status: per communicator (``hash``), every rank and by
    how much its count of some collective kind is below the most common one
    (the largest such gap; 0: none). Missing ranks (``missing_ranks``) have no
    counts: not here."""
    try:
        doc = json.loads(text)
        comms = doc["communicators"]
    except (ValueError, KeyError, TypeError) as e:
        raise TraceError(f"not NCCL RAS JSON status: {e}") from None
    if not isinstance(comms, list):
        raise TraceError("not NCCL RAS JSON status: 'communicators' is not a list")
    out: Snapshot = {}
    for c in comms[:MAX_COMMS]:
        try:
            cid, ranks = str(c["hash"]), c["ranks"][:MAX_RANKS]
            counts = {
                _int(r["rank"], "rank"): (dict(r["collective_counts"]), _int(r.get("pid", 0), "pid")) for r in ranks
            }
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            if isinstance(e, TraceError):
                raise
            raise TraceError(f"NCCL RAS JSON: a communicator without ranks or counts: {e}") from None
        kinds = {k for cc, _ in counts.values() for k in cc}
        behind = {r: (0, pid) for r, (_, pid) in counts.items()}
        for kind in kinds:
            own = {r: _int(cc.get(kind, 0), kind) for r, (cc, _) in counts.items()}
            ref = _reference(own.values())
            for r, v in own.items():
                if ref - v > behind[r][0]:
                    behind[r] = (ref - v, counts[r][1])
        out[cid] = behind
    return out


def parse_ras_text(text: str) -> Snapshot:
    """NCCL RAS's text status (``VERBOSE STATUS``): its ``#g-i (hash) MISMATCH``
    warnings, where ranks of a communicator launched different numbers of one
    collective kind. Groups are listed most common first (the reference); a
    rank in another group is behind by the difference. Ranks RAS does not list
    (the common count, or a group too large to be an outlier) are not behind."""
    out: Snapshot = {}
    comm: str | None = None  # the MISMATCH warning being read
    counting = False  # past its "Communicator ranks have different X operation counts"
    ref: int | None = None  # that kind's most common count
    group: int | None = None  # the count of the group whose "Rank N -- ..." lines follow
    for raw in text.splitlines():
        line, words = raw.strip(), raw.split()
        if line.startswith("#"):
            mismatch = len(words) == 3 and words[2] == "MISMATCH" and len(out) < MAX_COMMS
            comm, counting = (words[1].strip("()") if mismatch else None), False
            if comm is not None:
                out.setdefault(comm, {})
            continue
        if comm is None:
            continue
        if raw and not raw[0].isspace():  # a heading: this communicator's warning is over
            comm = None
        elif line.startswith("Communicator ranks have different ") and line.endswith(" operation counts"):
            counting, ref, group = True, None, None
        elif not counting:
            continue
        elif " ranks have launched up to operation " in line or line.endswith(
            " ranks have not launched any operations"
        ):
            group = 0 if " not launched " in line else _int(words[-1], "operation")
            ref = group if ref is None else ref
        elif line.startswith("Rank ") and len(words) > 3:
            if words[2] == "has" and words[3] == "launched" and len(words) > 7:
                value = _int(words[7], "operation")  # a group of one: "Rank R has launched up to operation V -- ..."
            elif words[2:5] == ["has", "not", "launched"]:
                value = 0
            elif words[2] == "--" and group is not None:
                value = group
            else:
                continue
            ref = value if ref is None else ref
            rank = _int(words[1], "rank")
            pid = _int(words[words.index("process") + 1], "pid") if "process" in words[:-1] else 0
            if value < ref and (rank in out[comm] or len(out[comm]) < MAX_RANKS):
                out[comm][rank] = (max(out[comm].get(rank, (0, 0))[0], ref - value), pid)
        else:
            group = None
    return out


def parse_fr(text: str | bytes) -> dict[str, int]:
    """One rank's Flight Recorder JSON dump: per process group id, the sequence
    number of the last collective it enqueued (``pg_status``)."""
    try:
        doc = json.loads(text)
        status = doc["pg_status"]
        if not isinstance(status, dict):
            raise TypeError("pg_status is not an object")
        return {str(pg): _int(s["last_enqueued_collective"], "last_enqueued_collective") for pg, s in status.items()}
    except (ValueError, KeyError, TypeError) as e:
        if isinstance(e, TraceError):
            raise
        raise TraceError(f"not a Flight Recorder JSON dump: {e}") from None


def fr_snapshot(dumps: Mapping[int, Mapping[str, int]], pids: Mapping[int, int] | None = None) -> Snapshot:
    """Ranks' :func:`parse_fr` results (``{rank: {pg: seq}}``) compared per
    process group: by how much each rank is behind the most common sequence number."""
    out: Snapshot = {}
    groups = {pg for d in dumps.values() for pg in d}
    for pg in sorted(groups)[:MAX_COMMS]:
        own = {r: d[pg] for r, d in dumps.items() if pg in d}
        ref = _reference(own.values())
        out[f"pg {pg}"] = {r: (max(0, ref - v), (pids or {}).get(r, 0)) for r, v in own.items()}
    return out


class LagTracker:
    """Readings over a sliding window; :meth:`flagged` names the ranks behind
    in at least ``share`` of them and in LAG_RATIO x the share of their
    communicator's median other rank (ranks seen and never behind: 0).
    Bounded: MAX_SAMPLES readings."""

    def __init__(self, window_s: float, share: float = LAG_SHARE, min_samples: int = MIN_SAMPLES) -> None:
        if window_s <= 0 or not 0 < share <= 1 or min_samples < 1:
            raise ValueError("window_s > 0, 0 < share <= 1 and min_samples >= 1")
        self.window_s, self.share, self.min_samples = window_s, share, min_samples
        self._samples: deque[tuple[float, Snapshot]] = deque(maxlen=MAX_SAMPLES)

    def add(self, now: float, snap: Snapshot) -> None:
        self._samples.append((now, snap))
        while self._samples and now - self._samples[0][0] > self.window_s:
            self._samples.popleft()

    def clear(self) -> None:
        self._samples.clear()

    def flagged(self) -> list[Flag]:
        n = len(self._samples)
        if n < self.min_samples:
            return []
        seen: dict[str, dict[int, list[int]]] = {}  # comm -> rank -> [readings behind, most behind, pid]
        for _, snap in self._samples:
            for comm, reading in snap.items():
                for rank, (behind, pid) in reading.items():
                    s = seen.setdefault(comm, {}).setdefault(rank, [0, 0, 0])
                    s[0], s[1], s[2] = s[0] + (behind > 0), max(s[1], behind), pid or s[2]
        out = []
        for comm, ranks in seen.items():
            shares = {rank: s[0] / n for rank, s in ranks.items()}
            for rank, share in shares.items():
                others = sorted(v for r, v in shares.items() if r != rank)
                typical = others[len(others) // 2] if others else 0.0
                if share >= self.share and share >= LAG_RATIO * typical:
                    out.append(Flag(comm, rank, ranks[rank][2], share, n, ranks[rank][1]))
        return sorted(out)


def ras_query(
    host: str = "127.0.0.1", port: int = RAS_PORT, timeout: float = 10.0, fmt: str = "json"
) -> tuple[str, str]:
    """One RAS status, as NCCL's ``ncclras`` client asks it: the handshake,
    ``SET FORMAT json`` (``fmt`` "json"; an NCCL without it answers otherwise,
    and the text form is asked on a new connection), ``VERBOSE STATUS``, the
    reply until NCCL closes. Returns (format, reply). OSError: nobody listens
    (no NCCL process on this host), or it did not answer within ``timeout``."""
    with socket.create_connection((host, port), timeout=timeout) as s, s.makefile("rwb") as f:

        def ask(line: str) -> str:
            f.write(line.encode() + b"\n")
            f.flush()
            return f.readline(4096).decode(errors="replace")

        hello = ask(f"CLIENT PROTOCOL {RAS_PROTOCOL}")
        if not hello.upper().startswith("SERVER PROTOCOL "):
            raise OSError(f"not an NCCL RAS port: {hello.strip()[:80]!r}")
        if fmt == "json" and ask("SET FORMAT json").strip().upper() != "OK":
            reply = None  # an NCCL before the JSON form: asked again for text, once this one is closed
        else:
            f.write(b"VERBOSE STATUS\n")
            f.flush()
            reply = f.read(MAX_REPLY_BYTES + 1)
    if reply is None:
        return ras_query(host, port, timeout, "text")
    if len(reply) > MAX_REPLY_BYTES:
        raise OSError(f"NCCL RAS reply over {MAX_REPLY_BYTES} bytes")
    return fmt, reply.decode(errors="replace")


def ras_snapshot(host: str = "127.0.0.1", port: int = RAS_PORT, timeout: float = 10.0) -> Snapshot:
    fmt, reply = ras_query(host, port, timeout)
    return parse_ras_json(reply) if fmt == "json" else parse_ras_text(reply)


def ras_port() -> tuple[str, int]:
    """Where this host's NCCL processes answer: ``NCCL_RAS_ADDR`` (host:port) or localhost:28028."""
    addr = os.environ.get("NCCL_RAS_ADDR", "")
    host, _, port = addr.rpartition(":")
    try:
        return (host.strip("[]") or "127.0.0.1", int(port)) if addr else ("127.0.0.1", RAS_PORT)
    except ValueError:
        return "127.0.0.1", RAS_PORT


def ras_enabled(env: Mapping[str, str]) -> bool:
    """The agent reads RAS unless NCCL's RAS is off (``NCCL_RAS_ENABLE=0``) or
    the agent is told not to (``RDZV_NCCL_RAS=0``: RAS stays on for ``ncclras``)."""
    return env.get("NCCL_RAS_ENABLE", "1").strip() != "0" and env.get("RDZV_NCCL_RAS", "1").strip() != "0"


def reading_interval(window_s: float) -> float:
    """Seconds between two of an agent's readings: READINGS_PER_WINDOW per
    straggler window, at most one a second. Each reading is a RAS collective
    over the whole job's RAS network, and every agent of the job takes its own."""
    return max(1.0, window_s / READINGS_PER_WINDOW)


class RasWatch:
    """The agent's reader of this host's NCCL RAS while its workers run: a
    reading every ``interval_s`` (:func:`reading_interval`) on a thread of its
    own (a reading can take seconds: RAS asks every NCCL process of the job),
    into a :class:`LagTracker` over ``window_s``. Only where NCCL is in use:
    nobody answering on the RAS port (no NCCL process on this host: refused at
    once) or something else answering is asked again after ``PROBE_S``; off
    (:func:`ras_enabled`) it never asks. :meth:`tick` returns the agent's own
    ranks (by worker pid) newly behind; each is said once until it is no longer
    behind or a new round starts."""

    PROBE_S = 30.0  # nobody answered: ask again after this
    TIMEOUT_S = 10.0  # one reading's deadline

    def __init__(self, window_s: float, interval_s: float | None = None, env: Mapping[str, str] = os.environ) -> None:
        self.enabled = ras_enabled(env)
        self.addr = ras_port()
        self.interval_s = reading_interval(window_s) if interval_s is None else interval_s
        # the straggler window, but at least 2 x MIN_SAMPLES readings long (a 4 s window at one a second: 10 s)
        self.tracker = LagTracker(max(window_s, 2 * MIN_SAMPLES * self.interval_s))
        self.readings = 0  # readings taken (successful ones)
        self.error: str | None = None  # why the last reading failed
        self._thread: threading.Thread | None = None
        self._result: Snapshot | OSError | ValueError | None = None
        self._next = 0.0
        self._said: set[tuple[str, int]] = set()
        # (local rank, its worst flag) of this agent's workers flagged at the last tick, in local-rank
        # order: what the agent tells the server (HeartbeatMsg.nccl_lag)
        self.lagging: list[tuple[int, Flag]] = []

    def new_round(self) -> None:
        self.tracker.clear()
        self._said.clear()
        self.lagging = []

    def _read(self) -> None:
        try:
            self._result = ras_snapshot(*self.addr, timeout=self.TIMEOUT_S)
        except (OSError, ValueError) as e:  # TraceError is a ValueError
            self._result = e

    def tick(self, now: float, pids: Sequence[int]) -> list[tuple[int, Flag]]:
        """(local rank, flag) of this agent's workers (``pids``, by local rank) newly flagged."""
        if not self.enabled:
            return []
        if self._thread is not None and not self._thread.is_alive():
            self._thread, res, self._result = None, self._result, None
            if isinstance(res, dict):
                self.tracker.add(now, res)
                self.readings += 1
                self.error = None
            else:
                self.error, self._next = str(res), now + self.PROBE_S
        if self._thread is None and now >= self._next:
            self._next = now + self.interval_s  # from the start of a reading: one per interval, however long each takes
            self._thread = threading.Thread(target=self._read, name="rdzv-nccl-ras", daemon=True)
            self._thread.start()
        out: list[tuple[int, Flag]] = []
        flagged = {(f.comm, f.rank): f for f in self.tracker.flagged() if f.pid and f.pid in pids}
        worst: dict[int, Flag] = {}
        for key, f in sorted(flagged.items()):
            lr = list(pids).index(f.pid)
            if key not in self._said:
                out.append((lr, f))
            if lr not in worst or (f.share, f.behind) > (worst[lr].share, worst[lr].behind):
                worst[lr] = f
        self._said = set(flagged)
        self.lagging = sorted(worst.items())
        return out


def describe(snap: Snapshot) -> list[str]:
    return [
        f"{comm}: rank {rank} (pid {pid}) is {behind} collective(s) behind"
        for comm, ranks in sorted(snap.items())
        for rank, (behind, pid) in sorted(ranks.items())
        if behind
    ]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rdzv_client.nccl_trace", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("ras", help="ask this host's NCCL RAS once")
    r.add_argument("--host", default=None)
    r.add_argument("--port", type=int, default=None)
    r.add_argument("--timeout", type=float, default=10.0)
    r.add_argument("--text", action="store_true", help="ask the text form (every NCCL 2.24+)")
    f = sub.add_parser("fr", help="compare Flight Recorder JSON dumps, one per rank, in rank order")
    f.add_argument("dumps", nargs="+")
    a = p.parse_args(argv)
    try:
        if a.what == "ras":
            host, port = a.host or ras_port()[0], a.port or ras_port()[1]
            try:
                fmt, reply = ras_query(host, port, a.timeout, "text" if a.text else "json")
            except OSError as e:
                raise OSError(f"NCCL RAS at {host}:{port} (no NCCL process on this host?): {e}") from None
            snap = parse_ras_json(reply) if fmt == "json" else parse_ras_text(reply)
            print(f"NCCL RAS ({fmt}): {len(reply)} bytes")
        else:
            dumps = {}
            for i, path in enumerate(a.dumps):
                with open(path, "rb") as fh:
                    dumps[i] = parse_fr(fh.read(MAX_REPLY_BYTES))
            snap = fr_snapshot(dumps)
    except (OSError, TraceError) as e:
        print(f"nccl_trace: {e}", file=sys.stderr)
        return 1
    lines = describe(snap)
    print("\n".join(lines) if lines else "no rank behind")
    return 0


if __name__ == "__main__":
    sys.exit(main())
