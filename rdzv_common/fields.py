"""The building blocks of the wire models: the strict base every message and
request derives from, the error body, and the bounded field types (ids, hosts,
ports, round and run numbers, seconds, secrets). :mod:`rdzv_common.protocol`
re-exports them."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from .errors import MAX_ERROR_MESSAGE, ErrorCode
from .wire import (
    HOST_PATTERN,
    ID_PATTERN,
    MAX_ID_LEN,
    MAX_SECRET_LEN,
    MAX_TIMEOUT_S,
    MIN_JOB_SECRET_LEN,
    SECRET_PATTERN,
)


class Strict(BaseModel):
    """Every message and request: unknown fields refused, values frozen, no
    coercion, strings bounded."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, str_max_length=MAX_ERROR_MESSAGE)


class ErrorBody(Strict):
    code: ErrorCode
    message: str


Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_LEN, pattern=ID_PATTERN)]
Host = Annotated[str, Field(min_length=1, max_length=255, pattern=HOST_PATTERN)]
Port = Annotated[int, Field(ge=1, le=65535)]
RoundNo = Annotated[int, Field(ge=0, le=2**53)]
RunNo = Annotated[int, Field(ge=1, le=2**53)]
Seconds = Annotated[float, Field(gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)]
# Node and job secrets: printable ASCII, never shown in a repr (logs, tracebacks).
Secret = Annotated[str, Field(min_length=1, max_length=MAX_SECRET_LEN, pattern=SECRET_PATTERN)]
JobSecret = Annotated[str, Field(min_length=MIN_JOB_SECRET_LEN, max_length=MAX_SECRET_LEN, pattern=SECRET_PATTERN)]
