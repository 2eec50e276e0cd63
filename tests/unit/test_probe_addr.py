"""rdzv_server.rounds.probe_addr: which address a node's peers probe (the one
its connection came from) and its rounds' probe keys. Pure."""

from __future__ import annotations

import ipaddress
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from rdzv_common.protocol import PROBE_KEY_PATTERN
from rdzv_common.wire import HOST_PATTERN
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


# ------------------------------------------------ the IPv4 fast path agrees with ipaddress


def _seen_ip_ref(peername: object) -> str | None:
    """seen_ip as ipaddress alone says it (the rule before the IPv4 fast path)."""
    if not isinstance(peername, tuple) or not peername or not isinstance(peername[0], str):
        return None
    try:
        ip = ipaddress.ip_address(peername[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    text = str(ip)
    return text if len(text) <= 255 and re.match(HOST_PATTERN, text) else None


def _same_ip_ref(claimed: str, seen: str) -> bool:
    try:
        ip = ipaddress.ip_address(claimed)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip) == seen


_octet = st.one_of(
    st.integers(0, 999).map(str),  # in range or not
    st.integers(0, 255).map(lambda n: f"0{n}"),  # a leading zero (ipaddress refuses it)
    st.sampled_from(["", " 1", "1 ", "+1", "-1", "٣", "0x1", "1\n"]),  # not decimal ASCII
)
_addr_like = st.one_of(
    st.lists(_octet, min_size=3, max_size=5).map(".".join),
    st.builds(lambda a, b, c, d: f"::ffff:{a}.{b}.{c}.{d}", *[st.integers(0, 255)] * 4),
    st.ip_addresses().map(str),
    st.text(alphabet="0123456789.:abcdef%", max_size=20),
    st.text(max_size=20),
)


@settings(max_examples=2000, deadline=None)
@given(text=_addr_like, seen=_addr_like)
def test_the_ipv4_fast_path_says_what_ipaddress_says(text: str, seen: str) -> None:
    assert seen_ip((text, 1)) == _seen_ip_ref((text, 1))
    assert same_ip(text, seen) == _same_ip_ref(text, seen)
    canonical = _seen_ip_ref((seen, 1))
    if canonical is not None:  # the seen address as the server has it: canonical
        assert same_ip(text, canonical) == _same_ip_ref(text, canonical)
