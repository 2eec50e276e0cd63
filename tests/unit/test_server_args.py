"""rdzv-server's choice of address from --host, the token and --insecure (the
process-level refusals are in tests/faults/test_server_guard.py)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from rdzv_server.__main__ import auth_note
from rdzv_server.auth import is_loopback
from rdzv_server.flags import UsageError, bind_host, build_parser


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


# ----------------------------------------------------------------- --etcd (HA replicas)


def _ha(*argv: str, host: str = "127.0.0.1", port: int = 29400, tls: bool = False):
    from rdzv_server.flags import ha_settings

    return ha_settings(build_parser().parse_args(list(argv)), host, port, tls)


def test_without_etcd_there_is_no_replica_and_its_options_are_refused():
    assert _ha() is None
    with pytest.raises(UsageError, match="--advertise-url needs --etcd"):
        _ha("--advertise-url", "http://a:1")
    with pytest.raises(UsageError, match="--etcd-user needs --etcd"):
        _ha("--etcd-user", "u")


def test_etcd_settings_from_flags(monkeypatch):
    ha = _ha("--etcd", " http://e1:2379/, http://e2:2379,http://e1:2379", "--etcd-prefix", "/team-a")
    assert ha is not None
    assert ha.endpoints == ["http://e1:2379", "http://e2:2379"]  # trimmed, de-duplicated, in order
    assert ha.prefix == "/team-a/"
    assert ha.advertise_url == "http://127.0.0.1:29400"  # from a concrete --host and --port
    assert ha.lease_ttl_s == 2 and ha.ssl_ctx is None and ha.user is None
    ha = _ha("--etcd", "http://e1:2379", "--advertise-url", "https://rdzv-0.rdzv:29400/", host="0.0.0.0")
    assert ha is not None and ha.advertise_url == "https://rdzv-0.rdzv:29400"
    monkeypatch.setenv("RDZV_ETCD_PASSWORD", "s3cret")
    ha = _ha("--etcd", "http://e1:2379", "--etcd-user", "rdzv")
    assert ha is not None and (ha.user, ha.password) == ("rdzv", "s3cret")


def test_etcd_password_file(tmp_path, monkeypatch):
    monkeypatch.delenv("RDZV_ETCD_PASSWORD", raising=False)
    f = tmp_path / "pw"
    f.write_text("from-file\n")
    ha = _ha("--etcd", "http://e1:2379", "--etcd-user", "rdzv", "--etcd-password-file", str(f))
    assert ha is not None and ha.password == "from-file"
    with pytest.raises(UsageError, match="needs a password"):
        _ha("--etcd", "http://e1:2379", "--etcd-user", "rdzv")
    with pytest.raises(UsageError, match="--etcd-password-file: "):
        _ha("--etcd", "http://e1:2379", "--etcd-user", "rdzv", "--etcd-password-file", str(tmp_path / "missing"))


@pytest.mark.parametrize(
    "argv, host, match",
    [
        (["--etcd", "e1:2379"], "127.0.0.1", "not an etcd client URL"),
        (["--etcd", "ftp://e1:2379"], "127.0.0.1", "not an etcd client URL"),
        (["--etcd", "http://e1:2379/v3"], "127.0.0.1", "not an etcd client URL"),
        (["--etcd", " , "], "127.0.0.1", "1 to 16"),
        (["--etcd", ",".join(f"http://e{i}:2379" for i in range(17))], "127.0.0.1", "1 to 16"),
        (["--etcd", "http://e1:2379", "--data-dir", "/tmp/x"], "127.0.0.1", "exclude each other"),
        (["--etcd", "http://e1:2379", "--etcd-lease-ttl", "1"], "127.0.0.1", "2..60"),
        (["--etcd", "http://e1:2379"], "0.0.0.0", "needs --advertise-url"),
        (["--etcd", "http://e1:2379", "--advertise-url", "rdzv-0:29400"], "127.0.0.1", "is not http"),
        (["--etcd", "http://e1:2379", "--etcd-cert", "/nonexistent.pem"], "127.0.0.1", "go together"),
        (["--etcd", "http://e1:2379", "--etcd-prefix", "bad\nprefix"], "127.0.0.1", "printable"),
    ],
)
def test_bad_etcd_flags_are_refused_with_the_reason(argv, host, match):
    with pytest.raises(UsageError, match=match):
        _ha(*argv, host=host)


def test_the_event_loop_is_uvloop_where_installed_unless_asyncio_is_asked_for(monkeypatch):
    import uvloop

    from rdzv_server.__main__ import run
    from rdzv_server.flags import loop_factory

    assert build_parser().parse_args([]).event_loop == "auto"
    assert loop_factory("auto") is uvloop.new_event_loop and loop_factory("uvloop") is uvloop.new_event_loop
    assert loop_factory("asyncio") is None
    seen = []

    async def main():
        seen.append(type(asyncio.get_running_loop()).__module__)

    run(main(), loop_factory("auto"))
    run(main(), None)
    assert seen[0].startswith("uvloop") and seen[1].startswith("asyncio"), seen
    monkeypatch.setitem(sys.modules, "uvloop", None)  # not installed
    assert loop_factory("auto") is None
    with pytest.raises(UsageError, match="uvloop is not installed"):
        loop_factory("uvloop")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--event-loop", "trio"])
