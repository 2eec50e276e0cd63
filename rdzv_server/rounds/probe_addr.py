"""Where a node's peers probe it (issue 23): the address the server saw its
connection come from, not the one its join claims. Pure.

A join's ``addr`` and ``probe_port`` are the node's word. Handed to its peers
as they are, a lying node could aim their probes (64-byte datagrams, 10 a
second from each of two peers) at any host. The server hands peers the IP its
connection came from instead, the node's own port on it: a node can aim
probes only at itself. Where the two differ (a name in ``--local-addr``, a
node with several networks, or a NAT or proxy between nodes and server) the
peers probe the seen address; the agent answers on every address of its host
(rdzv_client.peer_probe), so only a NAT or proxy loses the probes: its nodes
are never suspected (they never answered) and keep the keep-alive's 4.6 s.
Each round's probes are signed with a key of its own (:func:`round_key`),
handed to its members in ``assigned``. Design: design.md "A vanished host".
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import re

from rdzv_common.protocol import PROBE_KEY_BYTES
from rdzv_common.wire import HOST_PATTERN

_HOST = re.compile(HOST_PATTERN)
# An IPv4 address as ipaddress writes it (four decimal octets, no leading zero): such a
# text is its own canonical form, so it needs no parsing (one per join: 16,384 per
# re-formation; ipaddress takes ~10 µs for it, this match well under one)
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_IPV4 = re.compile(rf"{_OCTET}(?:\.{_OCTET}){{3}}")


def seen_ip(peername: object) -> str | None:
    """The IP of a socket's peer name (``(ip, port, ...)``), an IPv4-mapped
    IPv6 address as IPv4; None for anything else (no IP socket)."""
    if not isinstance(peername, tuple) or not peername or not isinstance(peername[0], str):
        return None
    if _IPV4.fullmatch(peername[0]):
        return peername[0]
    try:
        ip = ipaddress.ip_address(peername[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    text = str(ip)
    return text if len(text) <= 255 and _HOST.match(text) else None


def same_ip(claimed: str, seen: str) -> bool:
    """Whether a join's ``addr`` names the IP seen (a name never does: the server resolves nothing)."""
    if _IPV4.fullmatch(claimed):
        return claimed == seen
    try:
        ip = ipaddress.ip_address(claimed)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip) == seen


def probe_addr(claimed: str, seen: str | None) -> str:
    """The address peers probe: ``seen`` (its connection's IP), or the
    claimed one where the caller knows no connection (None)."""
    return claimed if seen is None else seen


@functools.lru_cache(maxsize=1024)  # once per round, not once per member (16,384 HMACs were ~0.1-0.3 s)
def round_key(seed: bytes | None, run: int, round_no: int) -> str | None:
    """The probe key of a job's round (``Assignment.probe_key``, hex): an HMAC
    of the job's random ``seed`` (``Job.probe_seed``), so each round has its
    own and a node that left cannot sign the next round's answers; None
    without a seed (unsigned probes)."""
    if seed is None:
        return None
    return hmac.new(seed, f"probe-key {run} {round_no}".encode(), hashlib.sha256).digest()[:PROBE_KEY_BYTES].hex()
