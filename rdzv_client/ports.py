"""The ports a node's joins offer for its rounds' stores, held until the next
offer.

A join names ``master_port`` (this node's store, should it be rank 0) and, for
direct re-formation, ``direct_ports`` for later rounds, possibly hours later.
A port found free by binding port 0 and then closed is free for anyone: in CI
two agents on one host were handed the same port seconds apart, and both
rounds' stores failed with EADDRINUSE (charged worker failures). So each port
offered stays bound here (:class:`PortHold`) until the next offer replaces it:
bound without SO_REUSEADDR (the kernel picks one nobody holds), then
SO_REUSEADDR set, not listening. Then no other bind of port 0 and no
connection's source port is given it, and a plain bind of it is refused; the
worker's TCPStore, which binds with SO_REUSEADDR, binds and listens on it all
the same (Linux: two SO_REUSEADDR sockets, neither listening yet, do not
conflict). Sockets are not inherited by workers (close-on-exec).
"""

from __future__ import annotations

import socket


class PortHold:
    """The ports of this node's latest offer, each held by a bound socket."""

    def __init__(self) -> None:
        self._held: dict[int, socket.socket] = {}

    @property
    def ports(self) -> list[int]:
        return list(self._held)

    def offer(self, addr: str, n: int, keep: int | None = None) -> list[int]:
        """``n`` fresh ports held from now on, none of them ``keep``; every port held
        before is let go but ``keep`` (a resume's master_port, whose store may run)."""
        fresh = _reserve(addr, n, besides=keep)
        for port, s in list(self._held.items()):
            if port != keep:
                s.close()
                del self._held[port]
        self._held.update(fresh)
        return list(fresh)

    def close(self) -> None:
        for s in self._held.values():
            s.close()
        self._held.clear()

    def __del__(self) -> None:  # a session let go (a test's, or at exit) lets its ports go with it
        self.close()


def _reserve(addr: str, n: int, besides: int | None = None) -> dict[int, socket.socket]:
    """``n`` distinct ports free on this node now, each bound by the socket returned."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    out: dict[int, socket.socket] = {}
    spare: list[socket.socket] = []
    try:
        while len(out) < n:
            s = socket.socket(family, socket.SOCK_STREAM)
            try:
                s.bind((addr, 0))
            except OSError:
                try:
                    s.bind(("", 0))
                except OSError:
                    s.close()
                    raise
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (the worker's store binds it so too)
            port: int = s.getsockname()[1]
            if port == besides or port in out:
                spare.append(s)  # held until the end: the kernel does not hand it out again meanwhile
            else:
                out[port] = s
    except BaseException:
        for s in out.values():
            s.close()
        raise
    finally:
        for s in spare:
            s.close()
    return out
