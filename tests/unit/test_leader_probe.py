"""What a follower's probe of the leader's advertise URL makes of what it
finds there (rdzv_server/ha_probe.py ``addresses``, ``listening``): a listener is
alive, a closed port is refused (the process is gone), a listener that takes
no connection (its backlog full: a frozen or swamped process) is unknown,
never a death; a URL that does not parse, or whose name cannot be looked up,
has no address (it is never probed). Real sockets on loopback."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from rdzv_server.ha_probe import addresses as _addresses
from rdzv_server.ha_probe import listening as _listening


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
    assert await _listening(("127.0.0.1", port_of(listener))) is True


async def test_a_closed_port_is_refused() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = port_of(s)
    s.close()  # bound, never listened: nothing listens there
    assert await _listening(("127.0.0.1", port)) is False


async def test_a_listener_that_takes_no_connection_is_unknown(listener: socket.socket) -> None:
    """Never accepted, its queue full: the kernel drops new SYNs and the connect times out."""
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
        assert await _listening(("127.0.0.1", port_of(listener))) is None
    finally:
        for c in held:
            c.close()


async def test_a_url_names_its_addresses() -> None:
    assert await _addresses("http://127.0.0.1:29400") == [("127.0.0.1", 29400)]
    assert await _addresses("https://127.0.0.1") == [("127.0.0.1", 443)]
    assert await _addresses("http://[::1]:29400") == [("::1", 29400)]


@pytest.mark.parametrize(
    "url",
    [
        "http://[::1:29400",  # does not parse
        "not a url",
        "http://:80",
        "http://rdzv-0..svc:29400",  # an empty label: UnicodeError from the lookup, not a traceback per poll
        "http://" + "a" * 64 + ".example:29400",  # a label over 63 characters
    ],
)
async def test_urls_without_an_address_have_none(url: str) -> None:
    assert await _addresses(url) == []
