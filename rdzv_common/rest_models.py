"""What the REST API answers: job and host views, pages, results.

Read-only models the server builds (:mod:`rdzv_server.rounds.views`,
:mod:`rdzv_server.store_hosts`) and ``rdzv`` reads back. Part of the wire
contract: :mod:`rdzv_common.protocol` re-exports every name here, and
:class:`~rdzv_common.protocol.JobView` (it embeds the agent channel's
``WaitingInfo``) and the request bodies stay there.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import BaseModel, Field


class JobState(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CLOSED = "closed"


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CLOSED})


class RankTimingView(BaseModel):
    """One rank's time over a window (the heartbeat's ``RankTiming``, as the server keeps it)."""

    rank: int | None = Field(description="its global rank in the node's round (null: the node is not running)")
    local_rank: int
    window_s: float = Field(description="seconds between the two progress datagrams the window spans")
    steps: int = Field(description="steps it made in the window")
    compute_s: float = Field(description="seconds it computed in the window (on a GPU: the device's)")
    wait_s: float = Field(description="seconds it waited inside collectives in the window")
    age_s: float = Field(description="seconds since the heartbeat that brought it")


# What flagged a rank (SlowRankView.rule): its compute (rounds.slow_ranks), or NCCL RAS seeing it
# behind its communicator in collective count (its agent's readings, rounds.nccl_lag)
StragglerRule = Literal["compute", "nccl_lag"]


class SlowRankView(BaseModel):
    """The rank that made its node a straggler in lock-step training: by its
    compute (rule ``compute``), or NCCL RAS saw it behind (rule ``nccl_lag``)."""

    rank: int | None = Field(description="its global rank (null: the node is not running)")
    local_rank: int
    rule: StragglerRule = Field(default="compute", description="what flagged it: compute, or nccl_lag")
    ratio: float | None = Field(
        description="its score: the job's median compute fraction / its own (null: rule nccl_lag)"
    )
    compute_fraction: float | None = Field(description="the share of its last timing window it computed")
    median_fraction: float | None = Field(description="the job's median of that share over its timed ranks")
    window_s: float = Field(
        description="seconds its score has stayed below the job's straggler score (nccl_lag: since the start "
        "of the RAS readings that flagged it)"
    )
    lag_share: float | None = Field(
        default=None, description="nccl_lag: the share of its agent's RAS readings it was behind in"
    )
    readings: int | None = Field(default=None, description="nccl_lag: how many RAS readings that share is of")
    collectives_behind: int | None = Field(
        default=None, description="nccl_lag: the most collectives it was behind in one reading"
    )


class NodeView(BaseModel):
    node_id: str
    host: str
    addr: str
    state: Literal["waiting", "running", "succeeded", "spare", "disconnected", "rejoining", "failed", "closed"] = Field(
        description="the node's state; once the job ended, the job's (succeeded, failed, closed)"
    )
    group_rank: int | None
    requested_rank: int | None = Field(default=None, description="the --node-rank it asked for, if any")
    local_world_size: int
    rank_offset: int | None = Field(
        default=None,
        description="the global rank of its local rank 0 in the running round (its workers are ranks "
        "rank_offset .. rank_offset + local_world_size - 1); null while it does not run",
    )
    last_seen_s: float = Field(description="seconds since the server last heard from this node")
    step: int | None = Field(
        default=None,
        description="the lowest last progress() step of its local ranks "
        "(null: its workers do not call rdzv_client.worker.progress)",
    )
    steps_per_s: float | None = Field(default=None, description="that rank's recent steps per second")
    since_progress_s: float | None = Field(default=None, description="seconds since its step last advanced")
    timings: list[RankTimingView] | None = Field(
        default=None,
        description="its ranks' time over its last progress heartbeat's window: compute, and waiting inside "
        "collectives (null: its ranks do not time; kept in memory only)",
    )
    straggler: bool = Field(
        default=False,
        description="its steps/s stayed below the job's straggler fraction (default half) of the job's median "
        "for its straggler window (default 30 s); or, where at least 3 ranks report timings (lock-step), one "
        "of its ranks computes too long (slow_rank)",
    )
    slow_rank: SlowRankView | None = Field(
        default=None,
        description="the rank that flagged it by its compute: a rank whose score (the job's median compute "
        "fraction / its own) stayed below the straggler score (default 0.75) for the window (null: flagged by "
        "its steps/s, or not at all)",
    )
    straggler_note: str | None = Field(
        default=None, description="what the straggler policy did not do about it (replace: no spare waits)"
    )
    host_blocked: str | None = Field(
        default=None, description="why this spare waits: its host is cordoned or cooled down"
    )


class RoundView(BaseModel):
    round: int
    reason: str
    started_at: float = Field(description="unix time the round was opened")
    completed_at: float | None = Field(description="unix time its membership froze")
    world_size: int | None
    nodes: int | None


class CulpritView(BaseModel):
    """The job's latest failure that the training caused (not an echo of a lost peer)."""

    node_id: str
    host: str
    round: int = Field(description="the round it failed in")
    rank: int
    local_rank: int
    cause: str = Field(description="the failure in one line")
    stderr: list[str] = Field(
        description="that rank's last stderr lines as its agent sent them, oldest first (control characters "
        "escaped; at most 20 lines, 4 KiB)"
    )


class DepartedView(BaseModel):
    """A node that left the job (the latest 32)."""

    node_id: str
    host: str
    round: int = Field(description="the job's round when it left")
    left_at: float = Field(description="unix time it left")
    reason: str = Field(description="why: connection lost, left (its reason), no heartbeat, succeeded ...")


class RunView(BaseModel):
    """A finished run of a job id (the job view lists its previous runs)."""

    run: int
    state: Literal["succeeded", "failed", "closed"]
    reason: str
    root_cause: str | None
    started_at: float = Field(description="unix time the run started")
    ended_at: float = Field(description="unix time it ended")
    rounds: int = Field(description="rounds it opened")
    restarts: int


class JobSummary(BaseModel):
    job_id: str
    state: JobState
    round: int
    min_nodes: int
    max_nodes: int
    nodes: int = Field(description="members of the running round, or nodes joined while a round forms")
    spares: int = 0
    world_size: int
    restarts: int
    max_restarts: int
    created_at: float | None = Field(default=None, description="unix time the job was created")
    run: int = Field(default=1, description="this job id's run (see JobView.runs)")
    reason: str | None = Field(
        default=None,
        description="why it ended (its root cause, else its end reason), or why its latest round opened "
        "(first 160 bytes)",
    )


MAX_PAGE = 1000
DEFAULT_PAGE = 100


class JobList(BaseModel):
    jobs: list[JobSummary]
    next_cursor: str | None = Field(
        default=None, description="pass as ?cursor= for the next page; null on the last page"
    )


class DeleteResult(BaseModel):
    job_id: str
    state: JobState = Field(description="the state the job had when it was deleted")
    deleted: Literal[True] = True


class CloseResult(BaseModel):
    job_id: str
    state: JobState


class HostFailureView(BaseModel):
    at: float = Field(description="unix time")
    job_id: str
    reason: str


class HostView(BaseModel):
    host: str
    state: Literal["ok", "cooled_down", "cordoned"]
    reason: str | None = Field(description="why a join from this host waits now; null when it may join")
    cordoned: bool
    cordon_reason: str | None
    cordon_until: float | None = Field(description="unix time the cordon ends; null: until uncordoned")
    drain: bool
    cooled_until: float | None = Field(description="unix time the current or last cool-down ends")
    cooldowns: int = Field(description="how many times the host was cooled down")
    failures_total: int
    failures: list[HostFailureView] = Field(description="the latest failures, oldest first (at most 20)")
    updated_at: float


class HostList(BaseModel):
    hosts: list[HostView]
    next_cursor: str | None = Field(
        default=None, description="pass as ?cursor= for the next page; null on the last page"
    )


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    jobs: int
    nodes: int
    # standalone: SQLite or memory; leader/follower: an HA replica on etcd (--etcd)
    role: Literal["standalone", "leader", "follower"] = "standalone"
    leader: str | None = None  # the leader's --advertise-url, when known (HA only)
    # (HA leader) the replica that takes over when this one goes: its agents go there first
    successor: str | None = None
