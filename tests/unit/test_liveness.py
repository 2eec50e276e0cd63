"""rdzv_common.liveness on real loopback TCP sockets: the options the server
sets on every accepted socket, and what the kernel says of acknowledgements."""

from __future__ import annotations

import socket
import time

import pytest

from rdzv_common import liveness

pytestmark = pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="Linux TCP options")


def _pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    return client, server


def test_keep_alive_sets_the_user_timeout_and_keepalive() -> None:
    client, server = _pair()
    with client, server:
        assert liveness.keep_alive(server)
        assert server.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert server.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == int(liveness.TCP_USER_TIMEOUT_S * 1000)
        assert server.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == liveness.KEEPALIVE_IDLE_S
        assert server.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == liveness.KEEPALIVE_IDLE_S


def test_keep_alive_through_a_transports_stand_in_sets_the_options_and_leaves_the_socket_open() -> None:
    # what asyncio's (and uvloop's) transports hand out for get_extra_info("socket") is not a
    # socket.socket: keep_alive works on a socket object of its own for the same descriptor
    from asyncio.trsock import TransportSocket

    client, server = _pair()
    with client, server:
        stand_in = TransportSocket(server)
        assert not isinstance(stand_in, socket.socket)
        assert liveness.keep_alive(stand_in)  # type: ignore[arg-type]
        assert server.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert server.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == int(liveness.TCP_USER_TIMEOUT_S * 1000)
        assert server.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == liveness.KEEPALIVE_IDLE_S
        server.sendall(b"still open")  # the descriptor was not closed with the stand-in's socket object
        assert client.recv(10) == b"still open"


def test_keep_alive_on_what_is_not_tcp_is_false_and_harmless() -> None:
    a, b = socket.socketpair()
    with a, b:
        assert not liveness.keep_alive(a)
    assert not liveness.keep_alive(None)
    assert liveness.acked_within(None, 1.0) is None


def test_an_acknowledged_send_is_seen_and_ages() -> None:
    client, server = _pair()
    with client, server:
        server.sendall(b"ping")
        assert client.recv(4) == b"ping"  # the client's kernel acknowledged it by now
        deadline = time.monotonic() + 5
        while not liveness.acked_within(server, 0.5) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert liveness.acked_within(server, 0.5)
        rtt = liveness.rtt_s(server)
        assert rtt is not None and 0 <= rtt < 1.0
        time.sleep(0.3)
        age = liveness.ack_age_s(server)
        assert age is not None and age >= 0.25
        assert not liveness.acked_within(server, 0.1)


def test_has_keep_alive_tells_a_socket_with_them_from_one_without() -> None:
    with socket.socket() as plain, socket.socket() as set_:
        assert not liveness.has_keep_alive(plain)
        assert liveness.keep_alive(set_)
        assert liveness.has_keep_alive(set_)
    assert not liveness.has_keep_alive(None)
