"""The job-secret guessing throttle (rdzv_server.guesses): counted per job id
and per address in fixed windows, bounded tables, a fake clock."""

from __future__ import annotations

from rdzv_server.guesses import GuessThrottle


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_past_the_limit_a_job_id_is_slowed_from_every_address_until_the_window_ends() -> None:
    clock = Clock()
    g = GuessThrottle(limit=3, window_s=60.0, delay_s=2.0, clock=clock)
    for i in range(2):
        g.wrong("job", f"10.0.0.{i}")
    assert g.hold("job", "10.0.0.9") == 0.0  # two wrong: not yet
    g.wrong("job", "10.0.0.2")
    assert g.hold("job", "10.0.0.9") == 2.0 and g.hold("other-job", "10.0.0.9") == 0.0
    clock.now += 60.0  # the window ended: answered at once again
    assert g.hold("job", "10.0.0.9") == 0.0


def test_past_the_limit_an_address_is_slowed_for_every_job() -> None:
    clock = Clock()
    g = GuessThrottle(limit=3, window_s=60.0, delay_s=2.0, clock=clock)
    for i in range(3):
        g.wrong(f"job{i}", "10.6.6.6")
    assert g.hold("job9", "10.6.6.6") == 2.0 and g.hold("job9", "10.0.0.1") == 0.0


def test_the_tables_are_bounded_the_least_recently_failed_go_first() -> None:
    clock = Clock()
    g = GuessThrottle(limit=1, max_keys=100, clock=clock)
    for i in range(1000):
        g.wrong(f"job{i}", f"addr{i}")
    assert len(g.jobs) == 100 and len(g.addrs) == 100
    assert g.slowed("job999", "x") and not g.slowed("job0", "y")
