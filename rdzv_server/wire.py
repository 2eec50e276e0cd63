"""The wire contract's plain parts: paths, limits, patterns, defaults, and the
checks that need no pydantic.

Here, not in :mod:`rdzv_server.protocol`, so that the agent can build and send
its first join without importing pydantic (start-up is part of recovery: an
agent that restarts should be back in the job fast). ``protocol`` re-exports
every name here, builds its models from them, and stays the one contract;
tests/unit/test_protocol.py checks that :func:`check_spec` and
:func:`join_fields` agree with ``JobSpec`` and ``JoinMsg``.

This module imports nothing of ours but :mod:`rdzv_server.errors`.
"""

from __future__ import annotations

import math
import re
from typing import Any, Final

from .errors import MAX_ERROR_MESSAGE  # noqa: F401 - one import for the wire's limits

AGENT_PATH = "/v1/agent"
# The heartbeat frame, exactly: agents send this text and the server compares
# frames to it before parsing anything (the hot path). HeartbeatMsg serializes to it.
HEARTBEAT_FRAME = '{"op":"hb"}'

# Limits that keep hostile or broken clients from costing memory or time.
MAX_ID_LEN = 128
MAX_NODES = 100_000
MAX_NPROC = 1024
MAX_RESTARTS = 1_000_000
MAX_TIMEOUT_S = 7 * 24 * 3600.0
MAX_BODY_BYTES = 64 * 1024
MAX_FAILURES_PER_REPORT = MAX_NPROC
# A progress heartbeat's per-rank timings (HeartbeatMsg.timings, rdzv_client.steptime): one entry
# per local rank, at most MAX_TIMINGS (the first local ranks: ~100 bytes each, a frame stays far
# below MAX_BODY_BYTES); a window, and the compute and wait in it, of at most MAX_TIMING_WINDOW_S.
MAX_TIMINGS = 256
MAX_TIMING_WINDOW_S = MAX_TIMEOUT_S

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@+-]*$"
_ID_RE = re.compile(ID_PATTERN)
HOST_PATTERN = r"^[A-Za-z0-9._:\[\]%-]+$"
# Node and job secrets: printable ASCII, never shown in a repr (logs, tracebacks).
SECRET_PATTERN = r"^[\x20-\x7e]+$"
MAX_SECRET_LEN = 256
# A job secret guards a job id (and owns it for its next runs): at least this long,
# so that guessing it is hopeless (e.g. `openssl rand -hex 16`, 32 characters).
MIN_JOB_SECRET_LEN = 16

DEFAULT_LAST_CALL_S = 1.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 6.0
DEFAULT_JOIN_TIMEOUT_S = 600.0
DEFAULT_SCALE_UP_WINDOW_S = 0.5
DEFAULT_MAX_RESTARTS = 3
DEFAULT_STORM_RESTARTS = 3  # restarts in a row without progress that stop a job (0: off)
DEFAULT_MIN_ROUND_S = 60.0  # a round that ran this long made progress (scripts that never call progress())
# A running node whose steps/s stays below STRAGGLER_FRACTION x the job's median for
# STRAGGLER_WINDOW_S is a straggler; the policy says what then: "warn" (flag only) or
# "replace" (a waiting spare takes its place in a new round).
STRAGGLER_POLICIES = ("warn", "replace")
DEFAULT_STRAGGLER_POLICY: Final = "warn"
DEFAULT_STRAGGLER_FRACTION = 0.5
DEFAULT_STRAGGLER_WINDOW_S = 30.0
RESTART_MODES = ("process", "in-place")  # design.md "In-place re-formation"
DEFAULT_IN_PLACE_TIMEOUT_S = 10.0  # a worker must reach its safe point this fast after a round change

SPEC_SECONDS = ("last_call_s", "heartbeat_timeout_s", "join_timeout_s", "scale_up_window_s")


def is_valid_id(value: str) -> bool:
    return 0 < len(value) <= MAX_ID_LEN and bool(_ID_RE.fullmatch(value))  # fullmatch: "$" alone lets "x\n" through


# C0 and C1 control characters and DEL: what a terminal or a log reader would act on;
# and what reorders or hides text without being seen: the format characters (Unicode
# category Cf: bidi embeddings, overrides and isolates U+202A-202E U+2066-2069, marks
# U+200E/200F U+061C, zero-width U+200B-200D U+2060 U+FEFF, tags, the soft hyphen ...),
# the line and paragraph separators U+2028/2029 and the blank Hangul fillers. Listed,
# not computed from unicodedata at import (the agent starts in milliseconds);
# tests/unit check every Cf character of this Python's Unicode database.
_CONTROL_RE = re.compile(
    "[\x00-\x1f\x7f-\x9f\xad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u115f\u1160"
    "\u180e\u200b-\u200f\u2028-\u202e\u2060-\u2064\u2066-\u206f\u3164\ufeff\uffa0\ufff9-\ufffb"
    "\U000110bd\U000110cd\U00013430-\U0001343f\U0001bca0-\U0001bca3\U0001d173-\U0001d17a"
    "\U000e0001\U000e0020-\U000e007f]"
)


def _escape(m: re.Match[str]) -> str:
    c = m.group()
    if c <= "\x9f":
        return repr(c)[1:-1]  # \n, \t, \x1b ...
    n = ord(c)
    return f"\\u{n:04x}" if n <= 0xFFFF else f"\\U{n:08x}"


def printable(text: object, limit: int | None = None) -> str:
    """``text`` safe to print or log: control characters (newlines and escape
    sequences included) become visible escapes (``\\n``, ``\\x1b``), so one
    event stays one line and nothing a client sent can move a cursor, clear a
    screen or forge a log line; bidi controls and invisible characters too
    (``\\u202e``, ``\\u200b``), so none can make a name read as another.
    ``limit`` truncates the result with ``...``."""
    s = str(text)
    if _CONTROL_RE.search(s):
        s = _CONTROL_RE.sub(_escape, s)
    if limit is not None and len(s) > limit:
        s = s[: max(0, limit - 3)] + "..."
    return s


def heartbeat_every(heartbeat_timeout_s: float) -> float:
    """How often agents send heartbeats: a few per timeout, at most every 2 s.
    The server says it in ``joined``; an agent uses it for its own spec until then."""
    return min(2.0, heartbeat_timeout_s / 3.0)


def check_spec(
    *,
    min_nodes: int,
    max_nodes: int,
    max_restarts: int = DEFAULT_MAX_RESTARTS,
    last_call_s: float = DEFAULT_LAST_CALL_S,
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S,
    scale_up_window_s: float = DEFAULT_SCALE_UP_WINDOW_S,
    hang_timeout_s: float | None = None,
    storm_restarts: int = DEFAULT_STORM_RESTARTS,
    min_round_s: float = DEFAULT_MIN_ROUND_S,
    straggler_policy: str = DEFAULT_STRAGGLER_POLICY,
    straggler_fraction: float = DEFAULT_STRAGGLER_FRACTION,
    straggler_window_s: float = DEFAULT_STRAGGLER_WINDOW_S,
    restart_mode: str = "process",
    in_place_timeout_s: float = DEFAULT_IN_PLACE_TIMEOUT_S,
) -> dict[str, Any]:
    """A job spec as the plain JSON object ``JobSpec`` serializes to, or
    ValueError naming the field: the same rules as ``JobSpec``, without pydantic."""
    out: dict[str, Any] = {}
    for name, value, lo, hi in (
        ("min_nodes", min_nodes, 1, MAX_NODES),
        ("max_nodes", max_nodes, 1, MAX_NODES),
        ("max_restarts", max_restarts, 0, MAX_RESTARTS),
        ("storm_restarts", storm_restarts, 0, MAX_RESTARTS),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}: must be an integer, got {value!r}")
        if not lo <= value <= hi:
            raise ValueError(f"{name}: must be between {lo} and {hi}, got {value}")
        out[name] = value
    seconds: tuple[float | None, ...] = (
        last_call_s,
        heartbeat_timeout_s,
        join_timeout_s,
        scale_up_window_s,
        hang_timeout_s,
        min_round_s,
        straggler_window_s,
        in_place_timeout_s,
    )
    names = (*SPEC_SECONDS, "hang_timeout_s", "min_round_s", "straggler_window_s", "in_place_timeout_s")
    for name, secs in zip(names, seconds, strict=True):
        if name == "hang_timeout_s" and secs is None:  # optional: off
            out[name] = None
            continue
        if isinstance(secs, bool) or not isinstance(secs, (int, float)):
            raise ValueError(f"{name}: must be a number of seconds, got {secs!r}")
        if not math.isfinite(secs) or not 0 < secs <= MAX_TIMEOUT_S:
            raise ValueError(f"{name}: must be more than 0 and at most {MAX_TIMEOUT_S:g} seconds, got {secs!r}")
        out[name] = float(secs)
    if min_nodes > max_nodes:
        raise ValueError(f"min_nodes ({min_nodes}) is greater than max_nodes ({max_nodes})")
    if straggler_policy not in STRAGGLER_POLICIES:
        raise ValueError(f"straggler_policy: must be one of {', '.join(STRAGGLER_POLICIES)}, got {straggler_policy!r}")
    out["straggler_policy"] = straggler_policy
    f = straggler_fraction
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or not 0 < f <= 1:
        raise ValueError(f"straggler_fraction: must be more than 0 and at most 1, got {f!r}")
    out["straggler_fraction"] = float(f)
    if restart_mode not in RESTART_MODES:
        raise ValueError(f"restart_mode: must be one of {', '.join(RESTART_MODES)}, got {restart_mode!r}")
    out["restart_mode"] = restart_mode
    for name in (
        "storm_restarts",
        "min_round_s",
        "straggler_policy",
        "straggler_fraction",
        "straggler_window_s",
        "restart_mode",
        "in_place_timeout_s",
    ):
        out[name] = out.pop(name)  # in JobSpec's order, last
    return out


def join_fields(
    *,
    job_id: str,
    node_id: str,
    host: str,
    addr: str,
    local_world_size: int,
    master_port: int,
    spec: dict[str, Any],
    requested_rank: int | None = None,
    resume_round: int | None = None,
    node_secret: str | None = None,
    job_secret: str | None = None,
    run: int | None = None,
    new_run: bool = True,
) -> dict[str, Any]:
    """A join as the plain JSON object ``JoinMsg`` serializes to (field for
    field, in its order). The values are the agent's own, checked where they
    were made (flags, ``check_spec``); the server validates it as ``JoinMsg``."""
    return {
        "op": "join",
        "job_id": job_id,
        "node_id": node_id,
        "host": host,
        "addr": addr,
        "local_world_size": local_world_size,
        "master_port": master_port,
        "spec": dict(spec),
        "requested_rank": requested_rank,
        "resume_round": resume_round,
        "node_secret": node_secret,
        "job_secret": job_secret,
        "run": run,
        "new_run": new_run,
    }


def job_secret_problem(secret: str) -> str | None:
    """What is wrong with ``secret`` as a job secret (None: nothing); the
    agent and the torchrun plugin refuse it at start, the server's ``JoinMsg``
    with ``validation_error``."""
    if MIN_JOB_SECRET_LEN <= len(secret) <= MAX_SECRET_LEN and re.fullmatch(SECRET_PATTERN, secret):
        return None
    odd = "" if re.fullmatch(SECRET_PATTERN, secret) else ", not all printable ASCII"
    return (
        f"must be {MIN_JOB_SECRET_LEN}-{MAX_SECRET_LEN} printable ASCII characters "
        f"(this one has {len(secret)} characters{odd}; make one with `openssl rand -hex 16`)"
    )
