"""rdzv_client.peer_probe on real UDP sockets (loopback): answers, probes, and
the report of a peer that answered and then fell silent; never of one that
never answered."""

from __future__ import annotations

import socket
import threading
import time

from rdzv_client import peer_probe
from rdzv_client.peer_probe import ANSWER, ASK, MAX_DATAGRAM, PeerProbe


class Reports:
    def __init__(self) -> None:
        self.got: list[tuple[int, list[str]]] = []
        self.event = threading.Event()

    def __call__(self, round_no: int, nodes: list[str]) -> None:
        self.got.append((round_no, nodes))
        self.event.set()


def test_a_peer_that_answered_then_fell_silent_is_reported() -> None:
    reports = Reports()
    a, b = PeerProbe("127.0.0.1", reports), PeerProbe("127.0.0.1", Reports())
    try:
        a.watch(3, [("b", "127.0.0.1", b.port)])
        deadline = time.monotonic() + 10
        while not any(p.heard for p in a._peers.values()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert any(p.heard for p in a._peers.values()), "b never answered"
        assert not reports.got  # it answers: nobody is suspected
        b.close()  # its host vanishes: no answer any more
        assert reports.event.wait(10), "b was never reported"
        assert reports.got[0] == (3, ["b"])
    finally:
        a.close()
        b.close()


def test_a_peer_that_never_answered_is_never_reported_and_unwatch_stops_probes() -> None:
    reports = Reports()
    deaf = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    deaf.bind(("127.0.0.1", 0))
    a = PeerProbe("127.0.0.1", reports)
    try:
        a.watch(0, [("deaf", "127.0.0.1", deaf.getsockname()[1])])
        deaf.settimeout(5)
        data, _ = deaf.recvfrom(100)  # it is probed ...
        assert data.startswith(ASK)
        time.sleep(peer_probe.SUSPECT_AFTER_S + peer_probe.REPORT_EVERY_S)
        assert reports.got == []  # ... but never answered, so never suspected
        a.unwatch()
        time.sleep(2 * peer_probe.PROBE_EVERY_S)
        deaf.setblocking(False)
        while True:  # what was sent before the unwatch
            try:
                deaf.recvfrom(100)
            except BlockingIOError:
                break
        deaf.settimeout(5 * peer_probe.PROBE_EVERY_S)
        try:
            late = deaf.recvfrom(100)
        except TimeoutError:
            late = None
        assert late is None, "probed after unwatch"
    finally:
        a.close()
        deaf.close()


def test_it_answers_probes_and_ignores_the_rest() -> None:
    a = PeerProbe("127.0.0.1", Reports())
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(5)
    try:
        s.sendto(ASK + b"12345678", ("127.0.0.1", a.port))
        assert s.recvfrom(100)[0] == ANSWER + b"12345678"
        s.sendto(ASK + b"x" * MAX_DATAGRAM, ("127.0.0.1", a.port))  # too long: no answer
        s.sendto(b"garbage", ("127.0.0.1", a.port))
        s.sendto(ANSWER + b"unasked", ("127.0.0.1", a.port))  # from no watched peer: nothing
        s.settimeout(0.5)
        try:
            extra = s.recvfrom(100)
        except TimeoutError:
            extra = None
        assert extra is None
    finally:
        a.close()
        s.close()


def test_after_its_own_stall_it_gives_its_peers_a_fresh_grace_instead_of_suspecting_them() -> None:
    """A SIGSTOPped (or starved) agent heard nobody meanwhile: that is no news of its peers."""
    reports = Reports()
    a = PeerProbe("127.0.0.1", reports)
    a.close()  # its thread stopped: the probe rounds are driven by hand below (sends fail, quietly)
    a.watch(1, [("b", "127.0.0.1", 9)])
    (peer,) = a._peers.values()
    t = time.monotonic()
    a._last, peer.heard = t, t

    def rounds_until(end: float, start: float) -> None:
        now = start
        while now <= end:
            a._probe(now)
            now += peer_probe.PROBE_EVERY_S

    rounds_until(t + 0.2, t + 0.1)
    assert reports.got == []
    a._probe(t + 5.0)  # the first round after a 5 s stall
    assert reports.got == []
    rounds_until(t + 5.0 + peer_probe.SUSPECT_AFTER_S - 0.05, t + 5.1)
    assert reports.got == []  # still within the fresh grace
    rounds_until(t + 5.0 + peer_probe.SUSPECT_AFTER_S + 0.15, t + 5.0 + peer_probe.SUSPECT_AFTER_S)
    assert reports.got == [(1, ["b"])]  # silent past it: now a suspicion


# ------------------------------------------- nonces and keys (issue 23, probe hardening)


def _fake_peer() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    s.settimeout(5)
    return s


def _wait(cond, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_an_answer_counts_only_for_a_probe_whose_nonce_it_echoes() -> None:
    """An answer from the watched address with a nonce no probe carried is
    not heard; the probe's own nonce is, once, from whichever address."""
    a, b, other = PeerProbe("127.0.0.1", Reports()), _fake_peer(), _fake_peer()
    try:
        a.watch(0, [("b", "127.0.0.1", b.getsockname()[1])])
        (peer,) = a._peers.values()
        data, src = b.recvfrom(100)
        assert data.startswith(ASK) and len(data) == len(ASK) + peer_probe.NONCE_LEN
        nonce = data[len(ASK) :]
        b.sendto(ANSWER + bytes(peer_probe.NONCE_LEN), src)  # the right address, a nonce never sent
        b.sendto(ANSWER + nonce[:-1], src)  # cut short
        time.sleep(0.3)
        assert peer.heard is None, "an answer to no probe was taken"
        other.sendto(ANSWER + nonce, src)  # the probe's nonce: heard, from another address of the host
        _wait(lambda: peer.heard is not None, "the matching answer was not heard")
        assert nonce not in peer.sent  # each nonce counts once: a replay of it is no news
    finally:
        a.close()
        b.close()
        other.close()


def test_it_keeps_only_its_last_nonces_per_peer() -> None:
    a = PeerProbe("127.0.0.1", Reports())
    a.close()  # probe rounds by hand
    a.watch(0, [("b", "127.0.0.1", 9)])
    (peer,) = a._peers.values()
    t = time.monotonic()
    for i in range(3 * peer_probe.KEEP_NONCES):
        a._probe(t + i * peer_probe.PROBE_EVERY_S)
    assert len(peer.sent) == peer_probe.KEEP_NONCES


def test_signed_probes_are_answered_only_by_holders_of_the_rounds_key() -> None:
    key, other_key = b"k" * 16, b"o" * 16
    nonce = b"n" * peer_probe.NONCE_LEN
    probe = peer_probe.probe_datagram(nonce, key)
    assert len(probe) <= MAX_DATAGRAM
    answer = peer_probe.answer_to(probe, key)
    assert answer is not None and peer_probe.answered_nonce(answer, key) == nonce
    assert peer_probe.answer_to(probe, other_key) is None  # another round's member (or none) stays silent
    assert peer_probe.answer_to(probe, other_key, old_key=key) is not None  # while the rounds change
    assert peer_probe.answer_to(ASK + nonce, key) is None  # unsigned, to a member with a key: no reflector
    assert peer_probe.answer_to(probe, None) is None  # signed, to a node without a key
    # a forged answer (a host that saw the nonce but has no key) clears nothing
    assert peer_probe.answered_nonce(ANSWER + nonce, key) is None
    assert peer_probe.answered_nonce(ANSWER + nonce + b"x" * peer_probe.MAC_LEN, key) is None
    assert peer_probe.answered_nonce(peer_probe.answer_to(probe, key, old_key=None) or b"", other_key) is None


def test_two_probers_with_the_rounds_key_hear_each_other_and_a_keyless_one_is_not_heard() -> None:
    key = bytes(range(16))
    a, b, c = (PeerProbe("127.0.0.1", Reports()) for _ in range(3))
    try:
        b.watch(0, [], key)  # a member of the round: answers signed probes
        a.watch(0, [("b", "127.0.0.1", b.port), ("c", "127.0.0.1", c.port)], key)  # c: no key (not a member)
        _wait(lambda: a._peers["b"].heard is not None, "b (the round's key) was not heard")
        time.sleep(5 * peer_probe.PROBE_EVERY_S)
        assert a._peers["c"].heard is None
    finally:
        for p in (a, b, c):
            p.close()
