"""The fencing check of tests/helpers/ha.py finds what it must: a write by a
replica outside its term, a write while no leader key lived, a write with no
by/term; and passes a history where each leadership wrote in its own term.
(The HA e2e tests rely on it to say that no two leaders' writes interleaved.)"""

from __future__ import annotations

import json

from tests.helpers.etcd import Event
from tests.helpers.ha import fencing_violations

P = "/rdzv-t/"


def lead(rev: int, rid: str) -> Event:
    return Event(rev, P + "leader", json.dumps({"url": f"http://127.0.0.1:{rev}", "id": rid}).encode(), 7, rev, 1)


def gone(rev: int) -> Event:
    return Event(rev, P + "leader", None, 0, 0, 0)


def write(rev: int, key: str, by: str, term: int) -> Event:
    value = json.dumps({"by": by, "term": term, "record": {}}).encode()
    return Event(rev, P + key, value, 0, rev, 1)


def test_two_leaderships_each_writing_in_its_own_term_pass() -> None:
    history = [lead(2, "a"), write(3, "jobs/j", "a", 2), gone(4), lead(5, "b"), write(6, "hosts/h", "b", 5)]
    assert fencing_violations(history, P) == []


def test_a_write_outside_its_term_is_found() -> None:
    history = [lead(2, "a"), gone(4), lead(5, "b"), write(6, "jobs/j", "a", 2)]
    assert fencing_violations(history, P) == ["rev 6: /rdzv-t/jobs/j written by a (term 2) while b led (term 5)"]


def test_a_write_with_no_live_leader_key_is_found() -> None:
    history = [lead(2, "a"), gone(4), write(5, "jobs/j", "a", 2), Event(6, P + "jobs/j", None, 0, 0, 0)]
    assert len(fencing_violations(history, P)) == 2


def test_a_write_by_another_id_in_the_same_term_and_a_write_without_by_are_found() -> None:
    history = [lead(2, "a"), write(3, "jobs/j", "b", 2), Event(4, P + "jobs/k", b'{"record": {}}', 0, 4, 1)]
    problems = fencing_violations(history, P)
    assert len(problems) == 2 and "written by b (term 2) while a led (term 2)" in problems[0]
    assert "holds no by/term" in problems[1]
