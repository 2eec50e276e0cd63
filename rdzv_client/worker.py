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

* :func:`compute` / :func:`collective_wait` - what this rank's time goes to
  (:mod:`rdzv_client.steptime`): ``with worker.compute():`` around a step's
  compute, ``worker.collective_wait(seconds)`` after a collective the loop
  timed itself. The library's group (:mod:`rdzv_client.inplace`) times its
  own waits; neither is needed with it.

The datagram is ASCII: ``"<round> <local_rank> <step>"`` (the step is the
number of calls so far when :func:`progress` was never given one), followed
by ``" <compute_us> <wait_us>"`` (this process's totals) once anything was
timed, or ``"<round> <local_rank> end"`` from :func:`finished`.

In-place re-formation (``--restart-mode in-place``; design.md "In-place
re-formation"): the agent keeps a survivor's workers on a round change.

* :func:`rounds` - ``for world in rounds(): ...`` yields a :class:`World` once
  per round this process takes part in, the first included; between two,
  it tells the agent this worker reached its safe point and waits for the next
  round's assignment, with ``os.environ`` updated (``RANK``, ``WORLD_SIZE``,
  ``MASTER_ADDR``, ``MASTER_PORT``, ...). Outside in-place mode it yields once.
* :func:`done` - the training is over: ``rounds()`` yields no more.
* :class:`MembershipChanged` - raised by :func:`progress` (and by the
  collectives of :mod:`rdzv_client.inplace`) when the agent says the round is
  over: leave the step, go back to the top of the ``for world in rounds()``.

The agent's messages come on a datagram socket the worker binds next to the
agent's (``<dir of RDZV_AGENT_SOCKET>/w<local_rank>``): ``"stop <round>"`` and
``"assign <round> NAME=VALUE ..."``; the worker answers
``"<round> <local_rank> parked"`` when it reaches its safe point (unasked, that
says a collective failed: the agent reports it so the round re-forms). A
daemon thread (started by :func:`rounds`) reads them the moment they arrive
and calls what :func:`on_round_over` registered: :mod:`rdzv_client.inplace`
fails its pending collectives there, while the training thread is blocked in
them.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from . import channel_grammar as grammar  # standard library only too, as are these:
from . import peercred, steptime, where
from .steptime import collective_wait, compute

__all__ = [
    "progress",
    "waiting",
    "compute",
    "collective_wait",
    "finished",
    "SEND_EVERY_S",
    "rounds",
    "World",
    "MembershipChanged",
    "in_place",
    "on_round_over",
    "before_park",
    "round_over",
    "done",
]

# At most this often a call sends; in between it only records the step.
SEND_EVERY_S = 0.05

_path = os.environ.get("RDZV_AGENT_SOCKET") or None
# the real local rank: the agent's RDZV_LOCAL_RANK (LOCAL_RANK is 0 for all with --virtual-local-rank)
_local_rank = os.environ.get("RDZV_LOCAL_RANK") or os.environ.get("LOCAL_RANK", "0")
_prefix = (f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')} {_local_rank} ").encode()
_sock: socket.socket | None = None
_last_sent = -1.0e9
_step: int | None = None
_calls = 0

# in-place re-formation: the agent's messages to this worker
IN_PLACE = os.environ.get("RDZV_RESTART_MODE") == "in-place"
MAX_MESSAGE = 4096
# what an assignment may set in os.environ (the rest of the environment stays)
ASSIGNED_VARS = frozenset(grammar.ASSIGNED_VARS)
_inbox: socket.socket | None = None
_inbox_checked = False  # the kernel tells each message's sender (SO_PASSCRED, Linux)
_agent_pid = os.environ.get("RDZV_AGENT_PID", "")  # the only sender stop/assign are taken from
_forged = 0  # messages from another process, ignored
_forged_said = -1.0e9  # when the last one was said (on stderr, at most every 30 s)
_stopped: int | None = None  # the round the agent said is next ("stop"), not yet assigned
_assigned: tuple[int, dict[str, str]] | None = None  # an assignment read early
# every read of the inbox and every use of _stopped/_assigned holds it: the
# listener thread and the training thread both read, in the order sent
_lock = threading.Condition()
_round_over: list[Callable[[str], None]] = []  # on_round_over's callbacks
_before_park: list[Callable[[], None]] = []  # before_park's callbacks
_listener: threading.Thread | None = None


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

    Call it every training step. It never blocks; it raises only
    :class:`MembershipChanged`, in in-place mode, when the agent said the
    round is over.
    """
    global _last_sent, _step, _calls
    _calls += 1
    if _inbox is not None:
        check()
    if step is not None:
        _step = step
    now = time.monotonic()
    if now - _last_sent < SEND_EVERY_S:
        return
    s = _sock if _sock is not None else _open()
    if s is None:
        return
    _last_sent = now
    try:
        s.send(_prefix + _shown())
    except OSError:
        pass  # the agent is busy (queue full) or gone: the next call tries again


def _shown() -> bytes:
    """The datagram's step, and the timing totals once anything was timed."""
    step = str(_step if _step is not None else _calls)
    t = steptime.totals_us()
    return (step if t is None else f"{step} {t[0]} {t[1]}").encode()


def waiting() -> None:
    """This worker is blocked in a collective of :mod:`rdzv_client.inplace`,
    waiting for its peers (in-place mode): said to the agent as a
    :func:`progress` call with the same step, so a rank that waits on a frozen
    peer is not hung itself (the frozen one is, on its own node, and the
    agent's stop then ends this wait). Never blocks, never raises."""
    global _last_sent
    now = time.monotonic()
    if _calls == 0 or not in_place() or now - _last_sent < SEND_EVERY_S:
        return
    s = _sock if _sock is not None else _open()
    if s is None:
        return
    _last_sent = now
    try:
        s.send(_prefix + _shown())
    except OSError:
        pass


def finished() -> None:
    """The training loop is over: stop watching this worker for hangs (until
    its next :func:`progress` call). Never blocks, never raises."""
    global _last_sent
    steptime.new_window()
    if _calls == 0:
        return  # never watched
    s = _sock if _sock is not None else _open()
    if s is None:
        return
    _last_sent = -1.0e9  # a progress() after this is sent at once
    try:
        s.send(_prefix + grammar.END)
    except OSError:
        pass


atexit.register(finished)


# ------------------------------------------------------ in-place re-formation


class MembershipChanged(Exception):
    """The round this worker runs is over (a node was lost, joined, failed):
    leave the training step and take the next round from :func:`rounds`."""


@dataclass(frozen=True)
class World:
    """One round as this worker sees it (its ``os.environ`` says the same)."""

    round: int  # TORCHELASTIC_RESTART_COUNT: the same on every node
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    group_rank: int
    group_world_size: int
    master_addr: str
    master_port: int
    fresh: bool  # this process started in this round (it has no state of its own yet)

    @property
    def store_prefix(self) -> str:
        """A key prefix no earlier round used (the store is new each round too)."""
        return f"rdzv/round{self.round}/"


def in_place() -> bool:
    """Whether the agent keeps this worker across round changes."""
    return IN_PLACE and _path is not None


def _world(fresh: bool) -> World:
    e = os.environ

    def num(name: str, default: str = "0") -> int:
        return int(e.get(name, default))

    return World(
        round=num("TORCHELASTIC_RESTART_COUNT"),
        rank=num("RANK"),
        world_size=num("WORLD_SIZE", "1"),
        local_rank=num("LOCAL_RANK"),
        local_world_size=num("LOCAL_WORLD_SIZE", "1"),
        group_rank=num("GROUP_RANK"),
        group_world_size=num("GROUP_WORLD_SIZE", "1"),
        master_addr=e.get("MASTER_ADDR", "127.0.0.1"),
        master_port=num("MASTER_PORT", "29500"),
        fresh=fresh,
    )


def _bind_inbox() -> None:
    global _inbox
    if _inbox is not None or not in_place() or _path is None:
        return
    path = grammar.worker_socket(os.path.dirname(_path), _local_rank)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        os.unlink(path)  # a killed predecessor of this local rank left it
    except FileNotFoundError:
        pass
    global _inbox_checked
    _inbox_checked = peercred.enable(s)  # before bind: no message arrives unlabelled
    s.bind(path)
    os.chmod(path, 0o600)
    s.setblocking(False)
    _inbox = s
    global _listener
    _listener = threading.Thread(target=_listen, args=(s,), name="rdzv-worker-channel", daemon=True)
    _listener.start()


def _from_agent(pid: int | None) -> bool:
    """Whether a message came from this worker's agent (RDZV_AGENT_PID, else
    the parent process). Another process of the same user can write to the
    inbox: what it sends (an ``assign`` naming its own MASTER_ADDR) is ignored
    and said on stderr at most every 30 s."""
    global _forged, _forged_said
    if not _inbox_checked:
        return True  # no SO_PASSCRED here (not Linux): unchecked, as documented
    expected = int(_agent_pid) if _agent_pid.isdigit() else os.getppid()
    if pid == expected:
        return True
    _forged += 1
    now = time.monotonic()
    if now - _forged_said >= 30.0:
        _forged_said = now
        print(
            f"rdzv: ignored {_forged} message(s) on the in-place channel from pid {pid}, not this worker's agent",
            file=sys.stderr,
            flush=True,
        )
        _forged = 0
    return False


def on_round_over(callback: Callable[[str], None]) -> None:
    """Call ``callback(reason)`` the moment the agent says this round is over
    (from the channel's thread, or from whichever thread read the word first).
    It must not block and must not raise."""
    with _lock:
        _round_over.append(callback)


def before_park(callback: Callable[[], None]) -> None:
    """Call ``callback()`` in the training thread before it tells the agent it
    reached its safe point (:mod:`rdzv_client.inplace_nccl` waits there for its
    communicators' abort). It may block, within a deadline of its own."""
    with _lock:
        _before_park.append(callback)


def _listen(inbox: socket.socket) -> None:
    """The channel's thread: wake on each datagram and take it (under the lock,
    like :func:`check`), so a stop fails pending collectives at once."""
    while True:
        try:
            select.select([inbox], [], [], 1.0)
        except (OSError, ValueError):
            return  # closed
        _drain()


def _drain() -> None:
    """Take every waiting message; run the round-over callbacks if one said stop."""
    with _lock:
        before = _stopped
        while _read():
            pass
        news = _stopped is not None and _stopped != before
        callbacks = list(_round_over) if news else []
        _lock.notify_all()
    reason = f"round {_stopped} replaces round {os.environ.get('TORCHELASTIC_RESTART_COUNT')}"
    for cb in callbacks:
        try:
            cb(reason)
        except Exception as e:  # a callback must not kill the channel
            sys.stderr.write(f"rdzv: round-over callback failed: {e!r}\n")


def _read() -> bool:
    """Take one waiting message from the agent (never waits; the caller holds
    :data:`_lock`); True if one came."""
    global _stopped, _assigned
    if _inbox is None:
        return False
    try:
        data, pid, _uid = peercred.recv(_inbox, MAX_MESSAGE)
    except (BlockingIOError, TimeoutError, InterruptedError, OSError):
        return False
    if not _from_agent(pid):
        return True  # not the agent's: ignored
    order = grammar.parse_order(data)
    if order is None:
        return True  # not the agent's: ignored
    kind, round_no, env = order
    if round_no <= int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")):
        return True  # about a round that is over
    if kind == grammar.ASK_WHERE:  # the agent escalates: say which call the main thread is in
        _send(grammar.WHERE + b" " + where.frames().encode())
    elif kind == grammar.STOP:
        _stopped = max(_stopped or 0, round_no)
    elif kind == grammar.ASSIGN and set(env) <= ASSIGNED_VARS and (_assigned is None or _assigned[0] < round_no):
        _assigned = (round_no, env)
        _stopped = max(_stopped or 0, round_no)
    return True


def _send(body: bytes) -> None:
    s = _sock if _sock is not None else _open()
    if s is not None:
        try:
            s.send(_prefix + body)
        except OSError:
            pass


def check() -> None:
    """Raise :class:`MembershipChanged` if the agent said the round is over.
    Cheap (one non-blocking receive); a no-op outside in-place mode."""
    if _inbox is None:
        return
    _drain()  # a word sent before this call is seen, whether or not the thread woke yet
    stopped = _stopped
    if stopped is not None:
        raise MembershipChanged(f"round {stopped} replaces round {os.environ.get('TORCHELASTIC_RESTART_COUNT')}")


def round_over() -> bool:
    """Whether the agent said the current round is over (no receive, no raise)."""
    return _stopped is not None


def _park() -> None:
    """Tell the agent this worker is at its safe point, wait for the next
    round's assignment, and take it into ``os.environ``."""
    global _prefix, _stopped, _assigned, _last_sent
    steptime.new_window()  # parked: not compute
    for callback in list(_before_park):
        callback()
    s = _sock if _sock is not None else _open()
    if s is not None:
        try:
            s.send(_prefix + grammar.PARKED)
        except OSError:
            pass
    parent = os.getppid()
    with _lock:
        while _assigned is None:
            while _read():
                pass
            if _assigned is None:
                _lock.wait(0.5)  # the channel's thread notifies
            if os.getppid() != parent:
                raise SystemExit("rdzv: the agent is gone")
        round_no, env = _assigned
        os.environ.update(env)
        os.environ["TORCHELASTIC_RESTART_COUNT"] = str(round_no)
        _assigned = None
        if _stopped is not None and _stopped <= round_no:
            _stopped = None  # else a later round was announced already: the next check() raises
    _prefix = grammar.prefix(round_no, _local_rank)
    _last_sent = -1.0e9  # the new round's first progress() is sent at once


def rounds() -> Iterator[World]:
    """Yield this worker's world once per round, the first included.

    The loop body trains and ``break``s when done (or calls :func:`done`); on
    :class:`MembershipChanged` it goes on to the next iteration, which returns
    once the agent assigned this worker its place in the next round
    (``os.environ`` updated). Outside in-place mode (or with no agent) it
    yields once.
    """
    global _done
    _done = False
    _bind_inbox()
    yield _world(fresh=True)
    while in_place() and not _done:
        _park()
        yield _world(fresh=False)


_done = False


def done() -> None:
    """The training is over: :func:`rounds` yields no more (``break`` does the same)."""
    global _done
    _done = True
