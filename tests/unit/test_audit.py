"""The audit log's rate limiter, on a clock the test moves."""

from __future__ import annotations

import logging

from rdzv_server.audit import Audit

LOGGER = "rdzv_test.audit"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_at_most_n_lines_per_window_per_kind_then_one_suppressed_line(caplog):
    """Within one window each kind logs its first N events; the rest are counted
    and said in one "suppressed" line when the window is over."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock = Clock()
    audit = Audit(logging.getLogger(LOGGER), per_window=3, window_s=10.0, clock=clock)
    for i in range(10):
        audit.event("token", f"token rejected #{i}")
    audit.event("join", "join refused #0")  # another kind has its own budget
    assert lines(caplog) == ["token rejected #0", "token rejected #1", "token rejected #2", "join refused #0"]
    clock.t += 5.0
    audit.flush()  # the window is not over yet
    assert len(lines(caplog)) == 4
    clock.t += 5.0
    audit.flush()
    assert lines(caplog)[4:] == ["suppressed 7 similar 'token' line(s) in the last 10 s"]
    audit.flush()  # said once
    audit.event("token", "token rejected #10")  # a new window: logged again
    assert lines(caplog)[5:] == ["token rejected #10"]


def test_a_new_event_after_a_quiet_window_reports_the_suppressed_count_first(caplog):
    """Without a flush, the first event of the next window says what the last one suppressed, then itself."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock = Clock()
    audit = Audit(logging.getLogger(LOGGER), per_window=1, window_s=10.0, clock=clock)
    audit.event("close", "a")
    audit.event("close", "b")
    audit.event("close", "c")
    clock.t += 30.0
    audit.event("close", "d")
    assert lines(caplog) == ["a", "suppressed 2 similar 'close' line(s) in the last 10 s", "d"]


def test_event_text_is_escaped_to_one_line(caplog):
    """What came over the network cannot break the line or drive a terminal."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    audit = Audit(logging.getLogger(LOGGER), clock=Clock())
    audit.event("join", "join refused: reason x\nFORGED line\x1b[2J")
    assert lines(caplog) == ["join refused: reason x\\nFORGED line\\x1b[2J"]


def test_kinds_are_bounded(caplog):
    """A flood of distinct kinds cannot grow the table without bound."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    audit = Audit(logging.getLogger(LOGGER), per_window=1, clock=Clock(), max_kinds=4)
    for i in range(100):
        audit.event(f"kind{i}", f"e{i}")
    assert len(audit._kinds) <= 4
