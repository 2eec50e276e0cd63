"""The data of the round machine: node states and their allowed transitions,
nodes, jobs, and the effects a step returns. No I/O, no clock.

A node's state changes only through :func:`move`, which checks the transition
against :data:`TRANSITIONS` and keeps ``Job.counts`` (nodes per state) true.
See docs/design.md for what each state means.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from rdzv_common.logs import Line
from rdzv_common.protocol import TERMINAL_STATES, JobSpec, JobState, ServerMessage
from rdzv_common.rest_models import StragglerRule

from .culprit import Culprit
from .departed import Departure
from .templates import Prepared


class NodeState(str, Enum):
    """A node's state in its job. The values are what records store (strings):
    never change one, or saved jobs stop loading."""

    WAITING = "waiting"  # joined the forming round, or queued for a scale-up
    REJOINING = "rejoining"  # member of the previous round, alive, stopping its workers
    RUNNING = "running"  # member of the running round
    SUCCEEDED = "succeeded"  # its workers all exited 0 in the running round
    SPARE = "spare"  # beyond max_nodes: replaces the first member lost

    def __str__(self) -> str:
        return self.value


WAITING, REJOINING, RUNNING, SUCCEEDED, SPARE = NodeState

# Every allowed change of a node's state; None is "not in the job" (before its
# first join, after it was lost, left, or finished).
TRANSITIONS: dict[NodeState | None, frozenset[NodeState | None]] = {
    None: frozenset({WAITING, SPARE}),  # a new node joins: the forming round / a scale-up, or a spare
    WAITING: frozenset({WAITING, RUNNING, SPARE, None}),  # joins again / round completes / no slot / lost
    REJOINING: frozenset({WAITING, SPARE, None}),  # it rejoins the re-forming round / its host is blocked / lost
    RUNNING: frozenset({REJOINING, SUCCEEDED, None}),  # a new round opens / success / lost
    SUCCEEDED: frozenset({None}),  # it exited; the next round (or the end) forgets it
    SPARE: frozenset({SPARE, WAITING, None}),  # joins again / a round opens or a slot frees / lost
}


class IllegalTransitionError(RuntimeError):
    """A bug in the round machine: a node state change the table does not allow."""


@dataclass
class Node:
    node_id: str
    host: str
    addr: str
    local_world_size: int
    master_port: int
    requested_rank: int | None
    last_seen: float
    state: NodeState | None = None  # set only through move(), which keeps Job.counts
    group_rank: int | None = None
    rank_offset: int = 0
    connected: bool = True
    lost_deadline: float | None = None
    dropped: bool = False  # its connection dropped (not merely restored from disk)
    joined_at: float = 0.0
    graced: bool = False  # given a stall grace and not heard from since (see grace)
    secret_hash: str | None = None  # sha256 of the secret it was issued; None: saved before secrets existed
    # progress its agent sent with heartbeats (rdzv_client.worker.progress): the lowest
    # last step of its ranks, that rank's steps/s, and when the step last advanced
    step: int | None = None
    step_rate: float | None = None
    progress_at: float | None = None
    slow_since: float | None = None  # since when its rate is below the straggler fraction of the median
    straggler: bool = False  # slow for the straggler window (see progress.check_stragglers)
    note: str | None = None  # why it waits as a spare (its host is cordoned or cooled down)
    probe_port: int | None = None  # where its agent answers peers' probes (rdzv_client.peer_probe)
    # the address its peers probe: the one its connection came from, not its join's word (rounds.probe_addr)
    probe_addr: str | None = None
    # the ports its agent offered for rounds it is placed in without a join (JoinMsg.direct_ports),
    # not yet used; ``master_port`` is always one its workers never listened on (forming._complete).
    # None: its agent joins again after every restart (an old one, a health check, or no port left)
    direct_ports: list[int] | None = None
    # straggler_policy "replace": why this straggler was replaced; its next join makes it
    # a spare, told this (see progress.check_stragglers); None: not replaced
    replaced: str | None = None
    straggler_note: str | None = None  # what the policy did not do about its flag (no spare waits); not saved
    # its ranks' timings over the last progress heartbeat's window (protocol.RankTiming) and when
    # they came; memory only, replaced by each progress heartbeat (None: its ranks do not time)
    timings: tuple[Any, ...] | None = None
    timings_at: float | None = None
    # lock-step stragglers (slow_ranks): per local rank, since when its compute score is below
    # the job's straggler_score; and what flagged the node (None: not flagged by its compute)
    rank_slow_since: dict[int, float] = field(default_factory=dict)
    slow_rank: SlowRank | None = None
    # its agent's last word on which local ranks NCCL RAS sees behind (protocol.RankLag) and when
    # (rounds.nccl_lag); memory only
    nccl_lag: tuple[Any, ...] | None = None
    nccl_lag_at: float | None = None
    # why its connection was cut by the server (its silence, unanswered: rounds.pace.unanswered);
    # the reason it is lost with if the disconnect grace ends before it is back; memory only
    lost_why: str | None = None


@dataclass(frozen=True)
class SlowRank:
    """A rank flagged by its compute (rule "compute", rounds.slow_ranks): its
    local rank, its compute fraction and the job's median, their ratio (median
    / own), and since when it stayed below the job's straggler_score. Or by
    NCCL RAS (rule "nccl_lag", rounds.nccl_lag): ``fraction`` and ``ratio`` are
    the share of its agent's readings it was behind in (``readings`` of them,
    by up to ``behind`` collectives), ``median`` 0, ``since`` the readings' window's start."""

    local_rank: int
    fraction: float
    median: float
    ratio: float
    since: float
    rule: StragglerRule = "compute"
    behind: int = 0
    readings: int = 0


class HostGate(Protocol):
    """Which hosts may not be admitted now (rdzv_server.hosts.Hosts)."""

    def blocked(self, host: str, now: float) -> str | None:
        """Why a node on ``host`` waits instead of joining; None: it may join."""

    def cordoned(self, host: str, now: float) -> bool:
        """Whether an operator's cordon (not only a cool-down) blocks ``host``."""

    def cools_down(self, host: str, now: float) -> bool:
        """Whether one more failure counted against ``host`` now cools it down."""


@dataclass
class RoundRecord:
    round: int
    reason: str
    started_at: float
    completed_at: float | None = None
    world_size: int | None = None
    nodes: int | None = None


@dataclass
class RunRecord:
    """A finished run of a job id, kept when the id starts its next run."""

    run: int
    state: str  # succeeded, failed, closed
    reason: str
    root_cause: str | None
    started_at: float
    ended_at: float
    rounds: int  # rounds opened (the last round number + 1)
    restarts: int


@dataclass(slots=True)
class NoteBudget:
    """A token bucket for one kind of a job's log lines (see events.comeback): ``tokens``
    left as of ``at`` (the machine's clock), and how many lines it held back since the last."""

    tokens: float = -1.0  # < 0: full (a fresh job, or one loaded: the budget is not saved)
    at: float = 0.0
    held: int = 0


@dataclass
class Job:
    job_id: str
    spec: JobSpec
    created_at: float
    state: JobState = JobState.WAITING
    round: int = 0
    nodes: dict[str, Node] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)  # running round, group-rank order
    prev_order: list[str] = field(default_factory=list)  # previous round's order
    world_size: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    restarts: int = 0
    history: list[RoundRecord] = field(default_factory=list)
    last_call_deadline: float | None = None
    join_deadline: float | None = None
    scale_up_deadline: float | None = None
    root_cause: str | None = None
    end_reason: str | None = None
    ended_at: float | None = None
    status_dirty: bool = False
    next_status_at: float = 0.0
    counts: dict[NodeState, int] = field(default_factory=dict)  # nodes per state, kept by move()
    graced_at: float | None = None  # when a stall last extended the job's own deadlines
    secret_hash: str | None = None  # the job secret's hash (see job_secret_hash); None: no job secret
    stragglers_at: float = 0.0  # when stragglers were last looked for (at most every STRAGGLER_CHECK_S)
    # restart storms (machine.fail): restarts in a row that brought no progress; the
    # highest step any node reported (heartbeats); that step when the running round began
    no_progress: int = 0
    max_step: int | None = None
    round_step: int | None = None
    # runs (design.md "Job lifecycle"): a finished job id starts run N+1 on a fresh join;
    # the previous runs' summaries, oldest first (at most machine.MAX_RUNS); when this run began
    run: int = 1
    runs: list[RunRecord] = field(default_factory=list)
    run_started_at: float | None = None  # None: created_at (run 1)
    culprit: Culprit | None = None  # the latest failure the training caused, its stderr tail (culprit.py)
    departed: list[Departure] = field(default_factory=list)  # nodes that left, the latest (departed.py)
    gate: HostGate | None = field(default=None, repr=False, compare=False)  # set by the store; not saved
    # what its rounds' probe keys derive from (rounds.probe_addr.round_key): random, drawn by the
    # store; not saved (a restarted server draws another: the reconnects' assignments carry its keys)
    probe_seed: bytes | None = field(default=None, repr=False, compare=False)
    # the heartbeat interval a join is told (rdzv_server.pacing); None: heartbeat_interval(spec). Not saved
    heartbeat_s: float | None = field(default=None, repr=False, compare=False)
    # what is left of its budget of "node N is back" notes (events.comeback); not saved
    comebacks: NoteBudget = field(default_factory=lambda: NoteBudget(), repr=False, compare=False)
    # the running round's template for one member at a time (forming.RoundTexts); not saved
    texts: Any = field(default=None, repr=False, compare=False)
    # its members' texts as their watchers are told of them, across rounds (forming.peer_texts); not saved
    peer_texts: Any = field(default=None, repr=False, compare=False)

    @property
    def forming(self) -> bool:
        return self.state == JobState.WAITING

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL_STATES


@dataclass(frozen=True, slots=True)
class Event:
    """Something that happened to a job (made in :mod:`.events`): the event
    stream's ``type`` (one of ``logs.EVENTS``), job, run, round, node and
    fields, and the words of its log line. The stream, the json log and the
    metrics all read it."""

    kind: str
    job: str
    run: int
    round: int
    node: str | None
    text: str
    fields: dict[str, Any]

    @property
    def line(self) -> Line:
        """The event as a log line (its ``event`` field, job, round, node and fields)."""
        return Line(self.text, self.kind, job=self.job, round=self.round, node=self.node, **self.fields)


@dataclass
class Effects:
    """What the caller must do after a step, in order: persist, then (once the
    write is durable) publish the events and log lines, then send.

    ``events``: what happened (typed, see :class:`Event`); ``logs``: every log
    line in order, an event's line (:meth:`event`) or a note that is no event."""

    sends: list[tuple[str, ServerMessage | Prepared]] = field(default_factory=list)  # Prepared: a round's fan-out
    persist: bool = False
    logs: list[str] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)
    host_failures: list[tuple[str, str]] = field(default_factory=list)  # (host, reason): counted against it

    def send(self, node_id: str, msg: ServerMessage | Prepared) -> None:
        self.sends.append((node_id, msg))

    def messages(self) -> list[tuple[str, ServerMessage]]:
        """``sends``, each :class:`~.templates.Prepared` text read back as its model."""
        return [(to, m.model() if isinstance(m, Prepared) else m) for to, m in self.sends]

    def event(self, ev: Event) -> None:
        """Something happened: the event, and its line in the log."""
        self.events.append(ev)
        self.logs.append(ev.line)

    def count(self, kind: str) -> int:
        return sum(1 for ev in self.events if ev.kind == kind)

    @property
    def rounds_opened(self) -> int:
        return self.count("round_opened")

    @property
    def rounds_completed(self) -> int:
        return self.count("round_completed")

    @property
    def restarts(self) -> int:
        """Restarts charged against the budget."""
        return self.count("restart_charged")

    def merge(self, other: Effects) -> Effects:
        self.sends.extend(other.sends)
        self.persist |= other.persist
        self.logs.extend(other.logs)
        self.events.extend(other.events)
        self.evicted.extend(other.evicted)
        self.host_failures.extend(other.host_failures)
        return self


_DIGITS = re.compile(r"(\d+)")


def natural_key(node: Node) -> tuple[tuple[int | str, ...], str]:
    """``node2`` before ``node10``; then node id. re.split alternates str/int."""
    parts: list[Any] = _DIGITS.split(node.host.lower())  # (a digit has no case)
    parts[1::2] = map(int, parts[1::2])
    return tuple(parts), node.node_id


def node_secret_hash(secret: str) -> str:
    """What the job keeps of a node's secret (random, so a plain hash will do)."""
    return hashlib.sha256(secret.encode()).hexdigest()


def job_secret_hash(job_id: str, secret: str) -> str:
    """What the job keeps of its job secret: a hash salted with the job id, so
    equal secrets of two jobs do not show as equal."""
    return hashlib.sha256(f"rdzv job secret\0{job_id}\0{secret}".encode()).hexdigest()


def blocked(job: Job, node: Node, now: float) -> str | None:
    """Why ``node`` may not be admitted now: its host is cordoned, or cooled
    down while the job has ``min_nodes`` nodes of other, unblocked hosts (a
    cool-down never stalls a job that cannot form without the host: one host
    running every node of a job, a single-node job)."""
    gate = job.gate
    if gate is None:
        return None
    why = gate.blocked(node.host, now)
    if why is None or gate.cordoned(node.host, now):
        return why
    others = 0
    for other in job.nodes.values():  # only for a node of a cooled-down host: rare
        if other.host != node.host and gate.blocked(other.host, now) is None:
            others += 1
            if others >= job.spec.min_nodes:
                return why
    return None


def count(job: Job, state: NodeState) -> int:
    """How many of the job's nodes are in ``state`` (O(1))."""
    return job.counts.get(state, 0)


def move(job: Job, node: Node, state: NodeState | None) -> None:
    """The one place a node's state changes: check the transition, keep the
    counts. ``None`` removes the node from the job."""
    if state not in TRANSITIONS.get(node.state, ()):
        raise IllegalTransitionError(
            f"illegal node state transition for node {node.node_id!r} of job {job.job_id!r}: {node.state} -> {state}"
        )
    if state is None:  # the node keeps its last state, for whoever still holds it
        del job.nodes[node.node_id]
    if node.state is not None:
        job.counts[node.state] -= 1
    if state is None:
        return
    node.state = state
    job.counts[state] = job.counts.get(state, 0) + 1
