"""The agent's probes of its peers (issue 23): a vanished host is seen first by
the nodes that talk to it.

Each agent answers UDP probes on a port of its own (``probe_port`` in its
join) and, while its node runs a round, probes the peers its assignment names
(``Assignment.watch``: the next two members in group-rank order) every
``PROBE_EVERY_S``. A peer that answered and then stays silent for
``SUSPECT_AFTER_S`` is reported to the server (``SuspectMsg``), again at most
every ``REPORT_EVERY_S`` while the silence lasts. The server probes the
suspect itself and evicts it only when the suspect's host acknowledges
nothing (rdzv_server.suspicion): a report is never more than a reason to look.

A peer that never answered (UDP filtered, an agent without probes) is never
suspected. The probes run in a thread of their own, so a busy event loop
neither delays answers nor makes this agent suspect others. Standard library.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

PROBE_EVERY_S = 0.1
SUSPECT_AFTER_S = 0.5  # five probes in a row unanswered
REPORT_EVERY_S = 1.0
ASK, ANSWER = b"rdzv-probe?", b"rdzv-probe!"
MAX_DATAGRAM = 64  # a probe and its answer: the magic and an 8-byte nonce; anything longer is ignored
MAX_ANSWERS_PER_S = 2000  # answers this agent sends, whoever asks (a flood is not reflected at its rate)


@dataclass
class _Peer:
    node_id: str
    where: tuple[str, int]
    heard: float | None = None  # when it last answered (None: never, in this round)
    reported: float = 0.0


class PeerProbe:
    """Answers probes at ``port``; probes the peers given to :meth:`watch` and
    calls ``report(round, node_ids)`` (from its own thread) for those gone silent."""

    def __init__(self, addr: str, report: Callable[[int, list[str]], None]) -> None:
        info = socket.getaddrinfo(addr, 0, type=socket.SOCK_DGRAM)[0]
        self.family = info[0]
        self.sock = socket.socket(self.family, socket.SOCK_DGRAM)
        try:
            self.sock.bind(info[4])
        except OSError:
            self.sock.close()
            raise
        self.port: int = self.sock.getsockname()[1]
        self.report = report
        self._lock = threading.Lock()
        self._round: int | None = None
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._stop = threading.Event()
        self._answers = (0, 0.0)  # answers sent in the current second, and since when
        self._last = time.monotonic()  # when the probes were last sent
        self._thread = threading.Thread(target=self._run, name="rdzv-peer-probe", daemon=True)
        self._thread.start()

    def watch(self, round_no: int, peers: list[tuple[str, str, int]]) -> None:
        """Probe ``peers`` (node id, address, port) while ``round_no`` runs."""
        table = {}
        for node_id, addr, port in peers:
            try:
                where = socket.getaddrinfo(addr, port, self.family, socket.SOCK_DGRAM)[0][4]
            except OSError:  # another address family, or a name that does not resolve here
                continue
            key = (str(where[0]), int(where[1]))
            table[key] = _Peer(node_id, key)
        with self._lock:
            self._round, self._peers = round_no, table

    def unwatch(self) -> None:
        """The round is over: probe nobody (answers go on)."""
        with self._lock:
            self._round, self._peers = None, {}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self.sock.close()

    def _run(self) -> None:
        next_probe = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_probe:
                self._probe(now)
                next_probe = now + PROBE_EVERY_S
            try:
                ready, _, _ = select.select([self.sock], [], [], max(0.0, next_probe - now))
            except (OSError, ValueError):  # closed under us
                return
            if ready:
                self._receive()

    def _probe(self, now: float) -> None:
        with self._lock:
            round_no, peers = self._round, list(self._peers.values())
        # this process did not run for a while (SIGSTOP, swapping): its peers' answers could not
        # be heard meanwhile, so they get a fresh grace instead of a suspicion
        stalled = now - self._last > SUSPECT_AFTER_S / 2
        self._last = now
        silent = []
        for peer in peers:
            try:
                self.sock.sendto(ASK + os.urandom(8), peer.where)
            except OSError:  # our own link is down, or the route is gone: not the peer's fault
                pass
            if stalled and peer.heard is not None:
                peer.heard = now
            if peer.heard is not None and now - peer.heard >= SUSPECT_AFTER_S and now - peer.reported >= REPORT_EVERY_S:
                peer.reported = now
                silent.append(peer.node_id)
        if silent and round_no is not None:
            try:
                self.report(round_no, silent)
            except Exception:  # the agent is closing: its loop is gone
                log.debug("peer suspicion not reported", exc_info=True)

    def _receive(self) -> None:
        try:
            data, src = self.sock.recvfrom(MAX_DATAGRAM + 1)
        except OSError:
            return
        if len(data) > MAX_DATAGRAM:
            return
        if data.startswith(ASK):
            now = time.monotonic()
            sent, since = self._answers
            if now - since >= 1.0:
                sent, since = 0, now
            if sent < MAX_ANSWERS_PER_S:
                self._answers = (sent + 1, since)
                try:
                    self.sock.sendto(ANSWER + data[len(ASK) :], src)
                except OSError:
                    pass
        elif data.startswith(ANSWER):
            with self._lock:
                peer = self._peers.get((src[0], src[1]))
                if peer is not None:
                    peer.heard = time.monotonic()


def attach(session: Any, link: Any) -> PeerProbe | None:
    """Probe this node's peers for ``session`` (its join carries the probe
    port from now on) and report through ``link``; None where no UDP socket can
    be bound at the node's address (its peers then never suspect it)."""
    import asyncio

    loop = asyncio.get_running_loop()

    def report(round_no: int, nodes: list[str]) -> None:
        loop.call_soon_threadsafe(send_suspect, round_no, nodes)

    def send_suspect(round_no: int, nodes: list[str]) -> None:
        # imported here, not at attach: the first join goes out before pydantic is loaded
        # (tests/e2e/test_agent_startup.py); by the time a peer is suspected the link has it
        from rdzv_common.protocol import SuspectMsg

        link.send_nowait(SuspectMsg(round=round_no, nodes=nodes).model_dump_json())

    try:
        probe = PeerProbe(session.addr, report)
    except OSError as e:
        log.warning("peer probes off: cannot bind UDP at %s: %s", session.addr, e)
        return None
    session.probe_port = probe.port
    heard = link.observer

    def observe(msg: Any) -> None:
        if heard is not None:
            heard(msg)
        op = getattr(msg, "op", None)
        if op == "assigned":
            a = msg.assignment
            probe.watch(a.round, [(p.node_id, p.addr, p.port) for p in a.watch])
        elif op in ("restart", "evicted", "done", "spare"):
            probe.unwatch()

    link.observer = observe
    return probe
