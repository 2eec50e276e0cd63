"""rdzv's errors: the stable wire codes and the exceptions that carry them.

Every refusal is ``{"code": ..., "message": ...}``: the HTTP body of a 4xx, or
an ``error`` frame on the agent channel. ``ERROR_STATUS`` maps every code to its
HTTP status; the client maps codes (never messages) to its exceptions
(``error_from_body``)::

    RdzvError                    root of every error rdzv raises
    +-- RequestError             the request itself was wrong (4xx codes; also the class of
    |   |                        bad_request, validation_error, body_too_large, not_found,
    |   |                        method_not_allowed, already_joined)
    |   +-- JobNotFoundError     no job of that id on this server
    |   +-- SpecMismatchError    a join disagreed with the job's spec
    |   +-- JobSecretMismatchError   a join's job secret is missing, unexpected or wrong
    |   +-- NodeSecretMismatchError  a join named a known node without its node secret
    |   +-- StaleRoundError      a message named a round that is over
    |   +-- EvictedError         the node was evicted; rejoin as a new node
    |   +-- JobFinishedError     the job already ended
    |   +-- JobNotFinishedError  a delete of a job that has not ended
    |   +-- NotJoinedError       a report on a connection that sent no join
    |   +-- UnauthorizedError    a missing or wrong bearer token
    +-- UnavailableError         the server cannot serve it now (its database); retry later
    |   +-- NotLeaderError       an HA replica that is not the leader (header X-Rdzv-Leader: its URL)
    +-- DataDirError             (rdzv_server.store) the data directory cannot be used; no start
    +-- ...                      (transport errors live in the client)

This module imports nothing of ours; :mod:`rdzv_common.protocol` re-exports all of it.
"""

from __future__ import annotations

from enum import Enum

# The longest error or exit message that crosses the wire (characters). Here, not in
# protocol.py, so that the client's light modules (exits.py) can share it without pydantic.
MAX_ERROR_MESSAGE = 4096


class ErrorCode(str, Enum):
    """Stable wire codes. Add new ones; never change the meaning of one."""

    BAD_REQUEST = "bad_request"
    VALIDATION_ERROR = "validation_error"
    BODY_TOO_LARGE = "body_too_large"
    UNAUTHORIZED = "unauthorized"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    JOB_NOT_FOUND = "job_not_found"
    SPEC_MISMATCH = "spec_mismatch"
    STALE_ROUND = "stale_round"
    EVICTED = "evicted"
    JOB_FINISHED = "job_finished"
    NOT_JOINED = "not_joined"
    ALREADY_JOINED = "already_joined"
    UNAVAILABLE = "unavailable"
    JOB_NOT_FINISHED = "job_not_finished"
    NODE_SECRET_MISMATCH = "node_secret_mismatch"
    JOB_SECRET_MISMATCH = "job_secret_mismatch"
    FORBIDDEN = "forbidden"  # another Origin, a non-loopback Host, no X-Rdzv-UI, or not the operator (auth.py)
    NOT_LEADER = "not_leader"  # an HA replica (--etcd) that is not the leader; LEADER_HEADER names the leader
    RATE_LIMITED = "rate_limited"  # too many wrong tokens from this address lately; see Retry-After


ERROR_STATUS: dict[ErrorCode, int] = {
    ErrorCode.BAD_REQUEST: 400,
    ErrorCode.VALIDATION_ERROR: 422,
    ErrorCode.BODY_TOO_LARGE: 413,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.JOB_NOT_FOUND: 404,
    ErrorCode.SPEC_MISMATCH: 409,
    ErrorCode.STALE_ROUND: 409,
    ErrorCode.EVICTED: 410,
    ErrorCode.JOB_FINISHED: 409,
    ErrorCode.NOT_JOINED: 409,
    ErrorCode.ALREADY_JOINED: 409,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.JOB_NOT_FINISHED: 409,
    ErrorCode.NODE_SECRET_MISMATCH: 403,
    ErrorCode.JOB_SECRET_MISMATCH: 403,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.NOT_LEADER: 503,
    ErrorCode.RATE_LIMITED: 429,
}

# On a ``not_leader`` refusal (REST or the agent channel's upgrade): the leader's
# --advertise-url, when this replica knows one. A client follows it only if it is
# one of the endpoints it was given (a replica is not trusted to send it elsewhere).
LEADER_HEADER = "X-Rdzv-Leader"
# On the agent channel's upgrade (the 101) from an HA leader: the --advertise-url of the
# replica that takes over when this one goes (rdzv_server.ha_peers). An agent whose
# connection drops tries it first, under the same rule as the leader's.
SUCCESSOR_HEADER = "X-Rdzv-Successor"


class RdzvError(Exception):
    """Root of rdzv's errors. ``code`` is the stable wire code."""

    code: ErrorCode = ErrorCode.BAD_REQUEST

    def __init__(self, message: str, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    @property
    def status(self) -> int:
        return ERROR_STATUS[self.code]


class RequestError(RdzvError):
    """The request was wrong; repeating it unchanged will not help."""


class JobNotFoundError(RequestError):
    code = ErrorCode.JOB_NOT_FOUND


class SpecMismatchError(RequestError):
    code = ErrorCode.SPEC_MISMATCH


class StaleRoundError(RequestError):
    code = ErrorCode.STALE_ROUND


class EvictedError(RequestError):
    code = ErrorCode.EVICTED


class JobFinishedError(RequestError):
    code = ErrorCode.JOB_FINISHED


class JobNotFinishedError(RequestError):
    """A delete named a job that has not ended; close it first."""

    code = ErrorCode.JOB_NOT_FINISHED


class NotJoinedError(RequestError):
    code = ErrorCode.NOT_JOINED


class UnauthorizedError(RequestError):
    code = ErrorCode.UNAUTHORIZED


class NodeSecretMismatchError(RequestError):
    """A join named a node this job knows without that node's secret: only
    the agent the server gave the secret to may speak for the node."""

    code = ErrorCode.NODE_SECRET_MISMATCH


class JobSecretMismatchError(RequestError):
    """A join's job secret does not match the one the job was created with
    (or one side has none)."""

    code = ErrorCode.JOB_SECRET_MISMATCH


class UnavailableError(RdzvError):
    code = ErrorCode.UNAVAILABLE


class NotLeaderError(UnavailableError):
    """This replica is not the leader (an HA server on etcd): ask ``leader``
    (its URL, from the LEADER_HEADER; None while no leader is known)."""

    code = ErrorCode.NOT_LEADER

    def __init__(self, message: str, code: ErrorCode | None = None, leader: str | None = None) -> None:
        super().__init__(message, code)
        self.leader = leader


ERROR_CLASSES: dict[ErrorCode, type[RdzvError]] = {
    ErrorCode.BAD_REQUEST: RequestError,
    ErrorCode.VALIDATION_ERROR: RequestError,
    ErrorCode.BODY_TOO_LARGE: RequestError,
    ErrorCode.UNAUTHORIZED: UnauthorizedError,
    ErrorCode.NOT_FOUND: RequestError,
    ErrorCode.METHOD_NOT_ALLOWED: RequestError,
    ErrorCode.JOB_NOT_FOUND: JobNotFoundError,
    ErrorCode.SPEC_MISMATCH: SpecMismatchError,
    ErrorCode.STALE_ROUND: StaleRoundError,
    ErrorCode.EVICTED: EvictedError,
    ErrorCode.JOB_FINISHED: JobFinishedError,
    ErrorCode.NOT_JOINED: NotJoinedError,
    ErrorCode.ALREADY_JOINED: RequestError,
    ErrorCode.UNAVAILABLE: UnavailableError,
    ErrorCode.JOB_NOT_FINISHED: JobNotFinishedError,
    ErrorCode.NODE_SECRET_MISMATCH: NodeSecretMismatchError,
    ErrorCode.JOB_SECRET_MISMATCH: JobSecretMismatchError,
    ErrorCode.FORBIDDEN: RequestError,
    ErrorCode.NOT_LEADER: NotLeaderError,
    ErrorCode.RATE_LIMITED: RequestError,
}


def error_from_body(code: str, message: str) -> RdzvError:
    """Rebuild the exception a server sent, by code; unknown codes stay generic."""
    try:
        ec = ErrorCode(code)
    except ValueError:
        return RdzvError(f"{code}: {message}")
    return ERROR_CLASSES[ec](message, ec)
