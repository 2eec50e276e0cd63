"""rdzv_common/wire.py: the plain (pydantic-free) side of the wire contract that
the agent uses to build and send its first join, kept equal to the models of
protocol.py; and the agent's start-up path importing neither pydantic nor
aiohttp."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys

import pytest
from pydantic import ValidationError

from rdzv_client.config import build_parser, config_from_args
from rdzv_client.session import NodeSession
from rdzv_common.protocol import MAX_NODES, MAX_RESTARTS, MAX_TIMEOUT_S, JobSpec, JoinMsg
from rdzv_common.wire import check_spec, join_fields

INTS = [0, 1, 2, 3, MAX_NODES, MAX_NODES + 1, MAX_RESTARTS, MAX_RESTARTS + 1, -1, True, 2.0, "2", None]
SECONDS = [0, 0.0, 1, 0.5, 6.0, MAX_TIMEOUT_S, MAX_TIMEOUT_S + 1, -1.0, math.inf, math.nan, True, "1", None]


def _both(**fields):
    """(plain result or None, model result or None) for the same fields."""
    try:
        plain = check_spec(**fields)
    except ValueError:
        plain = None
    try:
        model = JobSpec(**fields)
    except ValidationError:
        model = None
    return plain, model


@pytest.mark.parametrize("min_nodes,max_nodes", list(itertools.product(INTS, INTS)))
def test_check_spec_takes_and_refuses_node_counts_as_jobspec_does(min_nodes, max_nodes) -> None:
    plain, model = _both(min_nodes=min_nodes, max_nodes=max_nodes)
    assert (plain is None) == (model is None), (min_nodes, max_nodes, plain, model)
    if model is not None:
        assert plain == json.loads(model.model_dump_json())


@pytest.mark.parametrize("field", ["max_restarts"])
@pytest.mark.parametrize("value", INTS)
def test_check_spec_restarts_as_jobspec(field: str, value) -> None:
    plain, model = _both(min_nodes=1, max_nodes=2, **{field: value})
    assert (plain is None) == (model is None), (value, plain, model)
    if model is not None:
        assert plain == json.loads(model.model_dump_json())


@pytest.mark.parametrize(
    "field", ["last_call_s", "heartbeat_timeout_s", "join_timeout_s", "scale_up_window_s", "in_place_timeout_s"]
)
@pytest.mark.parametrize("value", SECONDS)
def test_check_spec_seconds_as_jobspec(field: str, value) -> None:
    plain, model = _both(min_nodes=1, max_nodes=2, **{field: value})
    assert (plain is None) == (model is None), (field, value, plain, model)
    if model is not None:
        assert plain == json.loads(model.model_dump_json())


@pytest.mark.parametrize(
    "field,value",
    [("straggler_window_s", v) for v in SECONDS]
    + [("straggler_fraction", v) for v in (0, 0.0, 0.1, 0.5, 1, 1.0, 1.01, -0.5, math.inf, math.nan, True, "0.5", None)]
    + [("straggler_policy", v) for v in ("warn", "replace", "evict", "", "WARN", 1, None)],
)
def test_check_spec_straggler_fields_as_jobspec(field: str, value) -> None:
    plain, model = _both(min_nodes=1, max_nodes=2, **{field: value})
    assert (plain is None) == (model is None), (field, value, plain, model)


@pytest.mark.parametrize("value", ["process", "in-place", "inplace", "", "PROCESS", 1, None])
def test_check_spec_restart_mode_as_jobspec(value) -> None:
    plain, model = _both(min_nodes=1, max_nodes=2, restart_mode=value)
    assert (plain is None) == (model is None), (value, plain, model)
    if model is not None:
        assert plain == json.loads(model.model_dump_json())


def test_a_refused_spec_names_the_field() -> None:
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        check_spec(min_nodes=1, max_nodes=1, heartbeat_timeout_s=math.inf)
    with pytest.raises(ValueError, match=r"min_nodes \(3\) is greater than max_nodes \(2\)"):
        check_spec(min_nodes=3, max_nodes=2)


def test_join_fields_is_joinmsg_field_for_field() -> None:
    spec = check_spec(min_nodes=1, max_nodes=4, max_restarts=0, last_call_s=2, join_timeout_s=30)
    for extra in (
        {},
        {"requested_rank": 3, "resume_round": 7, "node_secret": "n s", "job_secret": "j 0123456789abcdef"},
    ):
        plain = join_fields(
            job_id="job-1",
            node_id="h-1-abc",
            host="h",
            addr="127.0.0.1",
            local_world_size=8,
            master_port=29500,
            spec=spec,
            **extra,
        )
        model = JoinMsg(
            job_id="job-1",
            node_id="h-1-abc",
            host="h",
            addr="127.0.0.1",
            local_world_size=8,
            master_port=29500,
            spec=JobSpec(**spec),
            **extra,
        )
        # the same bytes as pydantic writes, and the server reads it back as the same message
        assert json.dumps(plain, separators=(",", ":"), ensure_ascii=False) == model.model_dump_json()
        assert JoinMsg.model_validate_json(json.dumps(plain)) == model


def test_the_agents_first_join_is_a_valid_joinmsg() -> None:
    """From flags to the frame: what the agent sends is what JoinMsg takes."""
    cfg = config_from_args(
        build_parser().parse_args(
            [
                "--endpoint",
                "127.0.0.1:1",
                "--job-id",
                "j",
                "--nnodes",
                "1:3",
                "--max-restarts",
                "2",
                "--last-call",
                "0.25",
                "--node-rank",
                "1",
                "--job-secret",
                "sec-0123456789abcdef",
                "true",
            ]
        )
    )
    s = NodeSession(
        job_id=cfg.job_id,
        host="my host",
        nproc=cfg.nproc,
        spec=cfg.spec_fields(),
        addr="127.0.0.1",
        job_secret=cfg.job_secret,
        requested_rank=cfg.node_rank,
    )
    msg = JoinMsg.model_validate_json(json.dumps(s.join_msg()))
    assert msg.spec == cfg.spec() == JobSpec(min_nodes=1, max_nodes=3, max_restarts=2, last_call_s=0.25)
    assert (msg.host, msg.requested_rank, msg.job_secret, msg.resume_round) == (
        "my-host",
        1,
        "sec-0123456789abcdef",
        None,
    )


def test_the_agent_imports_neither_pydantic_nor_aiohttp_before_its_join(tmp_path) -> None:
    """Everything the agent runs up to its first join frame: the agent module
    (flags, config, session, link, WebSocket client), the config and the join."""
    code = (
        "import sys, json\n"
        "from rdzv_client.agent import build_parser, config_from_args, Agent\n"
        "from rdzv_client.client import AgentLink\n"
        "cfg = config_from_args(build_parser().parse_args(['--endpoint', '127.0.0.1:1', '--job-id', 'j', "
        f"'--log-dir', {str(tmp_path)!r}, 'true']))\n"
        "a = Agent(cfg); a.session.addr = '127.0.0.1'\n"
        "json.dumps(a.session.join_msg()); AgentLink(cfg.endpoint)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pydantic', 'aiohttp', 'yarl', 'multidict')"
        " or m == 'rdzv_common.protocol'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_job_secret_is_16_to_256_printable_characters_in_one_place() -> None:
    """Issue 19 item 7: the agent's check (job_secret_problem) and the server's JoinMsg agree."""
    from pydantic import ValidationError

    from rdzv_common.wire import MIN_JOB_SECRET_LEN, job_secret_problem

    base = dict(job_id="j", node_id="n", host="h", addr="127.0.0.1", local_world_size=1, master_port=1)
    for secret in ("", "x", "a" * (MIN_JOB_SECRET_LEN - 1), "a" * 257, "tab\there-0123456789", "é" * 20):
        assert job_secret_problem(secret), secret
        with pytest.raises(ValidationError, match="job_secret"):
            JoinMsg(**base, spec=JobSpec(min_nodes=1, max_nodes=1), job_secret=secret)
    for secret in ("a" * MIN_JOB_SECRET_LEN, "a" * 256, "with spaces and ~ 0123"):
        assert job_secret_problem(secret) is None
        assert JoinMsg(**base, spec=JobSpec(min_nodes=1, max_nodes=1), job_secret=secret).job_secret == secret
    # a node secret (issued by the server) keeps its own rule
    assert JoinMsg(**base, spec=JobSpec(min_nodes=1, max_nodes=1), node_secret="n").node_secret == "n"
