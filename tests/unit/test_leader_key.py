"""The leader key's value as a follower reads it (rdzv_server.ha_peers.url_of):
whatever another writer put there, the answer is a URL to name or None, never
an exception (the campaign would log it with a traceback every poll, 10 a
second, and never name a leader)."""

from __future__ import annotations

import pytest

from rdzv_server.ha_peers import url_of as _leader_url


@pytest.mark.parametrize(
    "value",
    [b"[" * 100_000, b'{"url":' * 50_000, b"\xff\xfe", b"5", b"null", b'{"url": ["http://x"]}'],
    ids=["deep-array", "deep-object", "not-utf8", "number", "null", "url-not-a-string"],
)
def test_a_value_that_is_not_a_replicas_names_no_leader(value: bytes) -> None:
    assert _leader_url(value) is None


def test_a_replicas_value_names_its_url() -> None:
    assert _leader_url(b'{"url": "http://rdzv-0.rdzv:29400", "id": "x"}') == "http://rdzv-0.rdzv:29400"
