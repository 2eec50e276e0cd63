"""rdzv_client.ports.PortHold: the ports a join offers stay held until the next
offer. While held, a store bound as torch's TCPStore binds (SO_REUSEADDR, then
listen) can still use one, a plain bind of it is refused, and no bind of port 0
is given it; the next offer lets the old ones go (but a resume's own port)."""

from __future__ import annotations

import socket

import pytest

from rdzv_client.ports import PortHold


def _store_listens(port: int) -> bool:
    """Whether a store could listen on ``port`` (as TCPStore binds: every address, SO_REUSEADDR)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
            s.listen()
        except OSError:
            return False
        return True


def plain_bind(port: int) -> bool:
    """Whether a plain bind (no SO_REUSEADDR) of ``port`` succeeds now."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
        return True


@pytest.fixture
def hold():
    h = PortHold()
    yield h
    h.close()


def test_held_ports_are_the_stores_and_nobody_elses(hold: PortHold) -> None:
    ports = hold.offer("127.0.0.1", 5)
    assert len(set(ports)) == 5 and hold.ports == ports
    for port in ports:
        assert _store_listens(port)
        assert not plain_bind(port)
    handed = set()
    for _ in range(2000):  # other binds of port 0 (another agent, a worker's gloo listener)
        with socket.socket() as s:
            s.bind(("", 0))
            handed.add(s.getsockname()[1])
    assert not handed & set(ports)


def test_the_next_offer_lets_the_old_ports_go_but_a_resumes_own(hold: PortHold) -> None:
    first = hold.offer("127.0.0.1", 3)
    second = hold.offer("127.0.0.1", 2, keep=first[0])
    assert first[0] not in second and set(hold.ports) == {first[0], *second}
    assert not plain_bind(first[0])  # kept
    assert all(plain_bind(p) for p in first[1:])  # let go
    hold.close()
    assert hold.ports == [] and all(plain_bind(p) for p in [first[0], *second])
