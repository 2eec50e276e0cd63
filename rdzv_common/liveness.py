"""TCP-level liveness of a peer *host*, both ends of the agent channel
(standard library only: the agent imports it too).

A host that vanishes (power, kernel panic, a pulled cable, a dead switch
port) sends no FIN and no RST: a connection to it stays open until something
is sent and left unacknowledged. Its kernel, though, acknowledges while it
lives, even when the process is frozen (SIGSTOP, a long GC pause). Two uses:

* :func:`keep_alive` on every socket the server accepts, as the agent already
  does on its own (``rdzv_client.client``): kernel keep-alive probes after
  ``KEEPALIVE_IDLE_S`` of silence, and the connection fails once nothing was
  acknowledged or received for ``TCP_USER_TIMEOUT_S``. Probes are answered by
  the peer's kernel: no user-space cost, no false alarm for a frozen process.
* :func:`acked_within` after a probe (a WebSocket ping) of a suspect
  (:mod:`rdzv_server.suspicion`): did its kernel acknowledge anything since?
  ``tcp_info`` also gives the smoothed RTT (:func:`rtt_s`) that sizes the
  probe's deadline.
"""

from __future__ import annotations

import socket
import struct

# After this long with data sent and unacknowledged (or, with keep-alive, with
# nothing heard at all), the kernel fails the connection (TCP_USER_TIMEOUT,
# Linux). The agent's link: a server whose host died is noticed within a
# heartbeat interval plus this, well inside a new HA leader's grace (the ping
# alone took 22 s). The server's sockets: an agent whose host vanished is a
# lost connection this long after it was last heard, before the heartbeat
# timeout (6 s by default). A frozen process on a live host still gets its
# data acknowledged by its kernel: that one is left to the heartbeats.
TCP_USER_TIMEOUT_S = 4.0
# The server's keep-alive: the first probe after this much silence, then one per
# this (whole seconds: the kernel's unit).
KEEPALIVE_IDLE_S = 1

# struct tcp_info (linux/tcp.h): 8 one-byte fields, then 32-bit ones: rto, ato,
# snd_mss, rcv_mss, unacked, sacked, lost, retrans, fackets, last_data_sent,
# last_ack_sent, last_data_recv, last_ack_recv, pmtu, rcv_ssthresh, rtt (us), ...
_TCP_INFO = struct.Struct("8B16I")
_LAST_ACK_RECV, _RTT = 12, 15
# the kernel keeps that time in jiffies (1-10 ms): an acknowledgement that came
# microseconds after a probe can read as a little older than the probe
CLOCK_SLACK_S = 0.02


def keep_alive(sock: socket.socket | None) -> bool:
    """Kernel keep-alive and the user timeout on an accepted TCP socket; False
    where the options do not exist (not Linux, not TCP)."""
    user_timeout = getattr(socket, "TCP_USER_TIMEOUT", None)
    idle = getattr(socket, "TCP_KEEPIDLE", None)
    interval = getattr(socket, "TCP_KEEPINTVL", None)
    if sock is None or user_timeout is None or idle is None or interval is None:
        return False
    # uvloop's transports give a stand-in (PseudoSocket) that builds a socket object for each
    # call: one here for the four options (its descriptor is not ours to close: detached)
    own = sock if isinstance(sock, socket.socket) else None
    try:
        real = own or socket.socket(sock.family, sock.type, sock.proto, sock.fileno())
    except OSError:
        return False
    try:
        real.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        real.setsockopt(socket.IPPROTO_TCP, idle, KEEPALIVE_IDLE_S)
        real.setsockopt(socket.IPPROTO_TCP, interval, KEEPALIVE_IDLE_S)
        real.setsockopt(socket.IPPROTO_TCP, user_timeout, int(TCP_USER_TIMEOUT_S * 1000))
    except OSError:  # not a TCP socket (a Unix socket, a test's pipe)
        return False
    finally:
        if own is None:
            real.detach()
    return True


def has_keep_alive(sock: socket.socket | None) -> bool:
    """Whether ``sock`` has what :func:`keep_alive` sets (on a socket accepted from a
    listening one that has them: whether the kernel copied them, as Linux does)."""
    user_timeout = getattr(socket, "TCP_USER_TIMEOUT", None)
    if sock is None or user_timeout is None:
        return False
    try:
        return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)) and sock.getsockopt(
            socket.IPPROTO_TCP, user_timeout
        ) == int(TCP_USER_TIMEOUT_S * 1000)
    except OSError:
        return False


def _info(sock: socket.socket | None) -> tuple[int, ...] | None:
    option = getattr(socket, "TCP_INFO", None)
    if sock is None or option is None:
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, option, _TCP_INFO.size)
    except OSError:
        return None
    if len(raw) < _TCP_INFO.size:
        return None
    return _TCP_INFO.unpack(raw)[8:]


def ack_age_s(sock: socket.socket | None) -> float | None:
    """Seconds since the peer's kernel last acknowledged anything (its last
    segment), or None where the kernel does not say (not Linux, not TCP, closed)."""
    info = _info(sock)
    return None if info is None else info[_LAST_ACK_RECV] / 1000.0


def rtt_s(sock: socket.socket | None) -> float | None:
    """The kernel's smoothed round-trip time to the peer, or None."""
    info = _info(sock)
    return None if info is None else info[_RTT] / 1e6


def acked_within(sock: socket.socket | None, seconds: float) -> bool | None:
    """Did the peer's kernel acknowledge anything in the last ``seconds``
    (give or take the kernel clock's ``CLOCK_SLACK_S``)? None: the kernel does
    not say (so nobody may be judged on it)."""
    age = ack_age_s(sock)
    return None if age is None else age <= seconds + CLOCK_SLACK_S
