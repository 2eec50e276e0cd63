"""What the server tells agents and operators about time says spans, never raw
unix times (issue 25: "last call until 1795955197.598", "cordoned until
1796000000 (unix time)"): the reader's clock and zone are not the server's;
where a client shows a time it is its local clock time (rdzv status)."""

from __future__ import annotations

import re

from rdzv_client.explain import clock
from rdzv_server import rounds
from rdzv_server.hosts import HostRules, Hosts, span_text
from tests.unit.test_rounds import join_msg, spec

NOW = 1_796_000_000.0
RAW = re.compile(r"\d{7,}")  # a unix time (or any 7+ digit number) in the text


def test_spans_read_as_people_say_them() -> None:
    assert [span_text(s) for s in (0, 42.4, 425, 7200, 3 * 86400 + 4 * 3600 + 59)] == [
        "0s",
        "42s",
        "7m 5s",
        "2h 0m",
        "3d 4h",
    ]


def test_last_call_says_how_long_is_left() -> None:
    sp = spec(last_call_s=30.0)
    job = rounds.new_job("j", sp, NOW)
    rounds.join(job, join_msg("a", sp=sp), NOW)
    rounds.join(job, join_msg("b", sp=sp), NOW)
    text = rounds.waiting_info(job, NOW + 10.0).text
    assert "last call: 20.0s left (or 2 more to reach max 4)" in text and not RAW.search(text), text


def test_cordons_and_cool_downs_say_how_long_they_last() -> None:
    h = Hosts(HostRules(failures=1, window_s=600.0, cooldown_s=900.0))
    h.cordon("gpu7", "bad DIMM", 7200.0, False, NOW)
    why = h.blocked("gpu7", NOW + 60.0)
    assert why == "host gpu7 is cordoned for 1h 59m more: bad DIMM", why
    h.record_failure("gpu8", "j", "rank 0 exited 1", NOW)
    why = h.blocked("gpu8", NOW + 300.0)
    assert why is not None and "cooled down for 10m 0s more" in why and not RAW.search(why), why


def test_a_client_shows_a_time_as_its_local_clock_time() -> None:
    import time

    now = time.time()
    assert clock(now) == time.strftime("%H:%M:%S", time.localtime(now))
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", clock(now - 3 * 86400))
