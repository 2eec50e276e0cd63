"""Every socket the server accepts has kernel keep-alive and the user timeout
(rdzv_common.liveness: a vanished agent host fails its connection). On Linux
the Listener sets them once, on the listening socket, and the kernel copies
them to each accepted one: no system calls per connection (the first accepted
socket is checked; where they were not copied, each socket is set)."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from rdzv_common import liveness
from rdzv_server import conns, listener

from .test_quotas import listening

pytestmark = pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="Linux TCP options")


def _watch(monkeypatch) -> tuple[list, list]:
    """(sockets keep_alive was called on, sockets accepted)."""
    calls, accepted = [], []
    real = conns.keep_alive

    def counted(sock):
        calls.append(sock)
        return real(sock)

    monkeypatch.setattr(conns, "keep_alive", counted)  # each accepted socket's
    monkeypatch.setattr(listener, "keep_alive", counted)  # the listening socket's
    made = conns.Protocol.connection_made

    def seen(self, transport):
        accepted.append(transport.get_extra_info("socket"))
        return made(self, transport)

    monkeypatch.setattr(conns.Protocol, "connection_made", seen)
    return calls, accepted


async def _connect(port: int, accepted: list, n: int) -> list:
    writers = []
    for _ in range(n):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writers.append(writer)
    for _ in range(100):
        if len(accepted) == n:
            break
        await asyncio.sleep(0.01)
    assert len(accepted) == n
    return writers


async def test_accepted_sockets_inherit_keep_alive_from_the_listening_one(monkeypatch):
    calls, accepted = _watch(monkeypatch)
    async with listening() as port:
        assert len(calls) == 1  # the listening socket
        writers = await _connect(port, accepted, 3)
        assert len(calls) == 1  # none set per connection
        for sock in accepted:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == liveness.KEEPALIVE_IDLE_S
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == liveness.KEEPALIVE_IDLE_S
            want = int(liveness.TCP_USER_TIMEOUT_S * 1000)
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == want
        for writer in writers:
            writer.close()


async def test_where_the_kernel_does_not_copy_them_each_socket_gets_them(monkeypatch, caplog):
    """The first accepted socket is checked; found without them, every socket is set, that
    one included (as a kernel that does not copy a listener's options would need)."""
    caplog.set_level(logging.INFO, logger="rdzv_server")
    calls, accepted = _watch(monkeypatch)
    checked = []

    def not_copied(sock):
        checked.append(sock)
        return False

    monkeypatch.setattr(conns, "has_keep_alive", not_copied)
    async with listening() as port:
        writers = await _connect(port, accepted, 3)
        assert len(checked) == 1  # the first one only
        assert calls[1:] == accepted  # each accepted socket set, after the listening one
        for writer in writers:
            writer.close()
    assert "do not inherit keep-alive" in caplog.text
