"""rdzv_server.ha_peers: which replica campaigns first when the leader key is
gone (the successor: the first registered replica other than the leader),
what the others wait, and what the leader names to its agents. Pure: the
registrations as etcd's range read returns them, and a clock passed in."""

from __future__ import annotations

import json

from rdzv_server import ha_peers
from rdzv_server.etcd import KeyValue
from rdzv_server.ha_peers import HEAD_START_S, MAX_PEERS, Peer, Succession, parse, successor


def reg(rid: str, since: int, url: str | None = None) -> KeyValue:
    value = json.dumps({"url": url or f"http://{rid}:29400", "id": rid}).encode()
    return KeyValue(
        key=b"/rdzv/replicas/" + rid.encode(), value=value, create_revision=since, mod_revision=since, lease=7
    )


def test_registrations_are_ordered_by_when_they_were_made_and_foreign_values_skipped() -> None:
    kvs = [reg("c", 30), reg("a", 10), reg("b", 20)]
    kvs.append(KeyValue(key=b"/rdzv/replicas/x", value=b"[[[", create_revision=5, mod_revision=5, lease=0))
    kvs.append(
        KeyValue(key=b"/rdzv/replicas/y", value=b'{"url": "ftp://y"}', create_revision=6, mod_revision=6, lease=0)
    )
    assert [p.id for p in parse(kvs)] == ["a", "b", "c"]
    many = [reg(f"r{i}", 1000 - i) for i in range(3 * MAX_PEERS)]
    got = parse(many)
    assert len(got) == MAX_PEERS and got[0].since == 1000 - 3 * MAX_PEERS + 1  # the first registered kept


def test_the_successor_is_the_first_registered_other_than_the_leader_and_a_later_one_never_displaces_it() -> None:
    peers = parse([reg("a", 10), reg("b", 20), reg("c", 30)])
    assert successor(peers, "a") == Peer("b", "http://b:29400", 20)
    assert successor(peers, "b") == Peer("a", "http://a:29400", 10)
    assert successor(parse([reg("b", 20), reg("c", 30), reg("a", 40)]), "b").id == "c"  # a came back: after c
    assert successor(parse([reg("a", 10)]), "a") is None
    assert successor([], None) is None


def test_the_successor_campaigns_at_once_and_the_others_after_the_head_start() -> None:
    peers = parse([reg("a", 10), reg("b", 20), reg("c", 30)])
    b, c = Succession("b"), Succession("c")
    for s in (b, c):
        s.read(peers, now=100.0)
        s.leader_seen("a")
    assert b.may_campaign(101.0) is True  # b follows a
    assert c.may_campaign(101.0) is False
    assert c.due(101.0)  # while it waits it reads the registrations every poll (b may be gone too)
    c.read(peers, now=101.1)
    assert c.may_campaign(101.0 + HEAD_START_S - 0.01) is False
    assert c.may_campaign(101.0 + HEAD_START_S) is True  # counted from when it first saw the key gone


def test_a_successor_gone_too_lets_the_next_one_campaign_at_once() -> None:
    c = Succession("c")
    c.read(parse([reg("a", 10), reg("b", 20), reg("c", 30)]), now=100.0)
    c.leader_seen("a")
    assert c.may_campaign(101.0) is False
    c.read(parse([reg("c", 30)]), now=101.1)  # b's registration went with its lease
    assert c.may_campaign(101.1) is True


def test_without_registrations_everyone_campaigns_at_once_and_a_new_leader_resets_the_wait() -> None:
    alone = Succession("c")
    assert alone.may_campaign(5.0) is True  # nothing read yet (a cluster's first election): as before
    c = Succession("c")
    c.read(parse([reg("a", 10), reg("b", 20), reg("c", 30)]), now=100.0)
    c.leader_seen("a")
    assert c.may_campaign(101.0) is False
    c.leader_seen("b")  # b was elected: the next time the key goes, the wait starts then
    assert c.gone_since is None
    assert c.may_campaign(200.0) is False  # b's successor is a (registered first, and not b)
    assert c.may_campaign(200.0 + HEAD_START_S) is True


def test_the_leader_names_a_header_safe_successor_or_none() -> None:
    a = Succession("a")
    a.read(parse([reg("a", 10), reg("b", 20)]), now=0.0)
    assert a.successor_url() == "http://b:29400"
    a.read(parse([reg("a", 10), reg("b", 20, url="http://b b:1"), reg("c", 30)]), now=0.0)
    assert a.successor_url() is None  # a space (or a control character) never goes into a header
    a.read(parse([reg("a", 10)]), now=0.0)
    assert a.successor_url() is None
    assert ha_peers.header_safe("http://rdzv-1.rdzv:29400") == "http://rdzv-1.rdzv:29400"
