"""AgentLink.close() ends the link even when its connect swallows the
cancellation (asyncio.wait_for does, before Python 3.12, when the cancel
arrives as the connect finishes: CPython gh-86296; CI hung 120 s on it)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rdzv_client import client, wsclient
from rdzv_client.client import AgentLink

T = 5.0  # deadline on every wait


async def test_close_ends_a_link_whose_connect_swallowed_the_cancel(monkeypatch: pytest.MonkeyPatch) -> None:
    tries = 0
    swallow = True

    async def connect(*args: Any, **kwargs: Any) -> wsclient.WebSocket:
        nonlocal tries
        tries += 1
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if not swallow:
                raise
            # what wait_for does when the refusal came in the same step as the cancel
        raise wsclient.HandshakeError(503, "Service Unavailable")

    monkeypatch.setattr(client.wsclient, "connect", connect)
    link = AgentLink("127.0.0.1:9")
    await link.start()
    while tries < 1:
        await asyncio.sleep(0.01)
    closing = asyncio.ensure_future(link.close())
    done, _ = await asyncio.wait([closing], timeout=T)  # not wait_for: its cancel would be swallowed too
    swallow = False  # let a failed test end
    assert closing in done, f"close() still waiting after {T} s; the link tried {tries} times"
    assert link._task is not None and link._task.done()


class FakeSocket:
    """What a connect that succeeded returns: records what is sent."""

    def __init__(self) -> None:
        self.closed = False
        self.sent: list[str] = []
        self.close_reason = None

    async def send_str(self, text: str) -> None:
        self.sent.append(text)

    async def close(self) -> None:
        self.closed = True

    def __aiter__(self) -> FakeSocket:
        return self

    async def __anext__(self) -> str:
        await asyncio.sleep(3600)
        raise StopAsyncIteration


async def test_a_connect_that_succeeds_as_close_is_called_sends_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cancel is swallowed and the connect returns a socket: the link must
    not say its join on it (the agent is stopping), and close() returns."""
    sockets: list[FakeSocket] = []
    entered = asyncio.Event()

    async def connect(*args: Any, **kwargs: Any) -> FakeSocket:
        entered.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass  # what wait_for does when the connect completed in the same step as the cancel
        sockets.append(FakeSocket())
        return sockets[-1]

    monkeypatch.setattr(client.wsclient, "connect", connect)
    link = AgentLink("127.0.0.1:9")
    link.set_intent({"op": "join", "node_id": "n1"}, send=False)
    await link.start()
    await asyncio.wait_for(entered.wait(), T)
    closing = asyncio.ensure_future(link.close())
    done, _ = await asyncio.wait([closing], timeout=T)
    assert closing in done, "close() still waiting"
    assert sockets and sockets[0].sent == [] and sockets[0].closed, [s.sent for s in sockets]
    assert not link.connected.is_set()


def test_a_join_again_after_restart_on_a_served_connection_keeps_the_service_clock_stopped() -> None:
    """The server answers a join that names the run after `restart` with the round's
    `assigned` (or `status` while it waits), not another `joined`: the --server-timeout
    clock stays stopped for it; a first join (no run yet), or one on a connection not
    served, starts it until the server answers."""
    link = AgentLink("127.0.0.1:9")
    link.connected.set()
    link.service.served()
    link.send_nowait = lambda text: None  # type: ignore[method-assign]
    link.set_intent({"op": "join", "node_id": "n1", "run": 1})
    assert link.service.serving
    link.set_intent({"op": "join", "node_id": "n1"})  # no run: a joined will answer it
    assert not link.service.serving
    link.service.served()
    link.connected.clear()
    link.set_intent({"op": "join", "node_id": "n1", "run": 1})  # not connected: the clock is the link's
    assert link.service.serving
