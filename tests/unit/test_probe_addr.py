"""rdzv_server.rounds.probe_addr: which address a node's peers probe (the one
its connection came from) and its rounds' probe keys. Pure."""

from __future__ import annotations

import re

from rdzv_common.protocol import PROBE_KEY_PATTERN
from rdzv_server.rounds.probe_addr import probe_addr, round_key, same_ip, seen_ip


def test_the_seen_address_is_the_connections_ip() -> None:
    assert seen_ip(("10.1.2.3", 40000)) == "10.1.2.3"
    assert seen_ip(("::ffff:10.1.2.3", 40000, 0, 0)) == "10.1.2.3"  # a dual-stack socket's IPv4 peer
    assert seen_ip(("2001:db8::1", 40000, 0, 0)) == "2001:db8::1"
    for nothing in (None, "", (), ("not an ip", 1), ("/run/rdzv.sock",), b"\x00"):
        assert seen_ip(nothing) is None


def test_peers_probe_the_seen_address_whatever_the_join_claims() -> None:
    assert probe_addr("192.0.2.7", "10.1.2.3") == "10.1.2.3"  # a lie, a name, a second network: the seen one
    assert probe_addr("node-7.cluster", "10.1.2.3") == "10.1.2.3"
    assert probe_addr("10.1.2.3", None) == "10.1.2.3"  # no connection address known: the join's
    assert same_ip("10.1.2.3", "10.1.2.3") and same_ip("::ffff:10.1.2.3", "10.1.2.3")
    assert not same_ip("192.0.2.7", "10.1.2.3") and not same_ip("node-7", "10.1.2.3")


def test_each_round_has_its_own_key() -> None:
    seed = bytes(range(16))
    keys = {round_key(seed, run, r) for run in (1, 2) for r in range(5)}
    assert len(keys) == 10 and all(k is not None and re.match(PROBE_KEY_PATTERN, k) for k in keys)
    assert round_key(seed, 1, 0) == round_key(seed, 1, 0)
    assert round_key(bytes(16), 1, 0) != round_key(seed, 1, 0)
    assert round_key(None, 1, 0) is None
