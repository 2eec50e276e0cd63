"""The wrong-token throttle (rdzv_server.throttle): counted per address in a
window, blocked at the limit for a window, bounded in addresses."""

from __future__ import annotations

from rdzv_server.throttle import AuthThrottle


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_blocks_at_the_limit_for_a_window_then_forgets():
    c = Clock()
    t = AuthThrottle(limit=3, window_s=60.0, clock=c)
    assert not t.failed("a") and not t.failed("a")
    assert t.blocked("a") == 0.0
    assert t.failed("a")  # the 3rd
    assert t.blocked("a") == 60.0 and t.retry_after("a") == "60"
    assert t.blocked("b") == 0.0  # another address is not affected
    c.t += 59.5
    assert t.blocked("a") == 0.5 and t.retry_after("a") == "1"
    c.t += 0.5
    assert t.blocked("a") == 0.0 and len(t) == 0  # forgotten
    assert not t.failed("a")  # counts from 1 again


def test_failures_spread_over_more_than_a_window_never_block():
    c = Clock()
    t = AuthThrottle(limit=3, window_s=10.0, clock=c)
    for _ in range(10):
        assert not t.failed("a")
        assert not t.failed("a")
        c.t += 10.0  # a new window


def test_the_table_is_bounded_least_recently_failed_first():
    c = Clock()
    t = AuthThrottle(limit=2, window_s=60.0, max_addrs=3, clock=c)
    for addr in ("a", "b", "c"):
        t.failed(addr)
    t.failed("a")  # a is now blocked and the most recent
    t.failed("d")  # evicts b, the least recently failed
    assert len(t) == 3
    assert t.blocked("a") > 0
    assert not t.failed("b")  # b starts over (it was evicted)
