"""Spawning, supervising and stopping one node's worker processes.

One :class:`WorkerGroup` is one attempt (one round) of one node: it starts
``local_world_size`` workers, copies their output to the console and to log
files the way torchrun does, tells the agent when the attempt is over
(:meth:`WorkerGroup.wait`), and stops it (:meth:`WorkerGroup.stop`).

Each worker runs in its own session, so it leads its own process group, and
every signal goes to the whole group: grandchildren (data loader workers,
``subprocess`` calls) get it too. A worker's end is a value, :class:`ExitInfo`,
never an exception.

Log layout, as torchrun's::

    {log_dir}/attempt_{attempt}/{local_rank}/stdout.log
                                            /stderr.log
                                            /error.json   (TORCHELASTIC_ERROR_FILE)

This module must stay importable without torch: the agent never imports it.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import IntFlag
from pathlib import Path
from string import Template
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from rdzv_server.protocol import Assignment

log = logging.getLogger(__name__)

__all__ = [
    "Std",
    "parse_std",
    "LaunchConfig",
    "worker_env",
    "error_file_path",
    "ExitInfo",
    "describe",
    "WorkerGroup",
]

MAX_MESSAGE_CHARS = 4000
# Workers die with their agent: an agent that is SIGKILLed (OOM killer, kill -9)
# must not leave workers running as a stale rank. util-linux's setpriv sets the
# parent-death signal and execs the worker (no preexec_fn: unsafe with threads).
_SETPRIV = shutil.which("setpriv") if sys.platform.startswith("linux") else None
_STDERR_TAIL_LINES = 20
_READ_CHUNK = 64 * 1024
# A "line" longer than this is printed in pieces rather than buffered forever
# (progress bars that only ever write "\r").
_MAX_LINE_BYTES = 64 * 1024
# After a worker exits, how long its pipes may stay open (held by a surviving
# grandchild) before its exit record is made without the rest of its output.
_DRAIN_GRACE_S = 1.0


# ------------------------------------------------------------------ std flags


class Std(IntFlag):
    """Which standard streams a setting applies to (torchrun's values)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


_VALUE_RE = re.compile(r"^[0-3]$")
_MAPPING_RE = re.compile(r"^\d+:[0-3](,\d+:[0-3])*$")


def parse_std(value: str, local_world_size: int) -> dict[int, Std]:
    """Parse torchrun's ``--redirects``/``--tee`` syntax into a per-local-rank map.

    ``"3"`` applies to every local rank; ``"0:3,1:0"`` names local ranks, the
    others get ``Std.NONE``. Ranks beyond ``local_world_size`` are ignored, as
    torchrun does, because every node gets the same flag whatever its nproc.
    Unlike torchrun, ranks may have more than one digit.
    """
    if local_world_size < 0:
        raise ValueError(f"local_world_size must be >= 0, got {local_world_size}")
    text = value.strip().replace(" ", "")
    if _VALUE_RE.match(text):
        return dict.fromkeys(range(local_world_size), Std(int(text)))
    if not _MAPPING_RE.match(text):
        raise ValueError(
            f"invalid stream setting {value!r}: expected one of 0,1,2,3 (0 none, 1 stdout, "
            "2 stderr, 3 both) for all local ranks, or local_rank:value pairs such as '0:3,1:2'"
        )
    out = dict.fromkeys(range(local_world_size), Std.NONE)
    seen: set[int] = set()
    for pair in text.split(","):
        rank_s, std_s = pair.split(":")
        rank = int(rank_s)
        if rank in seen:
            raise ValueError(f"invalid stream setting {value!r}: local rank {rank} given twice")
        seen.add(rank)
        if rank < local_world_size:
            out[rank] = Std(int(std_s))
    return out


def _to_map(setting: Mapping[int, Std] | Std, n: int) -> dict[int, Std]:
    if isinstance(setting, Std):
        return dict.fromkeys(range(n), setting)
    return {i: Std(setting.get(i, Std.NONE)) for i in range(n)}


# --------------------------------------------------------------- launch config


@dataclass(frozen=True)
class LaunchConfig:
    """How to start one node's workers; the same for every attempt.

    ``cmd`` is the full argv (``[python, "-u", script, *args]``); ``${local_rank}``
    in it is replaced per worker, as torchrun does. ``redirects`` sends a stream
    to its log file only, ``tee`` to the file and the console;
    ``local_ranks_filter`` limits what reaches the console, never the files.
    Files need ``log_dir``.
    """

    cmd: list[str]
    local_world_size: int
    log_dir: Path | None = None
    redirects: dict[int, Std] | Std = Std.NONE
    tee: dict[int, Std] | Std = Std.NONE
    local_ranks_filter: set[int] | None = None

    def __post_init__(self) -> None:
        if not self.cmd:
            raise ValueError("LaunchConfig.cmd must not be empty")
        if self.local_world_size < 1:
            raise ValueError(f"local_world_size must be >= 1, got {self.local_world_size}")
        if self.log_dir is None and any(
            _to_map(s, self.local_world_size)[r]
            for s in (self.redirects, self.tee)
            for r in range(self.local_world_size)
        ):
            raise ValueError("redirects and tee write log files: they need a log_dir")

    def streams(self, local_rank: int) -> tuple[Std, Std, bool]:
        """Return (to file, to console, shown) for one local rank.

        torchrun's rules: tee implies a file; a redirected stream that is not
        tee'd leaves the console; a filtered-out rank shows nothing.
        """
        redirect = _to_map(self.redirects, self.local_world_size)[local_rank]
        tee = _to_map(self.tee, self.local_world_size)[local_rank]
        to_file = redirect | tee
        to_console = (Std.ALL & ~to_file) | tee
        shown = self.local_ranks_filter is None or local_rank in self.local_ranks_filter
        return Std(to_file), Std(to_console if shown else Std.NONE), shown

    def attempt_dir(self, attempt: int) -> Path | None:
        return None if self.log_dir is None else Path(self.log_dir) / f"attempt_{attempt}"


def error_file_path(log_dir: Path | str, attempt: int, local_rank: int) -> Path:
    """Where a worker's ``TORCHELASTIC_ERROR_FILE`` goes in torchrun's layout."""
    return Path(log_dir) / f"attempt_{attempt}" / str(local_rank) / "error.json"


# ------------------------------------------------------------------ worker env


# What an agent may hold in its environment that its workers must not inherit.
WITHHELD_FROM_WORKERS = ("RDZV_TOKEN", "RDZV_JOB_SECRET")


def worker_env(
    base_env: Mapping[str, str],
    a: "Assignment",
    local_rank: int,
    job_id: str,
    error_file: str,
) -> dict[str, str]:
    """Return ``base_env`` plus exactly the variables torchrun gives a worker,
    less the agent's credentials (``RDZV_TOKEN``, ``RDZV_JOB_SECRET``).

    See DESIGN.md "The worker's environment". ``TORCHELASTIC_RESTART_COUNT``
    is the round number, the same on every node.
    """
    if not 0 <= local_rank < a.local_world_size:
        raise ValueError(f"local_rank {local_rank} outside 0..{a.local_world_size - 1}")
    rank = a.rank_offset + local_rank
    env = dict(base_env)
    env.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(a.world_size),
            "LOCAL_WORLD_SIZE": str(a.local_world_size),
            "GROUP_RANK": str(a.group_rank),
            "GROUP_WORLD_SIZE": str(a.group_world_size),
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(a.world_size),
            "ROLE_NAME": "default",
            "MASTER_ADDR": a.master_addr,
            "MASTER_PORT": str(a.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(a.round),
            "TORCHELASTIC_MAX_RESTARTS": str(a.max_restarts),
            "TORCHELASTIC_RUN_ID": job_id,
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCHELASTIC_ERROR_FILE": error_file,
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": base_env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        }
    )
    if "OMP_NUM_THREADS" not in base_env and a.local_world_size > 1:
        env["OMP_NUM_THREADS"] = "1"
    for name in WITHHELD_FROM_WORKERS:  # the agent's credentials are not the training script's
        env.pop(name, None)
    return env


# ----------------------------------------------------------------- exit records


@dataclass(frozen=True)
class ExitInfo:
    """How one worker ended: an exit code, or the signal that killed it."""

    local_rank: int
    pid: int
    exit_code: int | None
    signal: str | None
    message: str
    timestamp: float
    # where ``message`` came from: "error_file", "stderr" (its last lines), or ""
    source: str = ""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.signal is None


def _decode_returncode(returncode: int) -> tuple[int | None, str | None]:
    if returncode >= 0:
        return returncode, None
    try:
        return None, signal.Signals(-returncode).name
    except ValueError:
        return None, f"signal {-returncode}"


def describe(info: ExitInfo, rank: int | None = None) -> str:
    """One line for people: who ended, how, and the first words of why."""
    who = f"local rank {info.local_rank}" + (f" (rank {rank})" if rank is not None else "")
    who += f" pid {info.pid}"
    if info.signal is not None:
        how = f"was killed by {info.signal}"
        if info.signal == "SIGKILL":
            how += " (out of memory?)"
    elif info.exit_code == 0:
        how = "exited successfully"
    else:
        how = f"exited with code {info.exit_code}"
    lines = info.message.strip().splitlines()
    # an error file starts with "Type: text"; a stderr message with its error line
    why = lines[0].strip() if lines else ""
    return f"{who} {how}" + (f": {why}" if why else "")


def _trim_message(head: str, tail_lines: list[str], limit: int = MAX_MESSAGE_CHARS) -> str:
    """``head`` then as many of the last ``tail_lines`` as fit in ``limit`` chars."""
    head = head.strip()
    if len(head) >= limit:
        return head[: limit - 3] + "..."
    kept: list[str] = []
    size = len(head)
    for line in reversed(tail_lines):
        if size + len(line) + 1 > limit:
            break
        kept.append(line)
        size += len(line) + 1
    kept.reverse()
    return "\n".join([head, *kept]) if head else "\n".join(kept)


def read_error_file(path: str | os.PathLike[str]) -> str | None:
    """Return the message of a torch elastic error file, or None if there is none.

    torch's ``ErrorHandler.record_exception`` writes
    ``{"message": {"message": "Type: text", "extraInfo": {"py_callstack": ...,
    "timestamp": ...}}}``; older or hand-written files have ``{"message": str}``.
    The result is the first line plus the end of the traceback, at most
    ``MAX_MESSAGE_CHARS`` characters.
    """
    try:
        with open(path, encoding="utf-8", errors="replace") as fp:
            data = json.load(fp)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        return f"unreadable error file {os.fspath(path)}: {e}"
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, str):
        return _trim_message(message, [])
    if not isinstance(message, dict):
        return None
    head = str(message.get("message", ""))
    extra = message.get("extraInfo")
    stack = extra.get("py_callstack", "") if isinstance(extra, dict) else ""
    lines = [ln for ln in str(stack or "").splitlines() if ln.strip()]
    # the traceback's last line repeats the head; keep the frames before it
    if lines and lines[-1].strip() == head.strip():
        lines = lines[:-1]
    return _trim_message(head, lines)


_TRACEBACK_HEAD = "Traceback (most recent call last):"


def root_cause_line(lines: list[str]) -> str:
    """The line of a stderr tail that names the error, as torchrun's summary does.

    That is the first unindented line after the last traceback (the last
    ``Traceback (most recent call last):``, or, when a deep traceback's head
    scrolled out of the tail, its last ``File "..."`` frame): for chained
    exceptions the final one, never a warning printed before it nor the
    interpreter's noise after it. Without a traceback, the last line.
    """
    start = -1
    for i, line in enumerate(lines):
        if line.startswith(_TRACEBACK_HEAD) or line.startswith('  File "'):
            start = i
    if start >= 0:
        for line in lines[start + 1:]:
            if line.strip() and not line[:1].isspace():
                return line.strip()
    for line in reversed(lines):
        if line.strip():
            return line.strip()
    return ""


def _file_tail_lines(path: Path, n: int = _STDERR_TAIL_LINES, max_bytes: int = 8192) -> list[str]:
    try:
        with open(path, "rb") as fp:
            fp.seek(0, os.SEEK_END)
            size = fp.tell()
            fp.seek(max(0, size - max_bytes))
            data = fp.read()
    except OSError:
        return []
    lines = data.decode("utf-8", errors="replace").splitlines()
    if size > max_bytes and lines:
        lines = lines[1:]  # the first one is probably cut
    return [ln for ln in lines if ln.strip()][-n:]


# --------------------------------------------------------------------- workers


@dataclass
class _Worker:
    local_rank: int
    env: dict[str, str]
    prefix: str
    proc: asyncio.subprocess.Process | None = None
    readers: list[asyncio.Task[None]] = field(default_factory=list)
    monitor: asyncio.Task[ExitInfo] | None = None
    stderr_tail: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=_STDERR_TAIL_LINES)
    )
    stderr_file: Path | None = None


class WorkerGroup:
    """One attempt of one node's workers.

    ``envs[i]`` is the whole environment of local rank ``i`` (see
    :func:`worker_env`). ``console`` receives every shown line prefixed with
    ``prefix_fn(local_rank)`` (default ``"[{RANK}]: "``); None shows nothing.
    Always finish with :meth:`stop`: it is cheap when every worker has exited,
    and it kills what they left behind in their process groups.
    """

    def __init__(
        self,
        config: LaunchConfig,
        envs: list[dict[str, str]],
        attempt: int,
        console: TextIO | None = sys.stdout,
        prefix_fn: Callable[[int], str] | None = None,
    ) -> None:
        if len(envs) != config.local_world_size:
            raise ValueError(
                f"got {len(envs)} worker environments for local_world_size {config.local_world_size}"
            )
        self.config = config
        self.attempt = attempt
        self.console = console
        self.pids: list[int] = []
        self._workers = [
            _Worker(
                local_rank=i,
                env=dict(env),
                prefix=prefix_fn(i) if prefix_fn else f"[{env.get('RANK', i)}]: ",
            )
            for i, env in enumerate(envs)
        ]
        self._started = False
        self._closed = False  # reaped and killed: pids may belong to others now
        self._stopping: asyncio.Task[list[ExitInfo]] | None = None

    # ------------------------------------------------------------------ start

    async def start(self) -> None:
        """Start every worker; on failure to start one, kill the others and raise."""
        if self._started:
            raise RuntimeError("a WorkerGroup starts once; make a new one for the next attempt")
        self._started = True
        attempt_dir = self.config.attempt_dir(self.attempt)
        if attempt_dir is not None:
            # a previous run of this attempt number must not leave old logs behind
            shutil.rmtree(attempt_dir, ignore_errors=True)
            attempt_dir.mkdir(parents=True, exist_ok=True)
        try:
            for w in self._workers:
                await self._start_one(w, attempt_dir)
        except BaseException:
            self.kill_now()
            await self._reap_started()
            raise

    async def _start_one(self, w: _Worker, attempt_dir: Path | None) -> None:
        to_file, to_console, _ = self.config.streams(w.local_rank)
        rank_dir = None
        if attempt_dir is not None:
            rank_dir = attempt_dir / str(w.local_rank)
            rank_dir.mkdir(parents=True, exist_ok=True)
        error_file = w.env.get("TORCHELASTIC_ERROR_FILE")
        if error_file:
            # a stale file from an earlier run would be read as this run's error
            try:
                os.unlink(error_file)
            except FileNotFoundError:
                pass
            Path(error_file).parent.mkdir(parents=True, exist_ok=True)

        argv = [Template(arg).safe_substitute(local_rank=str(w.local_rank)) for arg in self.config.cmd]
        if _SETPRIV and shutil.which(argv[0], path=w.env.get("PATH")):
            argv = [_SETPRIV, "--pdeathsig", "KILL", "--", *argv]
        console = self.console
        opened: list[object] = []
        plans = []
        for std, name in ((Std.OUT, "stdout"), (Std.ERR, "stderr")):
            path = rank_dir / f"{name}.log" if rank_dir is not None and to_file & std else None
            shown = bool(to_console & std) and console is not None
            if std is Std.ERR and path is not None:
                w.stderr_file = path
            if path is not None and not shown:
                # redirect only: the worker writes its file itself, so its logs
                # survive the agent and cost the agent nothing
                f = open(path, "wb")  # noqa: SIM115 - closed right after the fork
                opened.append(f)
                plans.append((f, None, None))
            elif shown or path is not None or std is Std.ERR:
                # stderr is always read when it has no file: its tail explains failures
                sink = open(path, "wb") if path is not None else None  # noqa: SIM115
                plans.append((asyncio.subprocess.PIPE, sink, console if shown else None))
            else:
                plans.append((asyncio.subprocess.DEVNULL, None, None))
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=plans[0][0],
                stderr=plans[1][0],
                env=w.env,
                start_new_session=True,
            )
        except BaseException:
            for _, sink, _ in plans:
                if sink is not None:
                    sink.close()
            raise
        finally:
            for f in opened:
                f.close()  # type: ignore[attr-defined]
        w.proc = proc
        self.pids.append(proc.pid)
        for stream, (_, sink, out), is_err in (
            (proc.stdout, plans[0], False),
            (proc.stderr, plans[1], True),
        ):
            if stream is not None:
                tail = w.stderr_tail if is_err else None
                w.readers.append(asyncio.create_task(_pump(stream, sink, out, w.prefix, tail)))
        w.monitor = asyncio.create_task(self._monitor(w))
        log.debug("started local rank %d pid %d: %s", w.local_rank, proc.pid, argv)

    async def _reap_started(self) -> None:
        monitors = [w.monitor for w in self._workers if w.monitor is not None]
        if monitors:
            await asyncio.wait(monitors)
        await self._finish_readers()

    # ----------------------------------------------------------------- monitor

    async def _monitor(self, w: _Worker) -> ExitInfo:
        assert w.proc is not None
        returncode = await w.proc.wait()
        timestamp = time.time()
        if w.readers:
            # the tail of stderr is part of the record; a grandchild holding the
            # pipe open must not delay it for long
            await asyncio.wait(w.readers, timeout=_DRAIN_GRACE_S)
        exit_code, sig = _decode_returncode(returncode)
        message, source = self._failure_message(w) if returncode != 0 else ("", "")
        info = ExitInfo(w.local_rank, w.proc.pid, exit_code, sig, message, timestamp, source)
        log.debug("%s", describe(info))
        return info

    def _failure_message(self, w: _Worker) -> tuple[str, str]:
        error_file = w.env.get("TORCHELASTIC_ERROR_FILE")
        if error_file:
            message = read_error_file(error_file)
            if message:
                return message, "error_file"
        lines = [ln for ln in w.stderr_tail if ln.strip()]
        if not lines and w.stderr_file is not None:
            lines = _file_tail_lines(w.stderr_file)
        # the error first: the server's root cause and every summary read the first line
        head = root_cause_line(lines)
        if lines and lines[-1].strip() == head:
            lines = lines[:-1]  # said once, first
        message = _trim_message(head, lines)
        return message, ("stderr" if message else "")

    def _monitors(self) -> list[asyncio.Task[ExitInfo]]:
        if not self._started:
            raise RuntimeError("WorkerGroup.start() has not been called")
        return [w.monitor for w in self._workers if w.monitor is not None]

    # ---------------------------------------------------------------- wait

    async def wait(self) -> list[ExitInfo]:
        """Wait until every worker succeeded, or one failed.

        Returns every record when all exited 0, else the failed records known
        at the moment the first failure was seen (at least one). Cancelling it
        leaves the workers running.
        """
        pending = set(self._monitors())
        while True:
            failed = [t.result() for t in self._monitors() if t.done() and not t.result().ok]
            if failed:
                return sorted(failed, key=lambda i: i.timestamp)
            if not pending:
                return [t.result() for t in self._monitors()]
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)

    # ---------------------------------------------------------------- stop

    async def stop(self, timeout: float = 10.0, sig: int = signal.SIGTERM) -> list[ExitInfo]:
        """Signal every worker's process group, SIGKILL what outlives ``timeout``, reap all.

        Idempotent and safe when the workers already exited; concurrent calls
        share one stop. Returns every worker's record, in local rank order.
        """
        if not self._started:
            return []
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop(timeout, sig))
        return await asyncio.shield(self._stopping)

    async def _stop(self, timeout: float, sig: int) -> list[ExitInfo]:
        monitors = self._monitors()
        for w in self._workers:
            if w.proc is not None:
                _killpg(w.proc.pid, sig)
        if monitors:
            _, pending = await asyncio.wait(monitors, timeout=max(0.0, timeout))
            if pending:
                log.warning(
                    "%d worker(s) still alive %.1fs after %s; sending SIGKILL",
                    len(pending),
                    timeout,
                    signal.Signals(sig).name,
                )
        # every group, exited leaders included: their children may linger
        self.kill_now()
        if monitors:
            await asyncio.wait(monitors)
        self._closed = True
        await self._finish_readers()
        return [m.result() for m in monitors]

    def kill_now(self) -> None:
        """SIGKILL every worker's process group at once, without waiting."""
        if self._closed:
            return
        for w in self._workers:
            if w.proc is not None:
                _killpg(w.proc.pid, signal.SIGKILL)

    async def _finish_readers(self) -> None:
        readers = [r for w in self._workers for r in w.readers]
        if not readers:
            return
        _, pending = await asyncio.wait(readers, timeout=_DRAIN_GRACE_S)
        for r in pending:  # a process outside the group still holds a pipe
            r.cancel()
        if pending:
            await asyncio.wait(pending)
        for w in self._workers:
            # pipes that something outside the group holds open keep the
            # transport alive; close it so nothing leaks
            transport = getattr(w.proc, "_transport", None)
            if transport is not None and pending:
                transport.close()


def _killpg(pgid: int, sig: int) -> None:
    # Linux does not reuse a pid while it names a live process group, so the
    # group of a reaped leader is either its own survivors or gone.
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        log.warning("not allowed to signal process group %d", pgid)


async def _pump(
    stream: asyncio.StreamReader,
    sink: object | None,
    console: TextIO | None,
    prefix: str,
    tail: collections.deque[str] | None,
) -> None:
    """Copy one pipe to its file (bytes as they come) and console (whole lines, prefixed)."""
    pending = b""

    def emit(lines: list[bytes]) -> None:
        text = [ln.decode("utf-8", errors="replace") for ln in lines]
        if tail is not None:
            tail.extend(t.rstrip("\r\n") for t in text[-_STDERR_TAIL_LINES:])
        if console is not None:
            # one write per batch of whole lines: writers never interleave mid-line
            console.write("".join(f"{prefix}{t}" if t.endswith("\n") else f"{prefix}{t}\n" for t in text))
            console.flush()

    try:
        while True:
            chunk = await stream.read(_READ_CHUNK)
            if not chunk:
                break
            if sink is not None:
                sink.write(chunk)  # type: ignore[attr-defined]
                sink.flush()  # type: ignore[attr-defined]
            if console is None and tail is None:
                continue
            data = pending + chunk
            cut = data.rfind(b"\n") + 1
            lines = data[:cut].splitlines(keepends=True) if cut else []
            pending = data[cut:]
            if len(pending) > _MAX_LINE_BYTES:
                lines.append(pending)
                pending = b""
            if lines:
                emit(lines)
    except Exception:
        log.exception("copying worker output failed")
    finally:
        try:
            if pending:
                emit([pending])
        finally:
            if sink is not None:
                sink.close()  # type: ignore[attr-defined]
