"""NCCL's RAS client port as NCCL answers it (``src/ras/client_support.cc``), on
loopback: the handshake, ``SET FORMAT json`` (refused with ``json_ok=False``,
as an NCCL before the JSON form does), and the status, after which NCCL
closes the connection. ``reply``: the status text, or a function giving it at
each request. Stopped by :meth:`close`."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable


class FakeRas:
    def __init__(
        self, reply: str | Callable[[], str], json_ok: bool = True, hello: bytes = b"SERVER PROTOCOL 2\n"
    ) -> None:
        self.reply, self.json_ok, self.hello = reply, json_ok, hello
        self.seen: list[list[str]] = []  # per connection, the lines the client sent
        self.stop = threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, name="fake-ras", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.05)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(10)
            try:
                self._answer(conn)
            except OSError:
                pass  # the client went away: the next one

    def _answer(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rwb") as f:
            lines: list[str] = []
            self.seen.append(lines)
            while line := f.readline().decode().strip():
                lines.append(line)
                if line.startswith("CLIENT PROTOCOL"):
                    f.write(self.hello)
                elif line == "SET FORMAT json":
                    f.write(b"OK\n" if self.json_ok else b"ERROR: unknown command\n")
                elif line.endswith("STATUS"):
                    f.write((self.reply() if callable(self.reply) else self.reply).encode())
                    break  # NCCL closes the connection after the status
                f.flush()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.sock.close()
