"""Spawning, supervising and stopping one node's worker processes.

One :class:`WorkerGroup` is one attempt (one round) of one node: it starts
``local_world_size`` workers, copies their output to the console and to log
files the way torchrun does, tells the agent when the attempt is over
(:meth:`WorkerGroup.wait`), and stops it (:meth:`WorkerGroup.stop`).

Each worker runs in its own session, so it leads its own process group, and
every signal goes to the whole group: grandchildren (data loader workers,
``subprocess`` calls) get it too. A worker's end is a value, :class:`ExitInfo`,
never an exception.

Log layout, as torchrun's (the agent's ``log_dir`` is torchrun's run
directory, ``--log-dir``/``<job id>_<random>``)::

    {log_dir}/attempt_{attempt}/{local_rank}/stdout.log
                                            /stderr.log
                                            /error.json   (TORCHELASTIC_ERROR_FILE)

Output: with ``LaunchConfig.share_console`` and nothing redirected, tee'd or
filtered, workers' output reaches the agent's stdout and stderr unchanged, as
under torchrun. Where those are one file (a terminal, ``> log 2>&1``) both of
a worker's streams go through one channel, in order; elsewhere stdout is the
agent's own and stderr is copied. A channel that ends on a terminal is a
pseudo-terminal (``isatty()`` is True, progress bars draw as usual, the window
size is the agent's at start); the copy keeps the tail that explains a
failure. Otherwise output goes through the agent line by line, each line
prefixed with ``[RANK]: `` (or ``prefix_fn``).

This module must stay importable without torch: the agent never imports it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from string import Template
from typing import BinaryIO, TextIO

from .exits import (  # noqa: F401 - part of this module's interface
    _STDERR_TAIL_LINES,
    MAX_MESSAGE_CHARS,
    ExitInfo,
    _decode_returncode,
    _file_tail_lines,
    _trim_message,
    describe,
    read_error_file,
    root_cause_line,
)
from .launch import (  # noqa: F401 - part of this module's interface
    WITHHELD_FROM_WORKERS,
    LaunchConfig,
    Std,
    error_file_path,
    parse_std,
    worker_env,
)
from .output import open_pty_like, pass_through, pump, same_file

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

# Workers die with their agent: an agent that is SIGKILLed (OOM killer, kill -9)
# must not leave workers running as a stale rank. util-linux's setpriv sets the
# parent-death signal and execs the worker (no preexec_fn: unsafe with threads).
_SETPRIV = shutil.which("setpriv") if sys.platform.startswith("linux") else None
# After a worker exits, how long its pipes may stay open (held by a surviving
# grandchild) before its exit record is made without the rest of its output.
_DRAIN_GRACE_S = 1.0


# --------------------------------------------------------------------- workers


@dataclass
class _Worker:
    local_rank: int
    env: dict[str, str]
    prefix: str
    proc: asyncio.subprocess.Process | None = None
    readers: list[asyncio.Task[None]] = field(default_factory=list)
    monitor: asyncio.Task[ExitInfo] | None = None
    stderr_tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=_STDERR_TAIL_LINES))
    stderr_file: Path | None = None
    transports: list[asyncio.BaseTransport] = field(default_factory=list)  # pseudo-terminal readers


class WorkerGroup:
    """One attempt of one node's workers.

    ``envs[i]`` is the whole environment of local rank ``i`` (see
    :func:`worker_env`). ``console`` receives every shown line prefixed with
    ``prefix_fn(local_rank)`` (default ``"[{RANK}]: "``); None shows nothing.
    When the config shares the console, output goes unchanged to ``console``
    (``sys.stdout`` if None) and ``stderr`` (default ``sys.stderr``), as the
    module docstring says.
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
        stderr: TextIO | None = None,
    ) -> None:
        if len(envs) != config.local_world_size:
            raise ValueError(f"got {len(envs)} worker environments for local_world_size {config.local_world_size}")
        self.config = config
        self.attempt = attempt
        self.console = console
        self.stderr = stderr if stderr is not None else sys.stderr
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
        opened: list[BinaryIO] = []
        # per stream: what the child gets (a file, PIPE, DEVNULL, None: the agent's own), the
        # file a pipe is copied to, the console
        plans: list[tuple[BinaryIO | int | None, BinaryIO | None, TextIO | None]] = []
        shared = self.config.shares_console()
        # torchrun's default, with stderr's tail kept (it explains a failure): where the
        # agent's stdout and stderr are one file (a terminal, `> log 2>&1`), both of a
        # worker's streams go through one channel, in order, to the agent's stdout;
        # elsewhere stdout is the agent's own and stderr is copied. A channel is a
        # pseudo-terminal when it ends on a terminal, else a pipe.
        out = console if console is not None else sys.stdout
        merged = shared and same_file(out, self.stderr)
        copy_to = out if merged else self.stderr
        pty = open_pty_like(copy_to) if shared else None
        if shared:
            channel: int = pty[1] if pty else asyncio.subprocess.PIPE
            plans = [
                (channel if merged else None, None, None),
                (asyncio.subprocess.STDOUT if merged and not pty else channel, None, None),
            ]
        for std, name in () if shared else ((Std.OUT, "stdout"), (Std.ERR, "stderr")):
            path = rank_dir / f"{name}.log" if rank_dir is not None and to_file & std else None
            shown = bool(to_console & std) and console is not None
            if std is Std.ERR and path is not None:
                w.stderr_file = path
            if path is not None and not shown:
                # redirect only: the worker writes its file itself, so its logs
                # survive the agent and cost the agent nothing
                f: BinaryIO = open(path, "wb")  # noqa: SIM115, ASYNC230 - closed right after the fork; a local open is quick
                opened.append(f)
                plans.append((f, None, None))
            elif shown or path is not None or std is Std.ERR:
                # stderr is always read when it has no file: its tail explains failures
                sink: BinaryIO | None = open(path, "wb") if path is not None else None  # noqa: SIM115, ASYNC230
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
            if pty is not None:
                os.close(pty[0])
            raise
        finally:
            for f in opened:
                f.close()
            if pty is not None:
                os.close(pty[1])  # the worker holds its end
        w.proc = proc
        self.pids.append(proc.pid)
        if shared:
            err_stream = proc.stdout if merged else proc.stderr
            if pty is not None:
                err_stream = asyncio.StreamReader()
                protocol = asyncio.StreamReaderProtocol(err_stream)
                master = os.fdopen(pty[0], "rb", buffering=0)  # the transport closes it
                transport, _ = await asyncio.get_running_loop().connect_read_pipe(lambda: protocol, master)
                w.transports.append(transport)
            assert err_stream is not None
            w.readers.append(asyncio.create_task(pass_through(err_stream, copy_to, w.stderr_tail)))
            w.monitor = asyncio.create_task(self._monitor(w))
            log.debug("started local rank %d pid %d: %s", w.local_rank, proc.pid, argv)
            return
        for stream, (_, sink, out), is_err in (
            (proc.stdout, plans[0], False),
            (proc.stderr, plans[1], True),
        ):
            if stream is not None:
                tail = w.stderr_tail if is_err else None
                w.readers.append(asyncio.create_task(pump(stream, sink, out, w.prefix, tail)))
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
        info = ExitInfo(
            w.local_rank,
            w.proc.pid,
            exit_code,
            sig,
            message,
            timestamp,
            source,
            w.env.get("TORCHELASTIC_ERROR_FILE", ""),
            tuple(self._stderr_lines(w)) if returncode != 0 else (),
        )
        log.debug("%s", describe(info))
        return info

    def _failure_message(self, w: _Worker) -> tuple[str, str]:
        error_file = w.env.get("TORCHELASTIC_ERROR_FILE")
        if error_file:
            message = read_error_file(error_file)
            if message:
                return message, "error_file"
        lines = self._stderr_lines(w)
        # the error first: the server's root cause and every summary read the first line
        head = root_cause_line(lines)
        if lines and lines[-1].strip() == head:
            lines = lines[:-1]  # said once, first
        message = _trim_message(head, lines)
        return message, ("stderr" if message else "")

    @staticmethod
    def _stderr_lines(w: _Worker) -> list[str]:
        """Its last non-blank stderr lines: the copy's tail, else its log file's."""
        lines = [ln for ln in w.stderr_tail if ln.strip()]
        if not lines and w.stderr_file is not None:
            lines = _file_tail_lines(w.stderr_file)
        return lines

    def running(self, local_rank: int) -> bool:
        """Whether that worker was started and has not exited yet."""
        w = self._workers[local_rank]
        return w.proc is not None and w.proc.returncode is None

    def returncode(self, local_rank: int) -> int | None:
        """That worker's exit status (negative: the signal), None while it runs."""
        w = self._workers[local_rank]
        return None if w.proc is None else w.proc.returncode

    async def reaped(self, local_rank: int, wait_s: float) -> int | None:
        """That worker's exit status once its exit is reaped (a moment after it
        closed its pipes and channel), None if it still runs after ``wait_s``."""
        w = self._workers[local_rank]
        if w.proc is None:
            return None
        try:
            return await asyncio.wait_for(w.proc.wait(), wait_s)
        except asyncio.TimeoutError:
            return None

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
            for t in w.transports:
                t.close()


def _killpg(pgid: int, sig: int) -> None:
    # Linux does not reuse a pid while it names a live process group, so the
    # group of a reaped leader is either its own survivors or gone.
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        log.warning("not allowed to signal process group %d", pgid)
