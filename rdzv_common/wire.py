"""The wire contract's plain parts: paths, limits, patterns, defaults, and the
checks that need no pydantic.

Here, not in :mod:`rdzv_common.protocol`, so that the agent can build and send
its first join without importing pydantic (start-up is part of recovery: an
agent that restarts should be back in the job fast). ``protocol`` re-exports
every name here, builds its models from them, and stays the one contract;
tests/unit/test_wire.py checks that :func:`check_spec` and
:func:`join_fields` agree with ``JobSpec`` and ``JoinMsg``. The job spec's
fields, their bounds and defaults, and :func:`check_spec` live in
:mod:`rdzv_common.spec_table` (one table), re-exported here.

This module imports nothing of ours but :mod:`rdzv_common.errors` and
:mod:`rdzv_common.spec_table`.
"""

from __future__ import annotations

import base64
import hashlib
import re
from typing import Any

from .errors import MAX_ERROR_MESSAGE  # noqa: F401 - one import for the wire's limits
from .spec_table import (  # re-exported: the spec's bounds, defaults and check, from the table
    DEFAULT_HEARTBEAT_TIMEOUT_S as DEFAULT_HEARTBEAT_TIMEOUT_S,
)
from .spec_table import DEFAULT_IN_PLACE_TIMEOUT_S as DEFAULT_IN_PLACE_TIMEOUT_S
from .spec_table import DEFAULT_JOIN_TIMEOUT_S as DEFAULT_JOIN_TIMEOUT_S
from .spec_table import DEFAULT_LAST_CALL_S as DEFAULT_LAST_CALL_S
from .spec_table import DEFAULT_MAX_RESTARTS as DEFAULT_MAX_RESTARTS
from .spec_table import DEFAULT_MIN_ROUND_S as DEFAULT_MIN_ROUND_S
from .spec_table import DEFAULT_RESTART_MODE as DEFAULT_RESTART_MODE
from .spec_table import DEFAULT_SCALE_UP_WINDOW_S as DEFAULT_SCALE_UP_WINDOW_S
from .spec_table import DEFAULT_STORM_RESTARTS as DEFAULT_STORM_RESTARTS
from .spec_table import DEFAULT_STRAGGLER_FRACTION as DEFAULT_STRAGGLER_FRACTION
from .spec_table import DEFAULT_STRAGGLER_POLICY as DEFAULT_STRAGGLER_POLICY
from .spec_table import DEFAULT_STRAGGLER_SCORE as DEFAULT_STRAGGLER_SCORE
from .spec_table import DEFAULT_STRAGGLER_WINDOW_S as DEFAULT_STRAGGLER_WINDOW_S
from .spec_table import MAX_NODES as MAX_NODES
from .spec_table import MAX_RESTARTS as MAX_RESTARTS
from .spec_table import MAX_TIMEOUT_S as MAX_TIMEOUT_S
from .spec_table import RESTART_MODES as RESTART_MODES
from .spec_table import STRAGGLER_POLICIES as STRAGGLER_POLICIES
from .spec_table import check_spec as check_spec

AGENT_PATH = "/v1/agent"
WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455 1.3: what every accept key is made with
# The heartbeat frame, exactly: agents send this text and the server compares
# frames to it before parsing anything (the hot path). HeartbeatMsg serializes to it.
HEARTBEAT_FRAME = '{"op":"hb"}'

# Limits that keep hostile or broken clients from costing memory or time.
MAX_ID_LEN = 128
MAX_NPROC = 1024
MAX_BODY_BYTES = 64 * 1024
MAX_FAILURES_PER_REPORT = MAX_NPROC
# Ports a join may offer for rounds formed without a join again (JoinMsg.direct_ports): the
# agent offers DIRECT_PORTS (rdzv_client.session); a server takes at most this many.
MAX_DIRECT_PORTS = 8
# A progress heartbeat's per-rank timings (HeartbeatMsg.timings, rdzv_client.steptime): one entry
# per local rank, at most MAX_TIMINGS (the first local ranks: ~100 bytes each, a frame stays far
# below MAX_BODY_BYTES); a window, and the compute and wait in it, of at most MAX_TIMING_WINDOW_S.
MAX_TIMINGS = 256
MAX_TIMING_WINDOW_S = MAX_TIMEOUT_S
# A failure report's stderr tail (ExitRecord.stderr: the failing rank's last lines, issue 25):
# at most MAX_STDERR_LINES lines of MAX_STDERR_LINE characters each (control characters escaped);
# what a job keeps of it: rdzv_common.sizes.MAX_TAIL_BYTES.
MAX_STDERR_LINES = 20
MAX_STDERR_LINE = 240

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@+-]*$"
_ID_RE = re.compile(ID_PATTERN)
HOST_PATTERN = r"^[A-Za-z0-9._:\[\]%-]+$"
# Node and job secrets: printable ASCII, never shown in a repr (logs, tracebacks).
SECRET_PATTERN = r"^[\x20-\x7e]+$"
MAX_SECRET_LEN = 256
# A job secret guards a job id (and owns it for its next runs): at least this long,
# so that guessing it is hopeless (e.g. `openssl rand -hex 16`, 32 characters).
MIN_JOB_SECRET_LEN = 16


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


def accept_key(key: str) -> str:
    """The ``Sec-WebSocket-Accept`` a server answers a client's ``Sec-WebSocket-Key`` with (RFC 6455 4.2.2)."""
    return base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()


def heartbeat_every(heartbeat_timeout_s: float) -> float:
    """How often agents send heartbeats: a few per timeout, at most every 2 s.
    The server says it in ``joined``; an agent uses it for its own spec until then."""
    return min(2.0, heartbeat_timeout_s / 3.0)


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
    probe_port: int | None = None,
    direct_ports: list[int] | None = None,
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
        "probe_port": probe_port,
        "direct_ports": list(direct_ports or ()),
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
