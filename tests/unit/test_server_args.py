"""rdzv-server's choice of address from --host, the token and --insecure (the
process-level refusals are in tests/faults/test_server_guard.py)."""

from __future__ import annotations

import pytest

from rdzv_server.__main__ import UsageError, auth_note, bind_host, build_parser, is_loopback


@pytest.mark.parametrize(
    "host, loopback",
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("localhost", True),
        ("LOCALHOST", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("10.0.0.1", False),
        ("head", False),
        ("fe80::1%eth0", False),
    ],
)
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_default_host_depends_on_the_token():
    args = build_parser().parse_args([])
    assert getattr(args, "host", None) is None and args.insecure is False
    assert bind_host(None, None, False) == "127.0.0.1"
    assert bind_host(None, "t0ken", False) == "0.0.0.0"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.0.0.1", "head"])
def test_non_loopback_needs_a_token_or_insecure(host):
    with pytest.raises(UsageError, match="--token.*--insecure"):
        bind_host(host, None, False)
    assert bind_host(host, "t0ken", False) == host
    assert bind_host(host, None, True) == host


def test_loopback_needs_nothing():
    assert bind_host("127.0.0.1", None, False) == "127.0.0.1"
    assert bind_host("::1", None, False) == "::1"


def test_auth_note_says_what_is_exposed():
    assert auth_note("0.0.0.0", "t") == "auth: token"
    assert "loopback only" in auth_note("127.0.0.1", None)
    assert "--insecure" in auth_note("0.0.0.0", None) and "NONE" in auth_note("0.0.0.0", None)
