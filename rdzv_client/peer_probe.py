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

An answer counts only for a probe it matches, not for the address it comes
from: each probe carries a fresh random nonce (``NONCE_LEN`` bytes) that the
answer must echo, and only the nonces of a peer's last ``KEEP_NONCES`` probes
are accepted (each once). With the round's ``probe_key`` (``Assignment``;
the server's, per round) both carry an HMAC of it: a member answers only
probes signed with its round's key (the previous round's too, while the
rounds change), and the prober takes only answers signed with its own, so no
host outside the round can clear a suspicion or use the answers as a
reflector. The socket is bound to every address of the host: the server hands
peers the address this node's connection came from (rdzv_server.rounds.probe_addr),
which need not be ``--local-addr``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

PROBE_EVERY_S = 0.1
SUSPECT_AFTER_S = 0.5  # five probes in a row unanswered
REPORT_EVERY_S = 1.0
ASK, ANSWER = b"rdzv-probe?", b"rdzv-probe!"
NONCE_LEN = 8  # random bytes of each probe, echoed by its answer
MAC_LEN = 16  # bytes of HMAC-SHA256 (keyed by the round's probe_key) a signed probe or answer carries
KEEP_NONCES = 8  # a peer's last probes (0.8 s) an answer may be to: older ones are no news
MAX_PEERS = 8  # peers one prober watches (the server names MAX_WATCH)
MAX_DATAGRAM = 64  # a probe and its answer: magic, nonce, HMAC (35 bytes); anything longer is ignored
MAX_ANSWERS_PER_S = 2000  # answers this agent sends, whoever asks (a flood is not reflected at its rate)


def _mac(key: bytes, magic: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, magic + nonce, hashlib.sha256).digest()[:MAC_LEN]


def probe_datagram(nonce: bytes, key: bytes | None) -> bytes:
    """A probe: ASK, the nonce, and with a key its HMAC."""
    return ASK + nonce + (b"" if key is None else _mac(key, ASK, nonce))


def answer_to(data: bytes, key: bytes | None, old_key: bytes | None = None) -> bytes | None:
    """The answer to the probe ``data``: its nonce echoed, signed with the key
    that signed the probe (``key``, or the previous round's ``old_key``);
    None for anything else (a bad signature; an unsigned probe while this node
    has a key, or a signed one while it has none)."""
    if not data.startswith(ASK):
        return None
    body = data[len(ASK) :]
    nonce = body[:NONCE_LEN]
    if key is None:
        return ANSWER + nonce if len(body) == NONCE_LEN else None
    if len(body) != NONCE_LEN + MAC_LEN:
        return None
    for k in (key, old_key):
        if k is not None and hmac.compare_digest(body[NONCE_LEN:], _mac(k, ASK, nonce)):
            return ANSWER + nonce + _mac(k, ANSWER, nonce)
    return None


def answered_nonce(data: bytes, key: bytes | None) -> bytes | None:
    """The nonce an answer echoes, if it is signed as ``key`` requires; else None."""
    if not data.startswith(ANSWER):
        return None
    body = data[len(ANSWER) :]
    nonce = body[:NONCE_LEN]
    if key is None:
        return nonce if len(body) == NONCE_LEN else None
    if len(body) == NONCE_LEN + MAC_LEN and hmac.compare_digest(body[NONCE_LEN:], _mac(key, ANSWER, nonce)):
        return nonce
    return None


@dataclass
class _Peer:
    node_id: str
    where: tuple[Any, ...]
    heard: float | None = None  # when it last answered (None: never, in this round)
    reported: float = 0.0
    sent: deque[bytes] = field(default_factory=lambda: deque(maxlen=KEEP_NONCES))  # nonces not yet answered


class PeerProbe:
    """Answers probes at ``port``; probes the peers given to :meth:`watch` and
    calls ``report(round, node_ids)`` (from its own thread) for those gone silent."""

    def __init__(self, addr: str, report: Callable[[int, list[str]], None]) -> None:
        self.family = socket.getaddrinfo(addr, 0, type=socket.SOCK_DGRAM)[0][0]
        self.sock = socket.socket(self.family, socket.SOCK_DGRAM)
        try:
            # every address of the host, of addr's family: peers probe the one the server saw
            self.sock.bind(("::" if self.family == socket.AF_INET6 else "0.0.0.0", 0))
        except OSError:
            self.sock.close()
            raise
        self.port: int = self.sock.getsockname()[1]
        self.report = report
        self._lock = threading.Lock()
        self._round: int | None = None
        self._peers: dict[str, _Peer] = {}  # by node id
        self._key: bytes | None = None  # the round's probe_key (None: unsigned probes)
        self._old_key: bytes | None = None  # the previous round's, still answered while rounds change
        self._stop = threading.Event()
        self._answers = (0, 0.0)  # answers sent in the current second, and since when
        self._last = time.monotonic()  # when the probes were last sent
        self._thread = threading.Thread(target=self._run, name="rdzv-peer-probe", daemon=True)
        self._thread.start()

    def watch(self, round_no: int, peers: list[tuple[str, str, int]], key: bytes | None = None) -> None:
        """Probe ``peers`` (node id, address, port; the first MAX_PEERS) while
        ``round_no`` runs, signing with ``key`` (the round's probe_key)."""
        table = {}
        v4mapped = socket.AI_V4MAPPED if self.family == socket.AF_INET6 else 0
        for node_id, addr, port in peers[:MAX_PEERS]:
            try:
                where = socket.getaddrinfo(addr, port, self.family, socket.SOCK_DGRAM, 0, v4mapped)[0][4]
            except OSError:  # another address family, or a name that does not resolve here
                continue
            table[node_id] = _Peer(node_id, where)
        with self._lock:
            self._round, self._peers = round_no, table
            if key != self._key:
                self._old_key, self._key = self._key, key

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
            round_no, peers, key = self._round, list(self._peers.values()), self._key
        # this process did not run for a while (SIGSTOP, swapping): its peers' answers could not
        # be heard meanwhile, so they get a fresh grace instead of a suspicion
        stalled = now - self._last > SUSPECT_AFTER_S / 2
        self._last = now
        silent = []
        for peer in peers:
            nonce = os.urandom(NONCE_LEN)
            peer.sent.append(nonce)
            try:
                self.sock.sendto(probe_datagram(nonce, key), peer.where)
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
        with self._lock:
            key, old_key = self._key, self._old_key
        if data.startswith(ASK):
            now = time.monotonic()
            sent, since = self._answers
            if now - since >= 1.0:
                sent, since = 0, now
            if sent < MAX_ANSWERS_PER_S:
                self._answers = (sent + 1, since)
                answer = answer_to(data, key, old_key)
                if answer is not None:
                    try:
                        self.sock.sendto(answer, src)
                    except OSError:
                        pass
            return
        # an answer counts for the probe whose nonce it echoes, from whatever address (a host with several)
        nonce = answered_nonce(data, key)
        if nonce is None:
            return
        with self._lock:
            for peer in self._peers.values():
                if nonce in peer.sent:
                    peer.sent.remove(nonce)  # once: a replayed answer is no news
                    peer.heard = time.monotonic()
                    return


def attach(session: Any, link: Any) -> PeerProbe | None:
    """Probe this node's peers for ``session`` (its join carries the probe
    port from now on) and report through ``link``; None where no UDP socket can
    be bound (its peers then never suspect it)."""
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
        log.warning("peer probes off: cannot bind UDP for %s: %s", session.addr, e)
        return None
    session.probe_port = probe.port
    heard = link.observer

    def observe(msg: Any) -> None:
        if heard is not None:
            heard(msg)
        op = getattr(msg, "op", None)
        if op in ("assigned", "restart") and msg.assignment is not None:  # (a restart may carry the place)
            a = msg.assignment
            key = bytes.fromhex(a.probe_key) if a.probe_key is not None else None
            probe.watch(a.round, [(p.node_id, p.addr, p.port) for p in a.watch], key)
        elif op in ("restart", "evicted", "done", "spare"):
            probe.unwatch()

    link.observer = observe
    return probe
