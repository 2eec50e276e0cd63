"""Who sent a datagram on the worker channel (Linux: SO_PASSCRED /
SCM_CREDENTIALS, which the kernel fills in and a sender cannot forge), so
that the agent takes progress and safe-point datagrams only from its own
workers (and their process groups and descendants), and an in-place worker
takes ``stop``/``assign`` only from its agent. A same-user process can write
to both sockets (the directory is the user's own): this is what tells them
apart. Standard library only (the worker side imports it).

Where the kernel has no SO_PASSCRED (not Linux) :func:`enable` returns False
and the sockets work as before, unchecked (docs/security.md)."""

from __future__ import annotations

import socket
import struct

_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_ANC = socket.CMSG_SPACE(_CREDS.size) if hasattr(socket, "CMSG_SPACE") else 0
# how far up a sender's parents are followed to find a worker (a data loader's child, ...)
MAX_DEPTH = 16


def enable(sock: socket.socket) -> bool:
    """Ask the kernel to attach each datagram's sender to it; False where it cannot."""
    opt = getattr(socket, "SO_PASSCRED", None)
    if opt is None or not _ANC:
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, opt, 1)
    except OSError:
        return False
    return True


def recv(sock: socket.socket, size: int) -> tuple[bytes, int | None, int | None]:
    """One datagram and its sender's (pid, uid); (None, None) when the kernel
    said nothing (SO_PASSCRED off). Raises what ``recv`` raises (BlockingIOError)."""
    if not _ANC:
        return sock.recv(size), None, None
    data, anc, _flags, _addr = sock.recvmsg(size, _ANC)
    for level, kind, body in anc:
        if level == socket.SOL_SOCKET and kind == getattr(socket, "SCM_CREDENTIALS", -1) and len(body) >= _CREDS.size:
            pid, uid, _gid = _CREDS.unpack_from(body)
            return data, pid, uid
    return data, None, None


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, process group) of ``pid``, from /proc; None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read(4096)
    except OSError:
        return None
    fields = text[text.rfind(b")") + 2 :].split()  # after "pid (comm) ": state ppid pgrp ...
    try:
        return int(fields[1]), int(fields[2])
    except (IndexError, ValueError):
        return None


def from_workers(pid: int, workers: set[int]) -> bool:
    """Whether ``pid`` is a worker, in a worker's process group (each worker
    leads its own session), or a worker's descendant."""
    if pid in workers:
        return True
    seen = 0
    while pid > 1 and seen < MAX_DEPTH:
        st = _stat(pid)
        if st is None:
            return False
        ppid, pgrp = st
        if pgrp in workers or ppid in workers:
            return True
        pid, seen = ppid, seen + 1
    return False
