"""The wire contract between rdzv's server, its agents and its REST users.

Everything that crosses the network is one of the pydantic models below. The
client imports this module; this module imports only rdzv_common.errors,
rdzv_common.wire, rdzv_common.fields (the strict base and bounded field types),
rdzv_common.job_spec (JobSpec) and rdzv_common.rest_models (the REST response
models), and re-exports their names.

Two channels:

* REST (JSON over HTTP) for people and scripts: ``GET /v1/jobs``
  (``?state=&limit=&cursor=&order=``, one page at a time), ``GET /v1/jobs/{job_id}``,
  ``DELETE /v1/jobs/{job_id}`` (finished jobs only), ``POST /v1/jobs/{job_id}/close``,
  ``GET /v1/hosts`` (paged), ``GET /v1/hosts/{host}``, ``POST /v1/hosts/{host}/cordon``,
  ``.../uncordon``, ``.../health`` (host records: docs/design.md, "Bad hosts"),
  ``/healthz``, ``/metrics``, ``/openapi.json``.
* The agent channel: one WebSocket per agent at ``GET /v1/agent``. The agent
  sends :data:`AgentMessage` frames (JSON text), the server pushes
  :data:`ServerMessage` frames. A held connection is how the server knows an
  agent lives: its drop is noticed at once, and the agent's heartbeats bound a
  silent loss. Completion of a round is pushed the moment it happens.

Errors
------
Every refusal is ``{"code": ..., "message": ...}``: the HTTP body of a 4xx, or
an ``error`` frame on the agent channel. The codes and the exception classes
live in :mod:`rdzv_common.errors` (re-exported here); its docstring draws the
error tree.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    Field,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    model_serializer,
    model_validator,
)

from .errors import (  # noqa: F401  (re-exported: the wire contract is one import)
    ERROR_CLASSES,
    ERROR_STATUS,
    LEADER_HEADER,
    MAX_ERROR_MESSAGE,
    SUCCESSOR_HEADER,
    ErrorCode,
    EvictedError,
    JobFinishedError,
    JobNotFinishedError,
    JobNotFoundError,
    JobSecretMismatchError,
    NodeSecretMismatchError,
    NotJoinedError,
    NotLeaderError,
    RdzvError,
    RequestError,
    SpecMismatchError,
    StaleRoundError,
    UnauthorizedError,
    UnavailableError,
    error_from_body,
)
from .fields import (  # noqa: F401  (re-exported: the wire contract is one import)
    ErrorBody,
    Host,
    Id,
    JobSecret,
    Port,
    RoundNo,
    RunNo,
    Seconds,
    Secret,
    Strict,
)
from .host_requests import MAX_HOST_REASON, CordonRequest, HealthReport, is_valid_host  # noqa: F401  (re-exported)
from .job_spec import JobSpec, heartbeat_interval  # noqa: F401  (re-exported)
from .rest_models import (  # noqa: F401  (re-exported: the wire contract is one import)
    DEFAULT_PAGE,
    MAX_PAGE,
    TERMINAL_STATES,
    CloseResult,
    CulpritView,
    DeleteResult,
    DepartedView,
    Health,
    HostFailureView,
    HostList,
    HostView,
    JobList,
    JobState,
    JobSummary,
    NodeView,
    RankTimingView,
    RoundView,
    RunView,
    SlowRankView,
)
from .wire import (  # noqa: F401  (re-exported: the wire contract is one import)
    AGENT_PATH,
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_IN_PLACE_TIMEOUT_S,
    DEFAULT_JOIN_TIMEOUT_S,
    DEFAULT_LAST_CALL_S,
    DEFAULT_MAX_RESTARTS,
    DEFAULT_MIN_ROUND_S,
    DEFAULT_RESTART_MODE,
    DEFAULT_SCALE_UP_WINDOW_S,
    DEFAULT_STORM_RESTARTS,
    DEFAULT_STRAGGLER_FRACTION,
    DEFAULT_STRAGGLER_POLICY,
    DEFAULT_STRAGGLER_SCORE,
    DEFAULT_STRAGGLER_WINDOW_S,
    HEARTBEAT_FRAME,
    HOST_PATTERN,
    ID_PATTERN,
    MAX_BODY_BYTES,
    MAX_DIRECT_PORTS,
    MAX_FAILURES_PER_REPORT,
    MAX_ID_LEN,
    MAX_NODES,
    MAX_NPROC,
    MAX_RESTARTS,
    MAX_SECRET_LEN,
    MAX_STDERR_LINE,
    MAX_STDERR_LINES,
    MAX_TIMEOUT_S,
    MAX_TIMING_WINDOW_S,
    MAX_TIMINGS,
    MIN_JOB_SECRET_LEN,
    SECRET_PATTERN,
    heartbeat_every,
    is_valid_id,
    job_secret_problem,
    printable,
)

# ------------------------------------------------------- agent -> server


class ExitRecord(Strict):
    """How one worker ended: a value, not an exception (as torch's RunResult)."""

    local_rank: int = Field(ge=0, le=MAX_NPROC)
    rank: int = Field(ge=0, le=MAX_NODES * MAX_NPROC)
    pid: int = Field(ge=0, le=2**31)
    exit_code: int | None = Field(default=None, ge=-(2**31), le=2**31)
    signal: str | None = Field(default=None, max_length=32)
    message: str = Field(default="", max_length=MAX_ERROR_MESSAGE)
    timestamp: float = Field(default=0.0, ge=0, le=2**40, allow_inf_nan=False)
    # why the agent ended it, when it did: "hang" (no progress() for the job's
    # hang timeout), "timer" (a torch elastic FileTimer expired); None: it ended by itself;
    # "collective": in-place mode, the worker lives, parked after a collective failed
    # (an echo: it only loses a member whose connection dropped, see rounds.fail);
    # "store_port": rank 0's store port was taken by another process: in-place rank 0 found it, or the
    # agent before starting its workers (not charged, see rounds.fail)
    reason: Literal["hang", "timer", "collective", "store_port"] | None = None
    last_step: int | None = Field(default=None, ge=0, le=2**53)  # its last progress() step, if any
    # its last stderr lines, the first failure's only (left out of the frame when None)
    stderr: list[Annotated[str, Field(max_length=MAX_STDERR_LINE)]] | None = Field(None, max_length=MAX_STDERR_LINES)

    def describe(self) -> str:
        who = f"rank {self.rank} (local rank {self.local_rank}, pid {self.pid})"
        if self.reason == "hang":
            text = f"{who} hung" + (f" after step {self.last_step}" if self.last_step is not None else "")
            return text + (f": {self.message.strip().splitlines()[0][:500]}" if self.message.strip() else "")
        if self.reason == "collective":
            return f"{who} saw a collective fail" + (
                f": {self.message.strip().splitlines()[0][:500]}" if self.message.strip() else ""
            )
        how = f"signal {self.signal}" if self.signal else f"exit code {self.exit_code}"
        text = f"{who} failed with {how}"
        if self.reason == "timer":
            text += " (torch elastic timer expired)"
        elif self.signal == "SIGKILL":
            text += " (out of memory?)"
        if self.message:
            # the first line is the error itself; the traceback stays in the worker's log
            lines = self.message.strip().splitlines()
            text += f": {lines[0][:500]}" if lines else ""
        return text


class JoinMsg(Strict):
    """Join the job's next round, or, with ``resume_round``, reconnect to the
    round this node is already running (no restart if that round still runs).

    ``node_secret``: what the server's ``joined`` handed this node id when it
    created it; every later join naming that node id must carry it.
    ``job_secret``: optional (at least ``MIN_JOB_SECRET_LEN`` characters);
    the first join of a job sets it, every later join must carry the same one
    (a job created without one refuses it), and so must a join that starts
    the id's next run (the id is owned: design.md "Job lifecycle").
    ``run``: set by an agent once a ``joined`` told it its run; a join of
    another run than the job's, or any but a fresh join to a finished job, is
    told ``job_finished``; ``new_run`` false makes every join to a finished
    job a refusal (an agent that must never start a run of an ended job)."""

    op: Literal["join"] = "join"
    job_id: Id
    node_id: Id
    host: Host
    addr: Host
    local_world_size: int = Field(ge=1, le=MAX_NPROC)
    master_port: Port
    spec: JobSpec
    requested_rank: int | None = Field(default=None, ge=0, lt=MAX_NODES)
    resume_round: RoundNo | None = None
    node_secret: Secret | None = Field(default=None, repr=False)
    job_secret: JobSecret | None = Field(default=None, repr=False)
    # the run of the job this agent belongs to (its first ``joined`` said it); None: a
    # fresh agent, which starts the next run of a finished job (design.md "Job lifecycle")
    run: RunNo | None = None
    # False: this agent only joins the job's current run; a finished job refuses it
    # (job_finished) instead of starting its next run (rdzv-agent --no-new-run)
    new_run: bool = True
    # the UDP port at ``addr`` where this node's agent answers its peers' probes
    # (rdzv_client.peer_probe); None: it does not (its peers never suspect it)
    probe_port: Port | None = None
    # ports free on ``addr`` at this join besides ``master_port``: this agent takes a round
    # change's place with its ``restart`` (no join again), and these are its MASTER_PORTs for
    # the rounds it holds rank 0 in that way (design.md "Direct re-formation"). Empty: it joins
    # again after every ``restart``
    direct_ports: list[Port] = Field(default_factory=list, max_length=MAX_DIRECT_PORTS)

    @model_validator(mode="after")
    def _fresh_ports(self) -> JoinMsg:
        if len(set(self.direct_ports)) != len(self.direct_ports) or self.master_port in self.direct_ports:
            raise ValueError(f"direct_ports {self.direct_ports} must differ from each other and from master_port")
        return self


TimingSeconds = Annotated[float, Field(ge=0, le=MAX_TIMING_WINDOW_S, allow_inf_nan=False)]


class RankTiming(Strict):
    """One local rank's time over a window (``rdzv_client.steptime``): the
    seconds between two of its progress datagrams, the steps it made in them,
    and how much of them it computed and waited inside collectives (on a GPU,
    the device's times). Lock-step ranks share their step rate; the slow one
    computes longest and waits least (issue 22 scores median / own compute)."""

    local_rank: int = Field(ge=0, lt=MAX_NPROC)
    window_s: float = Field(gt=0, le=MAX_TIMING_WINDOW_S, allow_inf_nan=False)
    steps: int = Field(ge=0, le=2**53)
    compute_s: TimingSeconds
    wait_s: TimingSeconds


class RankLag(Strict):
    """A local rank NCCL RAS sees behind its communicator in collective count
    (``rdzv_client.nccl_trace``): behind in ``share`` of ``readings`` over ``window_s``, by up to ``behind``."""

    local_rank: int = Field(ge=0, lt=MAX_NPROC)
    share: float = Field(gt=0, le=1, allow_inf_nan=False)
    readings: int = Field(ge=1, le=2**31)
    behind: int = Field(ge=1, le=2**53)
    window_s: float = Field(gt=0, le=MAX_TIMING_WINDOW_S, allow_inf_nan=False)


class HeartbeatMsg(Strict):
    """``{"op":"hb"}`` (HEARTBEAT_FRAME, matched without parsing), or, at most
    once per heartbeat interval from an agent whose workers call
    ``rdzv_client.worker.progress()``, the same with this node's progress: the
    lowest last step of its local ranks and that rank's steps per second, and
    the ranks' timings over the interval when they time (``RankTiming``, one
    per local rank at most, in local-rank order, the first MAX_TIMINGS; kept in
    the server's memory only)."""

    op: Literal["hb"] = "hb"
    step: int | None = Field(default=None, ge=0, le=2**53)
    rate: float | None = Field(default=None, ge=0, le=1e9, allow_inf_nan=False)
    timings: list[RankTiming] | None = Field(default=None, min_length=1, max_length=MAX_TIMINGS)
    # the local ranks NCCL RAS sees behind, now (in local-rank order; []: none any more; rounds.nccl_lag)
    nccl_lag: list[RankLag] | None = Field(default=None, max_length=MAX_TIMINGS)

    @model_validator(mode="after")
    def _one_per_rank(self) -> HeartbeatMsg:
        if self.timings is not None:
            if self.step is None:
                raise ValueError("timings come with a step")
            ranks = [t.local_rank for t in self.timings]
            if any(a >= b for a, b in pairwise(ranks)):
                raise ValueError("timings: one per local rank, in increasing local_rank order")
        if self.nccl_lag and any(a.local_rank >= b.local_rank for a, b in pairwise(self.nccl_lag)):
            raise ValueError("nccl_lag: one per local rank, in increasing local_rank order")
        return self

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        # a plain heartbeat is exactly HEARTBEAT_FRAME
        data: dict[str, object] = handler(self)
        return {k: v for k, v in data.items() if v is not None}


class FailedMsg(Strict):
    """This node's workers failed in ``round``; the records say how.

    ``give_up``: this node's launcher stops for good after the failure (torchrun's
    own ``--max-restarts`` is spent): the job fails at once and every node is told,
    instead of a restart. Left out of the frame when false (the frame it always was)."""

    op: Literal["failed"] = "failed"
    round: RoundNo
    failures: list[ExitRecord] = Field(min_length=1, max_length=MAX_FAILURES_PER_REPORT)
    give_up: bool = False

    @model_serializer(mode="wrap")
    def _drop_default(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        data: dict[str, object] = handler(self)
        if not data.get("give_up"):
            data.pop("give_up", None)
        for record in data.get("failures", ()):  # type: ignore[attr-defined]
            if record.get("stderr") is None:
                record.pop("stderr", None)  # the frame it always was
        return data


class SucceededMsg(Strict):
    op: Literal["succeeded"] = "succeeded"
    round: RoundNo


class LeaveMsg(Strict):
    op: Literal["leave"] = "leave"
    reason: str = Field(default="left", max_length=256)


MAX_SUSPECTS = 8  # peers one suspect message may name (a node watches MAX_WATCH)
MAX_WATCH = 2  # peers each member's agent probes: the next ones in group-rank order
PROBE_KEY_BYTES = 16  # a round's probe key (Assignment.probe_key), sent as hex
PROBE_KEY_PATTERN = rf"^[0-9a-f]{{{2 * PROBE_KEY_BYTES}}}$"


class SuspectMsg(Strict):
    """This node's agent stopped hearing the named peers of ``round`` (they
    answered its probes, then fell silent: rdzv_client.peer_probe). Only a
    cause for the server to probe them itself (rdzv_server.suspicion): a
    report never evicts anyone on its own, and is rate-limited per node."""

    op: Literal["suspect"] = "suspect"
    round: RoundNo
    nodes: list[Id] = Field(min_length=1, max_length=MAX_SUSPECTS)


AgentMessage = Annotated[
    JoinMsg | HeartbeatMsg | FailedMsg | SucceededMsg | LeaveMsg | SuspectMsg, Field(discriminator="op")
]
AGENT_MESSAGE = TypeAdapter(AgentMessage)


# ------------------------------------------------------- server -> agent


class WaitingInfo(Strict):
    """Why a round is not complete yet, in words and in fields."""

    text: str
    joined: int = Field(default=0, ge=0, le=MAX_NODES)
    min_nodes: int = Field(default=0, ge=0, le=MAX_NODES)
    max_nodes: int = Field(default=0, ge=0, le=MAX_NODES)
    spares: int = Field(default=0, ge=0, le=MAX_NODES)
    missing: list[Annotated[str, Field(max_length=MAX_ID_LEN)]] = Field(default_factory=list, max_length=64)
    last_call_deadline: float | None = Field(default=None, ge=0, le=2**40, allow_inf_nan=False)


class JoinedMsg(Strict):
    """The server took the join; ``round`` forms. Heartbeat every ``heartbeat_s``.

    ``node_secret`` is set only when this join created the node: keep it, and
    send it on every later join or resume of ``node_id``. Not sent again for a
    join after ``restart`` that names ``run``: the round's ``assigned`` answers it."""

    op: Literal["joined"] = "joined"
    round: RoundNo
    node_id: Id
    heartbeat_s: Seconds
    waiting_for: WaitingInfo | None = None
    node_secret: Secret | None = Field(default=None, repr=False)
    run: RunNo = 1  # the job's run this node joined: its later joins carry it


class PaceMsg(Strict):
    """Heartbeat every ``heartbeat_s`` from now: the server grew (or shrank) since ``joined`` said."""

    op: Literal["pace"] = "pace"
    heartbeat_s: Seconds


class StatusMsg(Strict):
    """An update while the round forms (throttled)."""

    op: Literal["status"] = "status"
    round: RoundNo
    waiting_for: WaitingInfo


class WatchPeer(Strict):
    """A peer whose agent this node's agent probes (UDP at ``addr:port``)."""

    node_id: Id
    addr: Host
    port: Port


class Assignment(Strict):
    """Everything a node needs to start its workers for one round.

    Bounded and consistent: an agent takes nothing from the server that its
    workers could not use (a NUL in an address, a world of 10**18)."""

    job_id: Id
    round: RoundNo
    group_rank: int = Field(ge=0, lt=MAX_NODES)
    group_world_size: int = Field(ge=1, le=MAX_NODES)
    local_world_size: int = Field(ge=1, le=MAX_NPROC)
    rank_offset: int = Field(ge=0, lt=MAX_NODES * MAX_NPROC)
    world_size: int = Field(ge=1, le=MAX_NODES * MAX_NPROC)
    master_addr: Host
    master_port: Port
    max_restarts: int = Field(ge=0, le=MAX_RESTARTS)
    restarts: int = Field(ge=0, le=MAX_RESTARTS + 1)
    # the peers this node's agent probes (rdzv_client.peer_probe): the next MAX_WATCH
    # members in group-rank order that answer probes
    watch: list[WatchPeer] = Field(default_factory=list, max_length=MAX_WATCH)
    # this round's key of the probes between its members (HMAC, rdzv_client.peer_probe); given
    # to the nodes that answer probes; None: unsigned probes (nonces only)
    probe_key: str | None = Field(default=None, pattern=PROBE_KEY_PATTERN, repr=False)

    @model_validator(mode="after")
    def _consistent(self) -> Assignment:
        if self.group_rank >= self.group_world_size:
            raise ValueError(f"group_rank {self.group_rank} >= group_world_size {self.group_world_size}")
        if self.rank_offset + self.local_world_size > self.world_size:
            raise ValueError(
                f"ranks {self.rank_offset}..{self.rank_offset + self.local_world_size - 1} "
                f"outside world_size {self.world_size}"
            )
        if self.world_size < self.group_world_size:
            raise ValueError(f"world_size {self.world_size} < group_world_size {self.group_world_size}")
        return self


class AssignedMsg(Strict):
    op: Literal["assigned"] = "assigned"
    assignment: Assignment


class SpareMsg(Strict):
    """The job is at max_nodes; wait, you replace the first node that fails.
    With ``reason``: this node's host may not be admitted now (cordoned or
    cooled down); it waits until that ends."""

    op: Literal["spare"] = "spare"
    round: RoundNo
    reason: str | None = None


class RestartMsg(Strict):
    """Round ``round`` is forming: stop your workers, then join it. With
    ``assignment`` (only to a node whose join offered ``direct_ports``): the
    round is formed already and this is the node's place in it; stop (or, in
    place, keep) the workers and start it, without a join."""

    op: Literal["restart"] = "restart"
    round: RoundNo
    reason: str
    assignment: Assignment | None = None


class EvictedMsg(Strict):
    """This node is no longer part of the job: kill workers, rejoin as new."""

    op: Literal["evicted"] = "evicted"
    reason: str


class DoneMsg(Strict):
    """The job ended; ``state`` says how. ``root_cause`` names the first failure."""

    op: Literal["done"] = "done"
    state: Literal["succeeded", "failed", "closed"]
    reason: str
    root_cause: str | None = None
    # why a failed job was stopped, when the agent should say so in its exit code:
    # "no_progress" (a restart storm; the agent exits EXIT_NO_PROGRESS). None: as before
    stop: Literal["no_progress"] | None = None


class AckMsg(Strict):
    """A report (failed, succeeded, leave) was recorded."""

    op: Literal["ack"] = "ack"
    of: str = Field(max_length=32)


class ErrorMsg(Strict):
    op: Literal["error"] = "error"
    code: ErrorCode
    message: str


ServerMessage = Annotated[
    JoinedMsg | StatusMsg | AssignedMsg | SpareMsg | RestartMsg | EvictedMsg | DoneMsg | AckMsg | ErrorMsg | PaceMsg,
    Field(discriminator="op"),
]
SERVER_MESSAGE = TypeAdapter(ServerMessage)


# ------------------------------------------------------------------- REST
# The response models (views, lists, results) are in rdzv_common.rest_models; a job's
# view is here because it shows the agent channel's WaitingInfo.


class JobView(BaseModel):
    job_id: str
    state: JobState
    round: int
    min_nodes: int
    max_nodes: int
    world_size: int
    restarts: int
    max_restarts: int
    master_addr: str | None
    master_port: int | None
    nodes: list[NodeView]
    spares: list[NodeView]
    waiting_for: WaitingInfo | None
    root_cause: str | None
    history: list[RoundView]
    nodes_omitted: int = Field(default=0, description="nodes and spares not listed (a view lists at most 10,000)")
    node_counts: dict[str, int] = Field(default_factory=dict, description="all the job's nodes by state, listed or not")
    next_cursor: str | None = Field(default=None, description="more nodes follow: pass it as ?cursor= for them")
    history_omitted: int = Field(default=0, description="older rounds not listed (a view lists the latest 100)")
    run: int = Field(default=1, description="this job id's run: a finished job id starts run N+1 on a fresh join")
    runs: list[RunView] = Field(
        default_factory=list, description="the previous runs of this job id, oldest first (the latest 20)"
    )
    culprit: CulpritView | None = Field(default=None, description="this run's latest failure and its stderr tail")
    departed: list[DepartedView] = Field(default_factory=list, description="nodes that left, oldest first")
