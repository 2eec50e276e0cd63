"""Raw sockets for hostile-client tests: half-sent HTTP requests, WebSockets
opened by hand (RFC 6455 handshake and client frames), waits for the server
to close a socket, and the resident memory of a process.

Everything talks to 127.0.0.1 only, and every wait has a deadline.
"""

from __future__ import annotations

import base64
import os
import select
import socket
import time
from pathlib import Path


def connect(port: int, rcvbuf: int | None = None, timeout: float = 10.0) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:  # before connect, so the window is small from the start
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(timeout)
    s.connect(("127.0.0.1", port))
    return s


def ws_open(port: int, path: str = "/v1/agent", rcvbuf: int | None = None) -> socket.socket:
    """A WebSocket to the server, by hand: returns the socket after the 101 response."""
    s = connect(port, rcvbuf)
    key = base64.b64encode(os.urandom(16)).decode()
    s.sendall(
        (
            f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(4096)
        if not chunk:
            raise AssertionError(f"the server closed the WebSocket handshake: {head!r}")
        head += chunk
    assert head.startswith(b"HTTP/1.1 101"), head[:200]
    return s


def ws_frame(payload: bytes | str, opcode: int = 0x1) -> bytes:
    """One client frame (FIN, masked with a zero key, so the payload goes as is)."""
    data = payload.encode() if isinstance(payload, str) else payload
    n = len(data)
    if n < 126:
        length = bytes([0x80 | n])
    elif n < 1 << 16:
        length = bytes([0x80 | 126]) + n.to_bytes(2, "big")
    else:
        length = bytes([0x80 | 127]) + n.to_bytes(8, "big")
    return bytes([0x80 | opcode]) + length + b"\0\0\0\0" + data


def is_closed(s: socket.socket) -> bool:
    """True once the peer closed (EOF or reset); reads and drops whatever it sent before."""
    while True:
        r, _, _ = select.select([s], [], [], 0)
        if not r:
            return False
        try:
            chunk = s.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            return True
        except (BlockingIOError, InterruptedError):
            return False
        if not chunk:
            return True


def wait_closed(socks: list[socket.socket], timeout: float, what: str) -> None:
    """Wait until the server closed every socket of ``socks``; fail after ``timeout`` s saying how many stayed open."""
    open_ = list(socks)
    deadline = time.monotonic() + timeout
    while open_:
        open_ = [s for s in open_ if not is_closed(s)]
        if not open_:
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"{len(open_)} of {len(socks)} {what} still open after {timeout:g}s")
        select.select(open_[:500], [], [], min(0.2, left))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def listening(port: int) -> set[str]:
    """The local addresses (hex, as in /proc/net/tcp) with a socket listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            addr, hexport = fields[1].rsplit(":", 1)
            if int(hexport, 16) == port and fields[3] == "0A":  # TCP_LISTEN
                found.add(addr)
    return found
