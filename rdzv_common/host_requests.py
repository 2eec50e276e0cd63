"""The request bodies of the host REST API (``/v1/hosts/{host}/...``): a
cordon and a health report. Part of the wire contract: :mod:`rdzv_common.protocol`
re-exports every name here."""

from __future__ import annotations

import re

from pydantic import Field

from .fields import Id, Seconds, Strict
from .wire import HOST_PATTERN

MAX_HOST_REASON = 300
HOST_RE = re.compile(HOST_PATTERN)


def is_valid_host(value: str) -> bool:
    return 0 < len(value) <= 255 and bool(HOST_RE.fullmatch(value))


class CordonRequest(Strict):
    """``POST /v1/hosts/{host}/cordon``: no new admissions from the host (for
    ``ttl_s`` seconds, or until uncordoned); ``drain``: replace its running
    nodes at once."""

    reason: str = Field(min_length=1, max_length=MAX_HOST_REASON)
    ttl_s: Seconds | None = None
    drain: bool = False


class HealthReport(Strict):
    """``POST /v1/hosts/{host}/health``: an agent's health check failed on the
    host (``reason``: the check's last line); counted against the host."""

    job_id: Id | None = None
    reason: str = Field(min_length=1, max_length=MAX_HOST_REASON)
