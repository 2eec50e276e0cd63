"""rdzv_server.silence.Silence: one timer per connection. A restart to a later
deadline leaves the timer alone (it re-arms itself when it fires); a sooner one
moves it; either way the connection's task is cancelled when the limit passed,
not before."""

from __future__ import annotations

import asyncio

import pytest

from rdzv_server.silence import Silence


async def _expires_after(make, monkeypatch) -> tuple[float, int, int]:
    """Seconds until ``make(silence)``'s connection task is cancelled, the silence's timers
    armed by ``make`` (its first one not counted), and those armed in all."""
    loop = asyncio.get_running_loop()
    armed = 0
    real = loop.call_at

    def counted(when, callback, *args, **kw):
        nonlocal armed
        armed += isinstance(getattr(callback, "__self__", None), Silence)  # (sleeps arm timers too)
        return real(when, callback, *args, **kw)

    monkeypatch.setattr(loop, "call_at", counted)
    began = loop.time()

    by_make = 0

    async def connection() -> float:
        nonlocal by_make
        silence = Silence(0.2)
        first = armed
        make(silence)
        by_make = armed - first
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            assert silence.caught()
        return loop.time() - began

    took = await asyncio.wait_for(connection(), 5)
    return took, by_make, armed


async def test_a_later_deadline_touches_no_timer_until_the_first_fires(monkeypatch) -> None:
    took, by_restart, armed = await _expires_after(lambda s: s.restart(0.5), monkeypatch)
    assert 0.5 <= took < 1.5, took
    assert by_restart == 0  # the first deadline's timer re-arms itself for the later one when it fires
    assert armed == 2


async def test_a_sooner_deadline_moves_the_timer(monkeypatch) -> None:
    took, by_restart, armed = await _expires_after(lambda s: s.restart(0.05), monkeypatch)
    assert 0.05 <= took < 0.19, took  # before the first deadline (0.2 s)
    assert by_restart == 1 and armed == 2


@pytest.mark.parametrize("limit", [0.05, 0.5])
async def test_frames_heard_after_a_restart_keep_the_connection(monkeypatch, limit) -> None:
    """heard() keeps moving the deadline after a restart, sooner or later."""
    loop = asyncio.get_running_loop()

    async def connection() -> float:
        silence = Silence(0.2)
        silence.restart(limit)
        began = loop.time()
        try:
            for _ in range(6):
                await asyncio.sleep(limit / 2)
                silence.heard()
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            assert silence.caught()
        return loop.time() - began

    took = await asyncio.wait_for(connection(), 5)
    assert took >= 3 * limit + limit, took
