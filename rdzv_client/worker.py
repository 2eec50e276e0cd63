"""The worker side of the worker channel: what a training script may import.

Standard library only (no aiohttp, no pydantic, no torch): importing it costs
nothing a training script does not already pay, and a script that never
imports it runs exactly as before.

* :func:`progress` - call it once per training step. The agent sees each local
  rank's last step and the time of its last call; with ``--hang-timeout S`` a
  worker that called it once and then goes S seconds without another call is
  hung (design.md "Hangs"). Cheap: one non-blocking datagram on a Unix socket
  (``RDZV_AGENT_SOCKET``), at most every :data:`SEND_EVERY_S`; the latest step
  is kept in memory in between. It never blocks and never raises: with no
  agent (plain ``python script.py``) it does nothing.
* :func:`finished` - the training loop is over: what follows (evaluation,
  saving, interpreter teardown) is not a hang. Called at exit by itself; a
  later :func:`progress` call starts the watch again.
* On import, :mod:`faulthandler` is registered for SIGUSR1 (all threads, to
  stderr): the agent sends SIGUSR1 to dump every worker's Python stack into
  the node's log before it ends a hung round.

The datagram is ASCII: ``"<round> <local_rank> <step>"`` (the step is the
number of calls so far when :func:`progress` was never given one), or
``"<round> <local_rank> end"`` from :func:`finished`.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import signal
import socket
import sys
import time

__all__ = ["progress", "finished", "SEND_EVERY_S"]

# At most this often a call sends; in between it only records the step.
SEND_EVERY_S = 0.05

_path = os.environ.get("RDZV_AGENT_SOCKET") or None
_prefix = (f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')} {os.environ.get('LOCAL_RANK', '0')} ").encode()
_sock: socket.socket | None = None
_last_sent = -1.0e9
_step: int | None = None
_calls = 0


def _register_stack_dump() -> None:
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
    except (AttributeError, ValueError, OSError, RuntimeError):
        pass  # no SIGUSR1 (not POSIX), or no usable stderr: nothing to dump to


_register_stack_dump()


def _open() -> socket.socket | None:
    global _sock, _path
    if _path is None:
        return None
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.setblocking(False)
        s.connect(_path)
    except OSError:
        _path = None  # no agent listening: stay quiet for the rest of this process
        return None
    _sock = s
    return s


def progress(step: int | None = None) -> None:
    """This worker made progress (finished ``step``, or one more step).

    Call it every training step. It never blocks and never raises.
    """
    global _last_sent, _step, _calls
    _calls += 1
    if step is not None:
        _step = step
    now = time.monotonic()
    if now - _last_sent < SEND_EVERY_S:
        return
    s = _sock if _sock is not None else _open()
    if s is None:
        return
    _last_sent = now
    shown = _step if _step is not None else _calls
    try:
        s.send(_prefix + str(shown).encode())
    except OSError:
        pass  # the agent is busy (queue full) or gone: the next call tries again


def finished() -> None:
    """The training loop is over: stop watching this worker for hangs (until
    its next :func:`progress` call). Never blocks, never raises."""
    global _last_sent
    if _calls == 0:
        return  # never watched
    s = _sock if _sock is not None else _open()
    if s is None:
        return
    _last_sent = -1.0e9  # a progress() after this is sent at once
    try:
        s.send(_prefix + b"end")
    except OSError:
        pass


atexit.register(finished)
