"""What an agent accepts from a server (issue 13, item 5): the server -> agent
models are bounded and consistent, so a lying server's message is a
validation error (a protocol error for the link), never a crash later; and
the agent's own flags for giving up (item 12)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from rdzv_client.agent import DEFAULT_SERVER_TIMEOUT_S, UsageError, build_parser, config_from_args
from rdzv_common.protocol import SERVER_MESSAGE, Assignment

GOOD = dict(
    job_id="j",
    round=3,
    group_rank=1,
    group_world_size=2,
    local_world_size=4,
    rank_offset=4,
    world_size=8,
    master_addr="10.0.0.1",
    master_port=29500,
    max_restarts=3,
    restarts=1,
)


def test_a_sane_assignment_passes() -> None:
    assert Assignment(**GOOD).world_size == 8
    msg = SERVER_MESSAGE.validate_json(json.dumps({"op": "assigned", "assignment": GOOD}))
    assert msg.assignment.master_addr == "10.0.0.1"


@pytest.mark.parametrize(
    "bad",
    [
        {"master_addr": "10.0.0.1\x00"},
        {"master_addr": "a b"},
        {"master_addr": "x\n\x1b[2J"},
        {"master_addr": ""},
        {"master_port": -1},
        {"master_port": 0},
        {"master_port": 70000},
        {"local_world_size": 0},
        {"world_size": 10**18},
        {"group_rank": 2},  # == group_world_size
        {"group_rank": -1},
        {"rank_offset": 5},  # 5 + 4 > 8
        {"group_world_size": 0},
        {"world_size": 1},  # smaller than the group
        {"restarts": -1},
        {"max_restarts": 10**12},
        {"round": -1},
        {"job_id": "a/b"},
    ],
)
def test_an_assignment_out_of_bounds_is_refused(bad: dict) -> None:
    with pytest.raises(ValidationError):
        SERVER_MESSAGE.validate_json(json.dumps({"op": "assigned", "assignment": {**GOOD, **bad}}))


@pytest.mark.parametrize(
    "frame",
    [
        {"op": "joined", "round": 0, "node_id": "n", "heartbeat_s": 0},
        {"op": "joined", "round": 0, "node_id": "n", "heartbeat_s": -1},
        {"op": "status", "round": 0, "waiting_for": {"text": "t", "joined": -1}},
        {"op": "status", "round": 0, "waiting_for": {"text": "t", "missing": ["x"] * 65}},
        {"op": "restart", "round": 1, "reason": "r" * 5000},
        {"op": "done", "state": "failed", "reason": "r", "root_cause": "c" * 5000},
        {"op": "ack", "of": "x" * 100},
        {"op": "error", "code": "stale_round", "message": "m" * 5000},
    ],
)
def test_other_server_messages_are_bounded(frame: dict) -> None:
    with pytest.raises(ValidationError):
        SERVER_MESSAGE.validate_json(json.dumps(frame))


def _cfg(*argv: str, **env: str):
    return config_from_args(build_parser().parse_args(["--endpoint", "127.0.0.1:1", "--job-id", "j", *argv, "x.py"]))


def test_server_timeout_flag_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RDZV_SERVER_TIMEOUT", raising=False)
    assert _cfg().server_timeout_s == DEFAULT_SERVER_TIMEOUT_S == 300
    assert _cfg("--server-timeout", "7.5").server_timeout_s == 7.5
    monkeypatch.setenv("RDZV_SERVER_TIMEOUT", "42")
    assert _cfg().server_timeout_s == 42
    assert _cfg("--server-timeout", "3").server_timeout_s == 3


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan"])
def test_server_timeout_must_be_positive(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RDZV_SERVER_TIMEOUT", raising=False)
    with pytest.raises(UsageError, match="--server-timeout"):
        _cfg("--server-timeout", value)
