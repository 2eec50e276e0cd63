"""rdzv_server.auth's pure parts: /ui sessions (per login, bounded, expiring,
revocable), loopback Host names, token strength and roles; and the server's
start refusing a weak token (one line, exit 2)."""

from __future__ import annotations

import pytest

from rdzv_client import cli
from rdzv_server.__main__ import main
from rdzv_server.auth import MIN_TOKEN_LEN, Auth, Role, Sessions, loopback_host_header, token_problem

STRONG = "a" * MIN_TOKEN_LEN
OTHER = "b" * MIN_TOKEN_LEN


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_every_session_is_new_and_only_a_hash_is_held():
    s = Sessions()
    ids = {s.create(Role.AGENT, f"10.0.0.{n}") for n in range(50)}
    assert len(ids) == 50 and all(len(i) >= 40 for i in ids)
    assert all(s.role(i) is Role.AGENT for i in ids)
    assert not any(i.encode() in key for key in s._held for i in ids)


def test_a_session_expires_after_its_ttl():
    c = Clock()
    s = Sessions(ttl_s=10.0, clock=c)
    sid = s.create(Role.OPERATOR)
    c.t += 9.9
    assert s.role(sid) is Role.OPERATOR
    c.t += 0.1
    assert s.role(sid) is None and len(s) == 0


def test_expired_sessions_are_swept_on_the_next_login():
    c = Clock()
    s = Sessions(ttl_s=10.0, clock=c)
    for _ in range(5):
        s.create(Role.AGENT)
    c.t += 10.0
    s.create(Role.AGENT)
    assert len(s) == 1


def test_revoke_ends_a_session_and_only_it():
    s = Sessions()
    a, b = s.create(Role.AGENT), s.create(Role.AGENT)
    assert s.revoke(a) and not s.revoke(a)
    assert s.role(a) is None and s.role(b) is Role.AGENT
    assert not s.revoke("") and not s.revoke("x" * 10_000)


def test_the_table_is_bounded_oldest_first():
    s = Sessions(max_sessions=3)
    ids = [s.create(Role.AGENT, f"10.0.0.{i}") for i in range(5)]
    assert len(s) == 3
    assert [s.role(i) for i in ids] == [None, None, Role.AGENT, Role.AGENT, Role.AGENT]


def test_one_address_logging_in_again_and_again_signs_out_only_itself():
    """Issue 19 review: with one table of 1,000, a token holder's 1,000 logins dropped every other
    session, the operator's too; an address now drops its own oldest past its share."""
    s = Sessions(max_sessions=100, max_per_addr=4)
    operator = s.create(Role.OPERATOR, "10.0.0.1")
    mine = [s.create(Role.AGENT, "10.66.66.66") for _ in range(1000)]
    assert s.role(operator) is Role.OPERATOR
    assert len(s) == 5 and [s.role(i) for i in mine[-4:]] == [Role.AGENT] * 4 and s.role(mine[0]) is None
    assert s.revoke(mine[-1]) and len(s) == 4
    s.create(Role.AGENT, "10.66.66.66")  # room again for that address without dropping its others
    assert [s.role(i) for i in mine[-4:-1]] == [Role.AGENT] * 3


@pytest.mark.parametrize(
    ("host", "ok"),
    [
        ("127.0.0.1", True),
        ("127.0.0.1:29400", True),
        ("127.1.2.3:1", True),
        ("localhost", True),
        ("LocalHost:8080", True),
        ("[::1]", True),
        ("[::1]:29400", True),
        ("", False),
        ("evil.example", False),
        ("evil.example:29400", False),
        ("localhost.evil.example", False),
        ("127.0.0.1.nip.io", False),
        ("0.0.0.0:29400", False),
        ("10.0.0.1:29400", False),
        ("[::1]x", False),
        ("[::2]:1", False),
        ("[127.0.0.1]:1", False),
        ("localhost:http", False),
        ("::1", False),
    ],
)
def test_loopback_host_header(host, ok):
    assert loopback_host_header(host) is ok


def test_token_strength():
    assert token_problem("--token", None) is None
    assert token_problem("--token", STRONG) is None
    assert "at least 16" in (token_problem("--token", "x" * (MIN_TOKEN_LEN - 1)) or "")
    assert token_problem("--token", " " + STRONG) and token_problem("--token", STRONG + "\n")
    assert token_problem("--token", "é" * 20)


def test_roles_of_the_two_tokens():
    both = Auth(STRONG, OTHER)
    assert both.role_of(STRONG) is Role.AGENT and both.role_of(OTHER) is Role.OPERATOR
    assert both.role_of("") is None and both.role_of(STRONG + "x") is None and both.role_of("\udcff") is None
    one = Auth(STRONG)
    assert one.role_of(STRONG) is Role.OPERATOR and one.role_of("") is None
    assert Auth(None).role_of("") is None  # a tokenless server never gets here, but "" proves nothing


@pytest.mark.parametrize(
    ("argv", "env", "says"),
    [
        (["--token", "short"], {}, "--token is 5 characters; at least 16"),
        ([], {"RDZV_TOKEN": "x" * 15}, "--token is 15 characters"),
        (["--token", STRONG, "--operator-token", "op"], {}, "--operator-token is 2 characters"),
        ([], {"RDZV_TOKEN": STRONG, "RDZV_OPERATOR_TOKEN": STRONG}, "differs"),
        ([], {"RDZV_OPERATOR_TOKEN": OTHER}, "needs a --token"),
    ],
)
def test_the_server_refuses_a_weak_token_at_start(argv, env, says, monkeypatch, capsys):
    for name in ("RDZV_TOKEN", "RDZV_OPERATOR_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as e:
        main([*argv, "--data-dir", "none", "--port", "0"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
    for value in (STRONG, OTHER):
        assert value not in err  # a refused token is not echoed


def test_the_cli_sends_the_operator_token_when_set(monkeypatch):
    monkeypatch.setenv("RDZV_TOKEN", STRONG)
    monkeypatch.delenv("RDZV_OPERATOR_TOKEN", raising=False)
    assert cli.build_parser().parse_args(["close", "j"]).token == STRONG
    monkeypatch.setenv("RDZV_OPERATOR_TOKEN", OTHER)
    assert cli.build_parser().parse_args(["close", "j"]).token == OTHER
    assert cli.build_parser().parse_args(["--token", "given", "close", "j"]).token == "given"
