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
