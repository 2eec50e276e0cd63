"""What an agent keeps on disk of its own: one private directory per agent,
``$TMPDIR/rdzv-$UID/agent-<pid>/`` (the worker channel's socket, torch's
timer pipe, the error files when there is no ``--log-dir``).

An agent holds an ``flock`` on ``agent-<pid>.lock`` next to its directory
for its whole life; the kernel releases it when the process ends, SIGKILL
included. Every agent, when it starts, removes the directories whose lock it
can take: those of agents that are gone. A live agent's lock cannot be taken,
so its directory is never removed; a lock file that a sweeper replaced while
an agent waited for it is detected (another inode) and taken again. What
SIGKILLed agents leave on a node is thus bounded: it lasts until the next
agent starts there. An agent that exits removes its own.

The base directory must be the user's own and private (0700, not a link);
otherwise, or when it cannot be made, the agent falls back to a fresh
``mkdtemp`` directory that it removes at exit and nobody sweeps.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

log = logging.getLogger("rdzv_agent")

PREFIX = "agent-"
MAX_SWEEP = 10_000  # entries looked at per start: a bound, never reached in practice
_LOCK_WAIT_S = 5.0


class AgentDir:
    """This agent's private directory (``path``); :meth:`close` removes it."""

    def __init__(self, path: Path, lock_path: Path | None = None, lock_fd: int | None = None) -> None:
        self.path = path
        self._lock_path = lock_path
        self._lock_fd = lock_fd

    def close(self, keep: tuple[str, ...] = ()) -> None:
        """Remove it, or all but the entries named in ``keep``: then it stays,
        unlocked, until the next agent's sweep (a private mkdtemp one: for good)."""
        if keep:
            for entry in self.path.iterdir():
                if entry.name not in keep:
                    shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # the next agent's sweep removes it
                self._lock_fd = None
            return
        shutil.rmtree(self.path, ignore_errors=True)
        if self._lock_fd is not None:
            assert self._lock_path is not None
            try:
                os.unlink(self._lock_path)  # still locked: no sweeper holds it now
            except FileNotFoundError:
                pass
            os.close(self._lock_fd)
            self._lock_fd = None


def base_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"rdzv-{os.getuid()}"


def open_agent_dir(base: Path | None = None) -> AgentDir:
    """Sweep the directories of dead agents, then make and lock this agent's."""
    base = base or base_dir()
    try:
        _private_base(base)
    except OSError as e:
        log.warning("%s cannot hold agent directories (%s); using a private temporary one", base, e)
        return AgentDir(Path(tempfile.mkdtemp(prefix="rdzv-agent-")))
    removed = sweep(base)
    if removed:
        log.info("removed %d directory(ies) of agents that are gone from %s", len(removed), base)
    name = f"{PREFIX}{os.getpid()}"
    deadline = time.monotonic() + _LOCK_WAIT_S
    fd = _lock(base / f"{name}.lock")
    while fd is None and time.monotonic() < deadline:  # a sweeper holds it for a moment
        time.sleep(0.05)
        fd = _lock(base / f"{name}.lock")
    if fd is None:
        return AgentDir(Path(tempfile.mkdtemp(prefix="rdzv-agent-")))
    path = base / name
    shutil.rmtree(path, ignore_errors=True)  # a gone agent that had our pid left it
    path.mkdir(mode=stat.S_IRWXU)
    return AgentDir(path, base / f"{name}.lock", fd)


def sweep(base: Path) -> list[Path]:
    """Remove the directories (and lock files) of agents that are gone; return what went."""
    names: set[str] = set()
    try:
        with os.scandir(base) as it:
            for i, entry in enumerate(it):
                if i >= MAX_SWEEP:
                    break
                if entry.name.startswith(PREFIX):
                    names.add(entry.name.removesuffix(".lock"))
    except OSError:
        return []
    names.discard(f"{PREFIX}{os.getpid()}")
    removed = []
    for name in sorted(names):
        lock_path = base / f"{name}.lock"
        fd = _lock(lock_path)
        if fd is None:
            continue  # its agent lives
        try:
            shutil.rmtree(base / name, ignore_errors=True)
            os.unlink(lock_path)
            removed.append(base / name)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _lock(path: Path) -> int | None:
    """An fd holding an exclusive lock on ``path`` (created if missing), or None if another process holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return None
            raise
        try:
            same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # a sweeper removed that file meanwhile: lock the one there now


def _private_base(base: Path) -> None:
    """Make ``base`` (0700) or check the existing one is a directory of ours that nobody else can enter."""
    try:
        base.mkdir(mode=stat.S_IRWXU)
    except FileExistsError:
        pass
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(errno.ENOTDIR, "not a directory (a link?)")
    if st.st_uid != os.getuid():
        raise OSError(errno.EPERM, f"owned by uid {st.st_uid}")
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        os.chmod(base, stat.S_IRWXU)
