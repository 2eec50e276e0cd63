"""The address a joining node's connection came from, which its peers probe
(issue 23; the rule is pure, in :mod:`rdzv_server.rounds.probe_addr`): read
from the connection, and a join that names another address logged (once,
then at most once a minute server-wide: a NAT in front of a thousand nodes is
one line, not a thousand).

A node on the server's own host that connects over loopback (an agent beside
the server, ``--rdzv-endpoint localhost:...``) is probed at its claimed
address if that address is one of this host's (the kernel lets us bind it):
its peers cannot reach 127.0.0.1, and it can aim probes only at this host."""

from __future__ import annotations

import ipaddress
import logging
import socket
from typing import Any

from rdzv_common.protocol import JoinMsg, printable

from .conns import LogLimiter
from .rounds.probe_addr import same_ip, seen_ip

log = logging.getLogger(__name__)
_note = LogLimiter(log, logging.WARNING, burst=1, rate=1 / 60)


def seen_addr(chan: Any, msg: JoinMsg) -> str | None:
    """The IP ``chan``'s peer connected from (None: not an IP connection; the
    join's ``addr`` is then used)."""
    transport = getattr(chan, "transport", None)
    ip = seen_ip(transport.get_extra_info("peername") if transport is not None else None)
    if ip is None or same_ip(msg.addr, ip):
        return ip
    if ipaddress.ip_address(ip).is_loopback and _this_hosts(msg.addr):
        return msg.addr
    if msg.probe_port is not None:
        _note(
            "job %s node %s: its join names address %s but its connection came from %s; its peers probe %s "
            "(behind a NAT or proxy they get no answer, and a vanished host is found by keep-alive: design.md, "
            '"A vanished host")',
            msg.job_id,
            msg.node_id,
            printable(msg.addr, limit=64),
            ip,
            ip,
        )
    return ip


def _this_hosts(addr: str) -> bool:
    """Whether ``addr`` is an IP address of this host (one a socket can be bound to)."""
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:  # a name: the server resolves nothing
        return False
    try:
        with socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((str(ip), 0))
    except OSError:
        return False
    return True
