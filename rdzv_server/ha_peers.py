"""Who takes over when the leader goes: the *successor*, named in advance.

Every replica registers under ``<prefix>replicas/<id>`` (JSON: url, id),
bound to its own lease, so the key lives exactly as long as the replica keeps
its lease alive, and reads the registered replicas every ``PEERS_POLL_S``.
The successor is the registered replica, other than the leader, that
registered first (the lowest create revision): every replica computes the
same one from the same keys, a replica registered later never displaces it,
and it changes only when it goes (its key goes with its lease).

When the leader key is gone the successor campaigns at once; the others
wait ``HEAD_START_S`` from when they saw it gone (a poll re-reads the
registered replicas meanwhile, so a successor whose registration is gone,
stopped by SIGTERM or its lease expired, ends the wait; one killed a moment
ago is still registered, and the head start runs out), then campaign as before. The election itself stays the
leader key's create-if-absent transaction (rdzv_server.ha): this decides only
who tries first, never who may lead, so a wrong or stale view costs at most
the head start.

The leader names its successor to every agent in the ``X-Rdzv-Successor``
header of the WebSocket upgrade's 101 (:data:`SUCCESSOR_HEADER`); an agent
whose connection drops tries that endpoint first, if it is one of its list
(rdzv_client.endpoints). Without it the agents walked to the next endpoint of
their list, which was the losing follower in half the failovers: every node
refused there once (bench/big_job --etcd at 16,384 nodes: 1.3 s of that
follower's CPU and 1.5-2 s of the clients' on the same cores).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from rdzv_common.errors import SUCCESSOR_HEADER
from rdzv_common.wire import printable

from . import etcd

__all__ = ["SUCCESSOR_HEADER", "Peer", "Succession", "leader_of", "url_of"]

PEERS = b"replicas/"  # under the prefix: one key per replica, bound to its lease
PEERS_POLL_S = 0.5  # every replica reads the registered replicas this often
HEAD_START_S = 1.0  # a replica other than the successor campaigns this long after it saw the leader key gone
MAX_PEERS = 64  # registered replicas read at most (the first by create revision count)
MAX_URL = 512
MAX_ID = 200


@dataclass(frozen=True)
class Peer:
    id: str
    url: str
    since: int  # its key's create revision: the order of succession


def url_of(value: bytes) -> str | None:
    """The ``url`` of a leader key's or a registration's value, or None (never raises)."""
    return leader_of(value)[0]


def leader_of(value: bytes) -> tuple[str | None, str | None]:
    """(url, id) of a leader key's or a registration's value, each None when it is
    not a replica's: whatever another writer put there, never an exception (the
    campaign would log it with a traceback every poll, and never name a leader)."""
    try:
        data: Any = json.loads(value)
    except (ValueError, RecursionError):  # RecursionError: JSON nested too deep
        return None, None
    if not isinstance(data, dict):
        return None, None
    url, rid = data.get("url"), data.get("id")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")) or len(url) > MAX_URL:
        url = None
    if not isinstance(rid, str) or not rid or len(rid) > MAX_ID:
        rid = None
    return (printable(url, limit=MAX_URL) if url else None), rid


def header_safe(url: str | None) -> str | None:
    """``url`` as a header value (visible ASCII only, no space), or None."""
    if url and all(0x21 <= ord(c) < 0x7F for c in url):
        return url
    return None


def parse(kvs: list[etcd.KeyValue]) -> list[Peer]:
    """The registered replicas of a range read (what is not a registration is skipped)."""
    peers = []
    for kv in sorted(kvs, key=lambda kv: kv.create_revision):
        url, rid = leader_of(kv.value)
        if url is not None and rid is not None:
            peers.append(Peer(rid, url, kv.create_revision))
    return peers[:MAX_PEERS]


def successor(peers: list[Peer], leader_id: str | None) -> Peer | None:
    """The first registered replica that is not the leader, or None."""
    return next((p for p in peers if p.id != leader_id), None)


class Succession:
    """One replica's view of the others (pure: the replica reads etcd and the clock)."""

    def __init__(self, self_id: str) -> None:
        self.self_id = self_id
        self.peers: list[Peer] = []
        self.read_at = -math.inf  # monotonic: the last answered read of the registrations
        self.leader_id: str | None = None  # the leader last seen in the leader key
        self.gone_since: float | None = None  # monotonic: when this replica saw the leader key gone
        self._named: str | None = None  # successor_url, as of the last read

    def due(self, now: float) -> bool:
        return now - self.read_at >= PEERS_POLL_S

    def read(self, peers: list[Peer], now: float) -> None:
        self.peers, self.read_at = peers, now
        first = successor(peers, self.self_id)  # (named in every upgrade: worked out once a read)
        self._named = header_safe(first.url) if first is not None else None

    def leader_seen(self, leader_id: str | None) -> None:
        self.leader_id, self.gone_since = leader_id, None

    def may_campaign(self, now: float) -> bool:
        """The leader key is gone (``now``): campaign now? The successor, or
        anyone when none is known, at once; the others HEAD_START_S after they
        first saw it gone. While one waits the registrations are re-read every poll."""
        if self.gone_since is None:
            self.gone_since = now
        first = successor(self.peers, self.leader_id)
        if first is None or first.id == self.self_id or now - self.gone_since >= HEAD_START_S:
            return True
        self.read_at = -math.inf  # the successor may be gone too: read again at the next poll
        return False

    def is_successor(self) -> bool:
        """(follower) Whether this replica is the leader's successor."""
        first = successor(self.peers, self.leader_id)
        return first is not None and first.id == self.self_id

    def successor_url(self) -> str | None:
        """(leader) Where its agents go first when it goes: the successor's URL, header-safe."""
        return self._named
