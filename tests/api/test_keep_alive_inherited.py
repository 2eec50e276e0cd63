"""Every socket the server accepts has kernel keep-alive and the user timeout
(rdzv_common.liveness: a vanished agent host fails its connection). On Linux
the Listener sets them once, on the listening socket, and the kernel copies
them to each accepted one: no system calls per connection."""

from __future__ import annotations

import asyncio
import socket

import pytest

from rdzv_common import liveness
from rdzv_server import conns

from .test_quotas import listening

pytestmark = pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="Linux TCP options")


async def test_accepted_sockets_inherit_keep_alive_from_the_listening_one(monkeypatch):
    calls, accepted = [], []
    real = conns.keep_alive

    def counted(sock):
        calls.append(sock)
        return real(sock)

    monkeypatch.setattr(conns, "keep_alive", counted)
    made = conns.Protocol.connection_made

    def seen(self, transport):
        accepted.append(transport.get_extra_info("socket"))
        return made(self, transport)

    monkeypatch.setattr(conns.Protocol, "connection_made", seen)
    async with listening() as port:
        assert len(calls) == 1  # the listening socket
        writers = []
        for _ in range(3):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writers.append(writer)
        for _ in range(100):
            if len(accepted) == 3:
                break
            await asyncio.sleep(0.01)
        assert len(accepted) == 3 and len(calls) == 1  # none set per connection
        for sock in accepted:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == liveness.KEEPALIVE_IDLE_S
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == liveness.KEEPALIVE_IDLE_S
            want = int(liveness.TCP_USER_TIMEOUT_S * 1000)
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == want
        for writer in writers:
            writer.close()
