"""What a follower's probe of the leader's advertise URL makes of what it
finds there (rdzv_server/ha.py ``_listening``): a listener is alive, a closed
port is refused (the process is gone), a listener that takes no connection
(its backlog full: a frozen or swamped process) or a URL that does not
parse is unknown, never a death. Real sockets on loopback."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from rdzv_server.ha import _listening


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(0)
    yield s
    s.close()


def port_of(s: socket.socket) -> int:
    return int(s.getsockname()[1])


async def test_a_listener_is_alive(listener: socket.socket) -> None:
    assert await _listening(f"http://127.0.0.1:{port_of(listener)}") is True


async def test_a_closed_port_is_refused() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = port_of(s)
    s.close()  # bound, never listened: nothing listens there
    assert await _listening(f"http://127.0.0.1:{port}") is False


async def test_a_listener_that_takes_no_connection_is_unknown(listener: socket.socket) -> None:
    """Never accepted, its queue full: the kernel drops new SYNs and the connect times out."""
    url = f"http://127.0.0.1:{port_of(listener)}"
    held = []
    for _ in range(8):  # fill the accept queue (backlog 0 still queues one or two)
        c = socket.socket()
        c.setblocking(False)
        try:
            c.connect(("127.0.0.1", port_of(listener)))
        except BlockingIOError:
            pass
        held.append(c)
    try:
        assert await _listening(url) is None
    finally:
        for c in held:
            c.close()


@pytest.mark.parametrize("url", ["http://[::1:29400", "not a url", "http://:80"])
async def test_urls_that_do_not_parse_are_unknown(url: str) -> None:
    assert await _listening(url) is None
