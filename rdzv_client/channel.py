"""The agent side of the worker channel (design.md "The worker channel").

* :class:`WorkerChannel` - a Unix datagram socket in a private (0700)
  directory, given to workers as ``RDZV_AGENT_SOCKET``; it keeps each local
  rank's last step and the time of its last :func:`rdzv_client.worker.progress`
  call (:class:`RankProgress`), for the round the agent runs now, and its
  timing totals (:mod:`rdzv_client.steptime`): :meth:`WorkerChannel.timings`
  makes each heartbeat's per-rank window of them.
* :class:`FileTimerServer` - torch elastic's ``FileTimerClient`` wire format
  (a named pipe of JSON lines ``{"version", "pid", "scope_id",
  "expiration_time", "signal"}``; a negative expiration releases), read without
  importing torch. Only the agent's own workers (or processes in their process
  groups) can be killed through it.

Everything here is bounded: datagrams of at most :data:`MAX_DATAGRAM` bytes,
one entry per local rank, at most :data:`MAX_TIMERS` timers and
:data:`MAX_LINE` bytes per pipe line; malformed input is dropped (counted).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from rdzv_common.wire import MAX_TIMING_WINDOW_S, MAX_TIMINGS, printable

from . import channel_grammar as grammar
from . import peercred
from .quiet import Quiet
from .where import MAX_WHERE

log = logging.getLogger("rdzv_agent")

MAX_DATAGRAM = 96  # "<round> <local_rank> <step> <compute_us> <wait_us>"
MAX_WHERE_HEAD = 64  # "<round> <local_rank> where ": a where answer is at most this and MAX_WHERE
MAX_DRAIN = 1024  # datagrams one hang check reads from the socket itself
MAX_STEP = 2**53
MAX_TIMERS = 1024
MAX_LINE = 4096  # PIPE_BUF: torch's client refuses larger requests
MAX_SCOPE_ID = 256
MAX_TRUSTED = 4096  # senders remembered as ours per round (workers and their children)
MIN_WINDOW_S = 0.001  # a rank's timing window spans at least this (two datagrams drained at once: none)


@dataclass
class RankProgress:
    """One local rank's progress: its last step and when it last called."""

    step: int
    at: float  # monotonic time of the last datagram
    # the step and time at the previous rate sample: steps/s over the last interval
    rate_step: int = 0
    rate_at: float = 0.0
    rate: float | None = None
    finished: bool = False  # rdzv_client.worker.finished(): not watched for hangs
    # timing totals (rdzv_client.steptime, microseconds) as of the last datagram; None: not timed
    compute_us: int | None = None
    wait_us: int = 0
    # the totals, step and datagram time at the previous timings() window: the next starts there
    t_compute_us: int = 0
    t_wait_us: int = 0
    t_step: int = 0
    t_at: float = 0.0


class WorkerChannel:
    """The socket workers report progress on, and what they reported."""

    def __init__(self, nproc: int, dir: Path | None = None, workers: Callable[[], Iterable[int]] | None = None) -> None:
        """``dir``: a private (0700) directory its owner removes; None: one of its own.
        ``workers``: the pids of this agent's workers: a datagram from any other
        process (and not from their process groups or descendants) is ignored,
        counted in ``forged`` and logged at most every 30 s. None: unchecked."""
        self.nproc = nproc
        self.workers = workers
        self.forged = 0  # datagrams from a process that is not one of our workers
        self.checked = False  # the kernel tells each datagram's sender (SO_PASSCRED)
        self._quiet = Quiet()
        self._trusted: set[int] = set()  # senders found to be ours this round
        self._own_dir = dir is None
        self.dir = Path(tempfile.mkdtemp(prefix="rdzv-agent-")) if dir is None else dir  # 0700: mkdtemp's mode
        os.chmod(self.dir, stat.S_IRWXU)
        self.path = str(self.dir / "sock")
        self.round: int | None = None
        self.ranks: dict[int, RankProgress] = {}
        self.dropped = 0  # malformed or stale datagrams
        # in-place re-formation: local rank -> the round it left at its safe point
        self.parked: dict[int, int] = {}
        # local rank -> the frames its main thread was in, answering "where" (an escalation)
        self.where: dict[int, str] = {}
        self.on_parked: Callable[[int, int], None] | None = None
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.checked = peercred.enable(sock)  # before bind: no datagram arrives unlabelled
        sock.bind(self.path)
        os.chmod(self.path, stat.S_IRUSR | stat.S_IWUSR)
        sock.setblocking(False)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(sock.fileno(), self._readable)
        self._sock = sock

    def close(self) -> None:
        if self._sock is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
        self._sock = None
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def new_round(self, round_no: int | None) -> None:
        """Workers of ``round_no`` start now (None: none run): forget the last ones."""
        self.round = round_no
        self.ranks.clear()
        self.where.clear()
        self._trusted.clear()

    def _readable(self) -> None:
        self.drain(time.monotonic())

    def _from_workers(self, pid: int | None, uid: int | None) -> bool:
        """Whether a datagram's sender is one of this agent's workers (or in
        one's process group, or a descendant); unchecked without ``workers``
        or where the kernel does not say (not Linux)."""
        if self.workers is None or not self.checked:
            return True
        if pid is not None and pid > 0 and uid == os.getuid():
            if pid in self._trusted:
                return True
            if peercred.from_workers(pid, set(self.workers())):
                if len(self._trusted) < MAX_TRUSTED:
                    self._trusted.add(pid)
                return True
        self.forged += 1
        said = self._quiet.allow("forged")
        if said is not None:
            log.warning(
                "worker channel: ignored a datagram from pid %s, which is not one of this agent's workers%s",
                pid,
                said,
            )
        return False

    def received(self, data: bytes, now: float) -> None:
        head = data.split(maxsplit=3)
        if len(head) >= 3 and head[2] == grammar.WHERE and len(data) <= MAX_WHERE_HEAD + MAX_WHERE:
            self._where(head[0], head[1], head[3] if len(head) == 4 else b"")
            return
        parts = data.split() if len(data) <= MAX_DATAGRAM else []
        if len(parts) == 3 and parts[2] == grammar.PARKED:
            self._parked(parts[0], parts[1])
            return
        end = len(parts) == 3 and parts[2] == grammar.END
        timed: tuple[int, int] | None = None
        try:
            round_no, local_rank = (int(p) for p in parts[:2]) if len(parts) in (3, 5) else (-1, -1)
            step = 0 if end else int(parts[2])
            if len(parts) == 5:
                timed = (int(parts[3]), int(parts[4]))
        except (ValueError, IndexError):
            round_no = local_rank = step = -1
        if (
            round_no != self.round
            or not 0 <= local_rank < self.nproc
            or not 0 <= step <= MAX_STEP
            or (timed is not None and not (0 <= timed[0] <= MAX_STEP and 0 <= timed[1] <= MAX_STEP))
        ):
            self.dropped += 1
            return
        rp = self.ranks.get(local_rank)
        if end:
            if rp is not None:
                rp.finished = True
            return
        if rp is None:
            rp = self.ranks[local_rank] = RankProgress(step=step, at=now, rate_step=step, rate_at=now)
            if timed is not None:  # the first window starts at the round's first datagram
                rp.t_compute_us, rp.t_wait_us, rp.t_step, rp.t_at = timed[0], timed[1], step, now
        elif rp.compute_us is None and timed is not None:  # timed from now on: its first window starts here
            rp.t_compute_us, rp.t_wait_us, rp.t_step, rp.t_at = timed[0], timed[1], step, now
        rp.step, rp.at, rp.finished = step, now, False
        if timed is not None:
            rp.compute_us, rp.wait_us = timed

    def _parked(self, round_b: bytes, rank_b: bytes) -> None:
        """A worker is at its safe point, out of round ``round_b`` (in-place mode)."""
        try:
            round_no, local_rank = int(round_b), int(rank_b)
        except ValueError:
            round_no = local_rank = -1
        if self.round is None or not 0 <= round_no <= self.round or not 0 <= local_rank < self.nproc:
            self.dropped += 1
            return
        self.parked[local_rank] = round_no
        self.ranks.pop(local_rank, None)  # parked: not hung
        if self.on_parked is not None:
            self.on_parked(local_rank, round_no)

    def _where(self, round_b: bytes, rank_b: bytes, text: bytes) -> None:
        """A worker's answer to ``where``: the frames its main thread is in."""
        try:
            round_no, local_rank = int(round_b), int(rank_b)
        except ValueError:
            round_no = local_rank = -1
        if self.round is None or not 0 <= round_no <= self.round or not 0 <= local_rank < self.nproc:
            self.dropped += 1
            return
        self.where[local_rank] = printable(text.decode("ascii", "replace"), limit=MAX_WHERE)

    def tell(self, local_rank: int, message: str) -> bool:
        """Send ``message`` to that worker's in-place socket; False when no
        worker listens there (it does not use rdzv_client.worker.rounds())."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            s.setblocking(False)
            s.sendto(message.encode(), grammar.worker_socket(self.dir, local_rank))
            return True
        except OSError:
            return False
        finally:
            s.close()

    def drain(self, now: float) -> None:
        """Take in the datagrams still waiting in the socket, as received at
        ``now`` (at most MAX_DRAIN: the queue is short, this never loops long)."""
        sock = self._sock
        if sock is None:
            return
        for _ in range(MAX_DRAIN):
            try:
                # one byte more than the longest datagram taken: a longer one is dropped
                data, pid, uid = peercred.recv(sock, max(MAX_DATAGRAM, MAX_WHERE_HEAD + MAX_WHERE) + 1)
            except OSError:  # BlockingIOError: none left
                return
            if self._from_workers(pid, uid):
                self.received(data, now)

    def hung(self, timeout_s: float, now: float) -> list[int]:
        """Local ranks that called progress() once and then not for ``timeout_s``.

        The datagrams waiting in the socket count first: when the agent's loop
        ran late (a loaded machine gave it no CPU for seconds), the transport
        has not read what workers sent meanwhile, and a worker that kept
        calling progress() is not hung."""
        self.drain(now)
        return sorted(lr for lr, rp in self.ranks.items() if not rp.finished and now - rp.at > timeout_s)

    def sample(self, now: float) -> tuple[int, float | None] | None:
        """This node's progress for the server: the lowest last step of its
        ranks and that rank's steps/s since the previous sample; None before
        any rank reported."""
        if not self.ranks:
            return None
        for rp in self.ranks.values():
            if now - rp.rate_at > 0:
                rp.rate = max(0.0, (rp.step - rp.rate_step) / (now - rp.rate_at))
                rp.rate_step, rp.rate_at = rp.step, now
        slowest = min(self.ranks.values(), key=lambda rp: rp.step)
        rate = slowest.rate
        return slowest.step, (round(rate, 3) if rate is not None and math.isfinite(rate) else None)

    def timings(self) -> list[dict[str, float | int]]:
        """Per local rank that sent timing totals since the previous call: its
        window (seconds between the two datagrams), the steps in it, and its
        compute and wait inside collectives in it (``HeartbeatMsg.timings``,
        within the wire's bounds: the first MAX_TIMINGS local ranks). A rank
        whose totals went back (a new process) starts a new window."""
        out: list[dict[str, float | int]] = []
        for lr, rp in sorted(self.ranks.items()):
            if rp.compute_us is None or rp.at - rp.t_at < MIN_WINDOW_S or len(out) == MAX_TIMINGS:
                continue
            window, steps = rp.at - rp.t_at, rp.step - rp.t_step
            compute, wait = rp.compute_us - rp.t_compute_us, rp.wait_us - rp.t_wait_us
            rp.t_compute_us, rp.t_wait_us, rp.t_step, rp.t_at = rp.compute_us, rp.wait_us, rp.step, rp.at
            if min(steps, compute, wait) < 0:
                continue
            out.append(
                {
                    "local_rank": lr,
                    "window_s": round(min(window, MAX_TIMING_WINDOW_S), 6),
                    "steps": steps,
                    "compute_s": round(min(compute / 1e6, MAX_TIMING_WINDOW_S), 6),
                    "wait_s": round(min(wait / 1e6, MAX_TIMING_WINDOW_S), 6),
                }
            )
        return out


# ------------------------------------------------------------- torch's FileTimer


@dataclass
class _Timer:
    pid: int
    scope_id: str
    expiration_time: float  # wall clock, as torch's client sends it
    signal: int


@dataclass
class FileTimerServer:
    """torch.distributed.elastic.timer.FileTimerServer's job, for rdzv-agent.

    ``allowed`` returns the pids a timer may kill: the agent's workers.
    ``on_expired(pid, scope_id)`` is called after an expired timer's signal
    was sent to ``pid``.
    """

    path: str
    allowed: Callable[[], Iterable[int]]
    on_expired: Callable[[int, str], None]
    timers: dict[tuple[int, str], _Timer] = field(default_factory=dict)
    dropped: int = 0
    _rfd: int = -1
    _wfd: int = -1
    _buf: bytes = b""

    def start(self) -> None:
        if os.path.lexists(self.path):
            os.remove(self.path)
        os.mkfifo(self.path, 0o600)
        # our own writer keeps the pipe from reading end-of-file between clients
        self._rfd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        self._wfd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
        asyncio.get_running_loop().add_reader(self._rfd, self._read)

    def close(self) -> None:
        if self._rfd >= 0:
            asyncio.get_running_loop().remove_reader(self._rfd)
            os.close(self._rfd)
            os.close(self._wfd)
            self._rfd = self._wfd = -1
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass

    def _read(self) -> None:
        try:
            chunk = os.read(self._rfd, 65536)
        except BlockingIOError:
            return
        data = self._buf + chunk
        lines = data.split(b"\n")
        self._buf = lines.pop()
        if len(self._buf) > MAX_LINE:
            self._buf = b""
            self.dropped += 1
        for line in lines:
            if line.strip():
                self._request(line)

    def _request(self, line: bytes) -> None:
        try:
            if len(line) > MAX_LINE:
                raise ValueError("too long")
            req = json.loads(line)
            pid, scope_id, expiration, sig = req["pid"], req["scope_id"], req["expiration_time"], req["signal"]
            if not (
                isinstance(pid, int)
                and 0 < pid < 2**31
                and isinstance(scope_id, str)
                and len(scope_id) <= MAX_SCOPE_ID
                and isinstance(expiration, (int, float))
                and math.isfinite(expiration)
                and isinstance(sig, int)
                and 0 <= sig < 65
            ):
                raise ValueError("bad fields")
        except (ValueError, KeyError, TypeError):
            self.dropped += 1
            return
        key = (pid, scope_id)
        if expiration < 0:
            self.timers.pop(key, None)
        elif key in self.timers or len(self.timers) < MAX_TIMERS:
            self.timers[key] = _Timer(pid, scope_id, float(expiration), sig)
        else:
            self.dropped += 1

    def clear(self) -> None:
        self.timers.clear()

    def check(self, now: float | None = None) -> None:
        """Send the signal of every expired timer (to our workers only), as
        torch's watchdog does; a timer with signal 0 is only dropped."""
        now = time.time() if now is None else now
        expired = [t for t in self.timers.values() if t.expiration_time <= now]
        if not expired:
            return
        allowed = set(self.allowed())
        for t in expired:
            self.timers.pop((t.pid, t.scope_id), None)
        for t in sorted(expired, key=lambda t: t.expiration_time):
            if t.signal <= 0:
                continue
            if t.pid not in allowed and _pgid(t.pid) not in allowed:
                log.warning(
                    "timer %r expired for pid %d, which is not one of this agent's workers: ignored",
                    printable(t.scope_id, limit=100),
                    t.pid,
                )
                continue
            try:
                os.kill(t.pid, t.signal)
            except (ProcessLookupError, PermissionError):
                continue
            self.on_expired(t.pid, t.scope_id)


def _pgid(pid: int) -> int:
    try:
        return os.getpgid(pid)
    except OSError:
        return -1
