"""The pure host rules (rdzv_server.hosts): failure window, cool-down backoff,
cordons, the cap on records. Plain numbers for time."""

from __future__ import annotations

from rdzv_server.hosts import MAX_FAILURES_KEPT, HostRecord, HostRules, Hosts

RULES = HostRules(failures=3, window_s=600.0, cooldown_s=60.0, cooldown_max_s=1800.0, max_hosts=4)


def test_three_failures_in_the_window_cool_a_host_down() -> None:
    h = Hosts(RULES)
    assert h.record_failure("a", "j", "rank 0 exited 1", 0.0)[1] is False
    assert h.record_failure("a", "j", "rank 0 exited 1", 10.0)[1] is False
    assert h.blocked("a", 10.0) is None
    rec, cooled, _ = h.record_failure("a", "j", "rank 0 exited 1", 20.0)
    assert cooled and rec is not None and rec.cooled_until == 80.0
    why = h.blocked("a", 21.0)
    assert why is not None and "cooled down" in why and "rank 0 exited 1" in why
    assert h.blocked("a", 80.0) is None  # the cool-down ended
    assert h.blocked("b", 21.0) is None


def test_cools_down_says_whether_the_next_failure_would_cool_the_host_down() -> None:
    h = Hosts(RULES)
    for t in (0.0, 10.0):
        assert h.cools_down("a", t) is False
        assert h.record_failure("a", "j", "x", t)[1] is False
    assert h.cools_down("a", 20.0) is True and h.cools_down("a", 700.0) is False  # (out of the window by then)
    assert h.record_failure("a", "j", "x", 20.0)[1] is True
    assert h.cools_down("a", 21.0) is False  # cooling already: blocked, not cooled again
    assert Hosts(HostRules(failures=1, window_s=1.0, cooldown_s=1.0, cooldown_max_s=1.0, max_hosts=4)).cools_down(
        "new", 0.0
    )
    assert not Hosts(HostRules(failures=0, window_s=1.0, cooldown_s=1.0, cooldown_max_s=1.0, max_hosts=4)).cools_down(
        "new", 0.0
    )


def test_failures_outside_the_window_do_not_count() -> None:
    h = Hosts(RULES)
    h.record_failure("a", "j", "x", 0.0)
    h.record_failure("a", "j", "x", 300.0)
    assert h.record_failure("a", "j", "x", 601.0)[1] is False  # the first one is out of the window
    assert h.record_failure("a", "j", "x", 602.0)[1] is True


def test_cooldown_doubles_per_cooldown_and_is_capped() -> None:
    h = Hosts(RULES)
    spans = []
    t = 0.0
    for _ in range(8):
        for _ in range(3):
            rec, cooled, _ = h.record_failure("a", "j", "x", t)
            t += 1.0
        assert cooled and rec is not None and rec.cooled_until is not None
        spans.append(rec.cooled_until - (t - 1.0))
        t = rec.cooled_until + 1.0
    assert spans == [60.0, 120.0, 240.0, 480.0, 960.0, 1800.0, 1800.0, 1800.0]


def test_failures_before_a_cooldown_do_not_count_again() -> None:
    h = Hosts(RULES)
    for t in (0.0, 1.0, 2.0):
        h.record_failure("a", "j", "x", t)
    assert h.blocked("a", 3.0) is not None
    assert h.record_failure("a", "j", "during", 30.0)[1] is False  # already cooling
    assert h.record_failure("a", "j", "after", 70.0)[1] is False  # one failure after: not three
    assert h.blocked("a", 71.0) is None


def test_failures_kept_are_bounded_and_reasons_clipped_to_one_line() -> None:
    h = Hosts(HostRules(failures=0))
    for i in range(MAX_FAILURES_KEPT + 5):
        h.record_failure("a", "j", "line1\nline2 " + "x" * 1000, float(i))
    rec = h.get("a")
    assert rec is not None and len(rec.failures) == MAX_FAILURES_KEPT and rec.failures_total == MAX_FAILURES_KEPT + 5
    assert "\n" not in rec.failures[0].reason and len(rec.failures[0].reason) <= 300
    assert h.blocked("a", 100.0) is None  # failures=0: never cooled down


def test_cap_evicts_the_oldest_clean_record_and_keeps_blocking_ones() -> None:
    h = Hosts(RULES)  # max 4 hosts
    h.cordon("cordoned", "bad dimm", None, False, 0.0)
    for i in range(3):
        h.record_failure(f"h{i}", "j", "x", 1.0 + i)
    _, _, evicted = h.record_failure("new", "j", "x", 10.0)
    assert evicted == ["h0"] and set(h.records) == {"cordoned", "h1", "h2", "new"}
    for host in ("h1", "h2", "new"):
        h.cordon(host, "r", None, False, 11.0)
    rec, evicted = h.cordon("one-more", "r", None, False, 12.0)
    assert rec is None and evicted == [] and len(h.records) == 4  # full of blocks: nothing evicted
    assert h.record_failure("other", "j", "x", 12.0)[0] is None


def test_cordon_ttl_drain_and_uncordon() -> None:
    h = Hosts(RULES)
    h.cordon("a", "swap the GPU", 100.0, True, 0.0)
    why = h.blocked("a", 50.0)
    assert why is not None and "cordoned" in why and "swap the GPU" in why
    assert h.draining("a", 50.0)
    assert h.blocked("a", 100.0) is None and not h.draining("a", 100.0)  # the ttl ran out
    h.cordon("a", "again", None, False, 200.0)
    assert h.next_unblock(201.0) is None
    for t in (201.0, 202.0, 203.0):
        h.record_failure("a", "j", "x", t)
    assert h.uncordon("a", 204.0) is not None
    assert h.blocked("a", 204.0) is None  # uncordon lifts the cool-down too
    assert h.uncordon("nobody", 1.0) is None


def test_next_unblock_and_records_round_trip() -> None:
    h = Hosts(RULES)
    h.cordon("a", "r", 500.0, False, 0.0)
    for t in (0.0, 1.0, 2.0):
        h.record_failure("b", "j", "x", t)
    assert h.next_unblock(3.0) == 62.0
    assert h.next_unblock(100.0) == 500.0
    for rec in h.records.values():
        assert HostRecord.from_record(rec.to_record()) == rec
