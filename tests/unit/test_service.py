"""The --server-timeout clock (rdzv_client.service) and rate-limited lines
(rdzv_client.quiet): pure, on a fake clock."""

from __future__ import annotations

import pytest

from rdzv_client.quiet import Quiet
from rdzv_client.service import ServiceClock, outage_word


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_clock_runs_from_the_start_until_a_join_is_served() -> None:
    c = FakeClock()
    s = ServiceClock(2.0, c)
    c.t += 5
    assert s.unserved_for() == 5.0 and not s.serving
    s.connected()
    c.t += 1  # connected, the join not answered: still counts
    assert s.unserved_for() == 6.0
    s.served()
    assert s.unserved_for() == 0.0 and s.serving


def test_a_service_that_does_not_hold_does_not_stop_the_clock() -> None:
    """A server that answers, then closes or evicts at each join: the clock
    goes on from the outage's start, not from the last drop."""
    c = FakeClock()
    s = ServiceClock(2.0, c)
    for _ in range(10):
        c.t += 0.5
        s.connected()
        s.served()
        c.t += 0.1
        assert not s.stable()
        s.unserved()
    assert abs(s.unserved_for() - 6.0) < 1e-9


def test_a_service_that_held_starts_a_new_outage_at_the_drop() -> None:
    c = FakeClock()
    s = ServiceClock(2.0, c)
    c.t += 1
    s.connected()
    s.served()
    c.t += 10
    assert s.stable()
    s.unserved()
    c.t += 3
    assert s.unserved_for() == 3.0
    s.unserved()  # a second end of the same service changes nothing
    assert s.unserved_for() == 3.0


def test_outage_word() -> None:
    assert outage_word(None) == "unreachable"
    assert outage_word("cannot reach http://x: refused") == "unreachable"
    assert outage_word("handshake refused: 503") == "unreachable"
    # the network lost the connection (a pulled cable: no route; a reset): not a refusal
    assert outage_word("connection lost: [Errno 113] No route to host") == "unreachable"
    assert outage_word("join refused: unavailable: full") == "not serving this node"
    assert outage_word("connection closed by the server (x)") == "not serving this node"


def test_quiet_says_once_then_at_most_every_interval_with_a_count() -> None:
    q = Quiet(every_s=30.0, max_keys=3)
    assert q.allow("a", now=0.0) == ""
    assert all(q.allow("a", now=float(t)) is None for t in range(1, 30))
    said = q.allow("a", now=31.0)
    assert said is not None and "29 more" in said
    assert q.allow("b", now=31.0) == ""  # per kind
    for k in "cdefg":
        q.allow(k, now=32.0)
    assert len(q._said) == 3  # bounded


def test_outage_is_back_only_once_the_service_held() -> None:
    from rdzv_client.session import OutageWatch

    w = OutageWatch(60.0)
    out = w.check(3.0)
    assert out is not None and out.kind == "notice"
    assert w.check(0.0, settled=False) is None  # answered, then dropped again at once: not news
    out = w.check(3.5)
    assert out is not None and out.kind == "ongoing"  # no second notice within 30 s
    out = w.check(0.0, settled=True)
    assert out is not None and out.kind == "back"


def test_refusal_is_any_error_to_an_unanswered_join_and_any_eviction() -> None:
    from rdzv_client.service import refusal
    from rdzv_common.protocol import ErrorCode, ErrorMsg, EvictedMsg

    busy = ErrorMsg(code=ErrorCode.UNAVAILABLE, message="full\nforged line")
    assert refusal(busy, serving=False) == "join refused: unavailable: full\\nforged line"
    assert refusal(ErrorMsg(code=ErrorCode.NOT_JOINED, message="x"), serving=False) is not None
    # a served node's report refused: passed on, no drop
    assert refusal(ErrorMsg(code=ErrorCode.STALE_ROUND, message="x"), serving=True) is None
    # an eviction, by message or code, drops even a served node's connection
    assert refusal(EvictedMsg(reason="gone"), serving=True) == "join refused: evicted: gone"
    assert refusal(ErrorMsg(code=ErrorCode.NODE_SECRET_MISMATCH, message="x"), serving=True) is not None


def test_a_connect_that_finds_nothing_is_refused_or_an_unknown_host() -> None:
    """Refused (also asyncio's joined error for every address of a name) or an
    unknown host: nothing listens. A timeout or another error: maybe something."""
    import errno
    import socket

    from rdzv_client.service import nothing_listens

    assert nothing_listens(ConnectionRefusedError(errno.ECONNREFUSED, "Connect call failed ('127.0.0.1', 1)"))
    assert nothing_listens(socket.gaierror(-2, "Name or service not known"))
    both = OSError(
        "Multiple exceptions: [Errno 111] Connect call failed ('::1', 1, 0, 0), "
        "[Errno 111] Connect call failed ('127.0.0.1', 1)"
    )
    assert nothing_listens(both)
    mixed = OSError(
        "Multiple exceptions: [Errno 101] Connect call failed ('::1', 1, 0, 0), "
        "[Errno 111] Connect call failed ('127.0.0.1', 1)"
    )
    assert not nothing_listens(mixed)
    assert not nothing_listens(TimeoutError())
    assert not nothing_listens(OSError(errno.EHOSTUNREACH, "No route to host"))


def test_first_contact_names_what_was_tried_until_an_endpoint_is_reached() -> None:
    """Never reached: what each endpoint's connect found. Once one was reached (or
    a connect failed otherwise), an outage is a server's outage: None from then on."""
    from rdzv_client.service import FirstContact

    fc = FirstContact()
    assert fc.never_reached() is None  # nothing tried yet
    fc.failed("http://h:1", ConnectionRefusedError(111, "Connect call failed"))
    fc.failed("http://h:2", ConnectionRefusedError(111, "Connect call failed"))
    fc.failed("http://h:1", ConnectionRefusedError(111, "Connect call failed"))
    text = fc.never_reached()
    assert text is not None and text.count("http://h:1") == 1 and "http://h:2" in text
    fc.seen()
    fc.failed("http://h:1", ConnectionRefusedError(111, "Connect call failed"))
    assert fc.never_reached() is None
    slow = FirstContact()
    slow.failed("http://h:1", ConnectionRefusedError(111, "Connect call failed"))
    slow.failed("http://h:1", TimeoutError())
    assert slow.never_reached() is None


def test_a_never_reached_endpoint_gives_up_at_its_own_deadline_an_outage_at_the_server_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rdzv_client.service import NEVER_REACHED_ENV, NEVER_REACHED_S
    from rdzv_client.session import OutageWatch

    monkeypatch.delenv(NEVER_REACHED_ENV, raising=False)
    w = OutageWatch(300.0)
    notice = w.check(NEVER_REACHED_S - 1, never_reached=True)
    assert notice is not None and (notice.kind, notice.left) == ("notice", 1.0)  # the countdown is to 10 s, not 300
    assert w.check(NEVER_REACHED_S, never_reached=True).kind == "never_reached"  # type: ignore[union-attr]
    assert w.check(NEVER_REACHED_S + 20, never_reached=False).kind == "ongoing"  # type: ignore[union-attr]
    assert OutageWatch(5.0).check(5.0, never_reached=True).kind == "give_up"  # type: ignore[union-attr]
    monkeypatch.setenv(NEVER_REACHED_ENV, "60")
    assert OutageWatch(300.0).check(30.0, never_reached=True).kind == "notice"  # type: ignore[union-attr]
    monkeypatch.setenv(NEVER_REACHED_ENV, "soon")
    with pytest.raises(ValueError, match=NEVER_REACHED_ENV):
        OutageWatch(300.0)
