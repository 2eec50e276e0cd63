"""The agent's upgrade on an HA replica that does not serve, refused before
aiohttp parses it.

In a failover every agent walks its endpoint list (rdzv_client.endpoints):
the dead leader refuses the connection, and a follower, or the new leader
while it loads the state, answers 503 ``not_leader`` naming the leader
(``app.leader_middleware``). At 16,384 nodes that is 16,384 such answers per
replica it reaches first, and through aiohttp (its request, the middlewares,
the response) each cost the replica ~170 us of CPU (py-spy, bench.big_job
``--etcd``): seconds of a leader kill, on the replicas whose cores the
storm needs. :class:`Refuser` makes the answer of a connection accepted while the replica
does not serve (:class:`listener.TakingProtocol`, or :class:`listener.EarlyProtocol`
on a site without a taker) to its first bytes when they are exactly that upgrade's request head
(``GET /v1/agent HTTP/1.1``, the head whole, nothing after it): the same
status, error body and ``X-Rdzv-Leader`` as the middleware's, then the
connection closes (``Connection: close``). Anything else takes aiohttp's
path: other requests, a head split over reads, bytes after it (a body never
read would turn the close into a reset), and every connection accepted while
the replica serves (those are taken, or aiohttp's: no early answer is asked for).

The refusal comes before every check of rdzv_server/auth.py: the token (and
the wrong-token throttle and its audit line), the Host check against DNS
rebinding, the Origin check. It tells what /healthz, which needs none of them,
tells too (this replica does not serve; who leads), and a web page cannot read
a refused WebSocket handshake. What a client sees differently: an agent with a
wrong token is told ``not_leader`` by a replica that does not serve, and learns
that its token is wrong from the leader, as before from any replica.
"""

from __future__ import annotations

from http import HTTPStatus

from aiohttp import web

from rdzv_common.errors import LEADER_HEADER
from rdzv_common.protocol import AGENT_PATH

from .auth import error_text
from .keys import STORE

_HEAD = f"GET {AGENT_PATH} HTTP/1.1\r\n".encode()
_END = b"\r\n\r\n"


def response(status: int, body: str, leader: str | None) -> bytes:
    """The whole HTTP response: ``body`` (JSON), closing the connection, naming ``leader``."""
    data = body.encode()
    lines = [
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
        "Content-Type: application/json; charset=utf-8",
        f"Content-Length: {len(data)}",
        "Connection: close",
    ]
    if leader:
        lines.append(f"{LEADER_HEADER}: {leader}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


class Refuser:
    """For listener.Listener (a ``listener.Refuser``): ``app``'s answer to an agent's upgrade while its
    replica does not serve."""

    def __init__(self, app: web.Application) -> None:
        self.store = app[STORE]
        self.last: tuple[str, str | None, bytes] | None = None  # (message, leader, response): one per state

    def active(self) -> bool:
        return self.store.replica is not None and not self.store.serving

    def __call__(self, data: bytes) -> bytes | None:
        replica = self.store.replica
        if replica is None or self.store.serving or not data.startswith(_HEAD) or data.find(_END) != len(data) - 4:
            return None
        e = replica.refusal()
        leader = e.leader
        if leader is not None and not leader.isprintable():  # never a header built of a control character
            return None
        last = self.last
        if last is None or last[:2] != (e.message, leader):
            last = self.last = (e.message, leader, response(e.status, error_text(e.code, e.message), leader))
        return last[2]
