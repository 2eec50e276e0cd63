"""The round state machine of one job: pure, no I/O, no clock.

Every operation takes the job, an event and ``now`` (seconds, any epoch), checks
the event, and only then changes the job; it returns :class:`Effects`: what to
tell whom, whether the change must be made durable before anyone hears of it,
and what to log. A refused event raises an :class:`RdzvError` and leaves the job
exactly as it was.

Life of a job::

    waiting (round r forms) --complete--> running (round r)
       ^                                    |  node lost / left, worker failure,
       |                                    |  scale-up: round r+1 opens
       +------------------------------------+
    running --all members succeeded--> succeeded
    any --budget spent / join timeout--> failed;  any --close--> closed

Node states: ``waiting`` (joined the forming round, or queued for a scale-up),
``rejoining`` (member of the previous round, alive, stopping its workers),
``running``, ``succeeded``, ``spare`` (beyond max_nodes). A round that re-forms
completes as soon as no node is ``rejoining`` and at least ``min_nodes`` wait.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass, field
from typing import Any

from .protocol import (
    AssignedMsg,
    Assignment,
    DoneMsg,
    EvictedError,
    EvictedMsg,
    ExitRecord,
    JobFinishedError,
    JobSecretMismatchError,
    JobSpec,
    JobState,
    JobSummary,
    JobView,
    JoinedMsg,
    JoinMsg,
    NodeSecretMismatchError,
    NodeView,
    RestartMsg,
    RoundView,
    SpareMsg,
    SpecMismatchError,
    StaleRoundError,
    StatusMsg,
    TERMINAL_STATES,
    WaitingInfo,
    heartbeat_interval,
    printable,
)

WAITING = "waiting"
REJOINING = "rejoining"
RUNNING = "running"
SUCCEEDED = "succeeded"
SPARE = "spare"

STATUS_PUSH_INTERVAL_S = 1.0
MAX_HISTORY = 1000
MAX_VIEW_NODES = 10_000  # a job view lists at most this many nodes (members first, by rank)
MAX_VIEW_HISTORY = 100  # and the latest this many rounds


@dataclass
class Node:
    node_id: str
    host: str
    addr: str
    local_world_size: int
    master_port: int
    requested_rank: int | None
    last_seen: float
    state: str = ""  # set only through _set_state, which keeps Job.counts
    group_rank: int | None = None
    rank_offset: int = 0
    connected: bool = True
    lost_deadline: float | None = None
    dropped: bool = False  # its connection dropped (not merely restored from disk)
    joined_at: float = 0.0
    graced: bool = False  # given a stall grace and not heard from since (see grace)
    secret_hash: str | None = None  # sha256 of the secret it was issued; None: saved before secrets existed


@dataclass
class RoundRecord:
    round: int
    reason: str
    started_at: float
    completed_at: float | None = None
    world_size: int | None = None
    nodes: int | None = None


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
    counts: dict[str, int] = field(default_factory=dict)  # nodes per state, kept by _set_state
    graced_at: float | None = None  # when a stall last extended the job's own deadlines
    secret_hash: str | None = None  # the job secret's hash (see job_secret_hash); None: no job secret

    @property
    def forming(self) -> bool:
        return self.state == JobState.WAITING

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL_STATES


@dataclass
class Effects:
    """What the caller must do after a step, in order: persist, then send, then log."""

    sends: list[tuple[str, Any]] = field(default_factory=list)
    persist: bool = False
    logs: list[str] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)
    rounds_opened: int = 0
    rounds_completed: int = 0
    restarts: int = 0

    def send(self, node_id: str, msg: Any) -> None:
        self.sends.append((node_id, msg))

    def merge(self, other: "Effects") -> "Effects":
        self.sends.extend(other.sends)
        self.persist |= other.persist
        self.logs.extend(other.logs)
        self.evicted.extend(other.evicted)
        self.rounds_opened += other.rounds_opened
        self.rounds_completed += other.rounds_completed
        self.restarts += other.restarts
        return self


_DIGITS = re.compile(r"(\d+)")


def natural_key(node: Node) -> tuple:
    """``node2`` before ``node10``; then node id. re.split alternates str/int."""
    parts = _DIGITS.split(node.host)
    return tuple(int(p) if i % 2 else p.lower() for i, p in enumerate(parts)), node.node_id


# ------------------------------------------------------------------- create


def node_secret_hash(secret: str) -> str:
    """What the job keeps of a node's secret (random, so a plain hash will do)."""
    return hashlib.sha256(secret.encode()).hexdigest()


def job_secret_hash(job_id: str, secret: str) -> str:
    """What the job keeps of its job secret: a hash salted with the job id, so
    equal secrets of two jobs do not show as equal."""
    return hashlib.sha256(f"rdzv job secret\0{job_id}\0{secret}".encode()).hexdigest()


def new_job(job_id: str, spec: JobSpec, now: float, job_secret: str | None = None) -> Job:
    job = Job(job_id=job_id, spec=spec, created_at=now)
    if job_secret is not None:
        job.secret_hash = job_secret_hash(job_id, job_secret)
    job.history.append(RoundRecord(round=0, reason="job created", started_at=now))
    job.join_deadline = now + spec.join_timeout_s
    return job


# --------------------------------------------------------------------- join


def _check_job_secret(job: Job, msg: JoinMsg) -> None:
    if job.secret_hash is None:
        if msg.job_secret is not None:
            raise JobSecretMismatchError(
                f"job {job.job_id!r} was created without a job secret, but this join brings one: "
                "another job uses this id; pick another job id")
        return
    if msg.job_secret is None:
        raise JobSecretMismatchError(
            f"job {job.job_id!r} requires a job secret (--job-secret or RDZV_JOB_SECRET); this join brings none")
    if not hmac.compare_digest(job.secret_hash, job_secret_hash(job.job_id, msg.job_secret)):
        raise JobSecretMismatchError(f"wrong job secret for job {job.job_id!r}")


def _show(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _check_spec(job: Job, msg: JoinMsg) -> None:
    spec, asked = job.spec, msg.spec
    if asked == spec:  # the common case, and the cheap one
        return
    if (asked.min_nodes, asked.max_nodes) != (spec.min_nodes, spec.max_nodes):
        raise SpecMismatchError(
            f"job {job.job_id!r} has nnodes {spec.min_nodes}:{spec.max_nodes}, "
            f"but node {msg.node_id!r} asked for {asked.min_nodes}:{asked.max_nodes}"
        )
    differ = [f"{name} {_show(getattr(spec, name))}, but node {msg.node_id!r} asked for {_show(getattr(asked, name))}"
              for name in type(spec).model_fields if getattr(spec, name) != getattr(asked, name)]
    if differ:
        raise SpecMismatchError(f"job {job.job_id!r} has " + "; and ".join(differ)
                                + " (every node of a job must use the same settings)")


def _check_node_secret(job: Job, node: Node, msg: JoinMsg) -> None:
    if node.secret_hash is None:
        return  # saved before node secrets existed
    given = node_secret_hash(msg.node_secret) if msg.node_secret is not None else ""
    if not hmac.compare_digest(node.secret_hash, given):
        raise NodeSecretMismatchError(
            f"node {node.node_id!r} of job {job.job_id!r} is held by another agent: this join "
            f"{'carries a wrong' if msg.node_secret else 'does not carry its'} node secret; "
            "a new agent joins with a new node id")


def join(job: Job, msg: JoinMsg, now: float, node_secret: str | None = None) -> Effects:
    """A node joins the forming round, queues for a scale-up, becomes a spare,
    or (with ``resume_round``) reconnects to the round it still runs.

    A join that creates the node gives it ``node_secret`` (the caller draws a
    fresh random one), sent back in ``joined``; every later join naming that
    node must carry it. The job secret and the whole spec must match the job's."""
    if job.finished:
        raise JobFinishedError(f"job {job.job_id!r} already {job.state.value}: {job.end_reason}; use a new job id")
    _check_job_secret(job, msg)
    spec = job.spec
    _check_spec(job, msg)
    node = job.nodes.get(msg.node_id)
    if node is not None:
        _check_node_secret(job, node, msg)
    issued = None  # the secret sent in `joined`: only to the join that created the node
    fx = Effects()
    if (node is not None and node.state == RUNNING and not job.forming
            and msg.resume_round in (None, job.round)):
        # A reconnect of a member of the running round: with resume_round its workers
        # run on; without, its assignment was sent while it was away (a round that
        # completed during a server restart or a reconnect). Either way: the same
        # assignment again, nothing else changes.
        node.connected, node.lost_deadline, node.last_seen, node.dropped = True, None, now, False
        node.graced = False
        fx.send(node.node_id, AssignedMsg(assignment=_assignment(job, node)))
        fx.logs.append(f"job {job.job_id} round {job.round}: node {node.node_id} reconnected")
        return fx
    if msg.resume_round is not None:
        if node is None:
            raise EvictedError(f"node {msg.node_id!r} is not part of job {job.job_id!r} any more (evicted)")
        if node.state == SUCCEEDED:
            raise StaleRoundError(f"node {msg.node_id!r} already reported success in round {job.round}")
        if node.state == RUNNING:  # running in the current round but resuming an older one
            raise StaleRoundError(f"round {msg.resume_round} is over; job {job.job_id!r} runs round {job.round}")
        if node.state == REJOINING:
            # It missed the news: its round is over. Tell it to stop and rejoin.
            node.connected, node.lost_deadline, node.last_seen, node.dropped = True, None, now, False
            node.graced = False
            fx.send(node.node_id, RestartMsg(round=job.round, reason=job.history[-1].reason))
            return fx
        # a waiting/spare node that resumes: fall through and treat as a join
    if node is not None and node.state == SUCCEEDED:
        raise StaleRoundError(f"node {msg.node_id!r} already succeeded in round {job.round}; it cannot join again")
    if node is None:
        node = Node(
            node_id=msg.node_id,
            host=msg.host,
            addr=msg.addr,
            local_world_size=msg.local_world_size,
            master_port=msg.master_port,
            requested_rank=msg.requested_rank,
            last_seen=now,
            joined_at=now,
            secret_hash=node_secret_hash(node_secret) if node_secret is not None else None,
        )
        job.nodes[node.node_id] = node
        issued = node_secret
    else:
        node.host, node.addr = msg.host, msg.addr
        node.local_world_size, node.master_port = msg.local_world_size, msg.master_port
        node.requested_rank = msg.requested_rank
        node.last_seen, node.connected, node.lost_deadline, node.dropped = now, True, None, False
        node.graced = False
    if job.forming:
        _set_state(job, node, WAITING)
        job.status_dirty = True
        done = _check_complete(job, now)
        fx.send(node.node_id, JoinedMsg(round=job.round, node_id=node.node_id, heartbeat_s=heartbeat_interval(spec),
                                        waiting_for=waiting_info(job, now, detail=False), node_secret=issued))
        return fx.merge(done)
    # running: scale up below max, else spare
    fx.send(node.node_id, JoinedMsg(round=job.round + 1, node_id=node.node_id, heartbeat_s=heartbeat_interval(spec),
                                    node_secret=issued))
    queued = job.counts.get(WAITING, 0) - (node.state == WAITING)
    if len(job.order) + queued < spec.max_nodes:
        _set_state(job, node, WAITING)
        if job.scale_up_deadline is None:
            job.scale_up_deadline = now + spec.scale_up_window_s
        fx.logs.append(f"job {job.job_id} round {job.round}: node {node.node_id} ({node.host}) arrived; "
                       f"scale-up in {spec.scale_up_window_s:g}s")
    else:
        _set_state(job, node, SPARE)
        fx.send(node.node_id, SpareMsg(round=job.round))
        fx.logs.append(f"job {job.job_id} round {job.round}: node {node.node_id} ({node.host}) is a spare")
    return fx


def heartbeat(job: Job, node_id: str, now: float) -> None:
    """The fast path: a node is alive. Unknown nodes are ignored (their
    connection is told on their next real message)."""
    node = job.nodes.get(node_id)
    if node is not None:
        node.last_seen = now
        node.graced = False


def disconnect(job: Job, node_id: str, now: float, grace_s: float) -> Effects:
    """The node's connection dropped: lose it unless it is back within grace_s."""
    node = job.nodes.get(node_id)
    if node is None or job.finished:
        return Effects()
    if node.state == SUCCEEDED:
        # it reported success and went away: that is how agents finish
        return Effects()
    node.connected = False
    node.lost_deadline = now + grace_s
    node.dropped = True
    return Effects()


def _member(job: Job, node_id: str, round_no: int, what: str):
    if job.finished:
        raise JobFinishedError(f"job {job.job_id!r} already {job.state.value}")
    node = job.nodes.get(node_id)
    if node is None:
        raise EvictedError(f"node {node_id!r} is not part of job {job.job_id!r} (evicted?)")
    if round_no != job.round or job.forming or node.state not in (RUNNING, SUCCEEDED):
        raise StaleRoundError(
            f"{what} for round {round_no} from node {node_id!r} is stale: job {job.job_id!r} is "
            f"{'forming' if job.forming else 'running'} round {job.round}"
        )
    return node


def fail(job: Job, node_id: str, round_no: int, failures: list[ExitRecord], now: float) -> Effects:
    """A node's workers failed in ``round_no``: restart if the budget allows."""
    node = _member(job, node_id, round_no, "failure report")
    if node.state == SUCCEEDED:
        raise StaleRoundError(f"node {node_id!r} already succeeded in round {job.round}; "
                              "a failure report cannot follow its success")
    first = min(failures, key=lambda r: (r.timestamp or float("inf"), r.rank))
    # signal and message came over the network: one line, control characters escaped
    cause = printable(f"node {node.node_id} ({node.host}) {first.describe()}")
    fx = Effects()
    fx.logs.append(f"job {job.job_id} round {job.round}: worker failure on {cause}")
    # (nodes restored from disk and not back yet are not gone: they have a heartbeat timeout)
    gone = [n for n in job.order if n in job.nodes and job.nodes[n].state == RUNNING and job.nodes[n].dropped]
    if gone:
        # A member's connection already dropped: its death is the root cause and this
        # failure its echo (a collective lost its peer). Lose it now, charge nothing.
        for node_id in gone:
            if node_id in job.nodes:
                fx.merge(_lose(job, node_id, "connection lost", now, evict=True))
        return fx
    if job.restarts >= job.spec.max_restarts:
        job.root_cause = cause
        return fx.merge(_end(job, JobState.FAILED,
                             f"restart budget of {job.spec.max_restarts} spent; first failure: {cause}", now))
    job.restarts += 1
    fx.restarts += 1
    return fx.merge(_open_round(job, f"worker failure: {cause} (restart {job.restarts}/{job.spec.max_restarts})", now))


def succeed(job: Job, node_id: str, round_no: int, now: float) -> Effects:
    """A node's workers all exited 0. The job succeeds when every member has.
    A repeat from a node that already succeeded in this round (a lost ack)
    changes nothing and asks for no write."""
    node = job.nodes.get(node_id)
    if node is not None and node.state == SUCCEEDED and round_no == job.round:
        return Effects()
    node = _member(job, node_id, round_no, "success report")
    _set_state(job, node, SUCCEEDED)
    fx = Effects(persist=True)
    fx.logs.append(f"job {job.job_id} round {job.round}: node {node.node_id} succeeded")
    if _count(job, RUNNING) == 0:  # members are running or succeeded: O(1), not a scan per report
        fx.merge(_end(job, JobState.SUCCEEDED, f"all {len(job.order)} nodes of round {job.round} succeeded", now))
    return fx


def leave(job: Job, node_id: str, reason: str, now: float) -> Effects:
    """A node leaves on purpose (SIGTERM to its agent): re-form without it now."""
    if job.finished or job.nodes.get(node_id) is None:
        return Effects()  # a finished job stays finished; agents leave after DoneMsg
    return _lose(job, node_id, f"left ({printable(reason)})", now, evict=False)


def close(job: Job, now: float) -> Effects:
    if job.finished:
        return Effects()
    return _end(job, JobState.CLOSED, "closed by request", now)


def grace(job: Job, now: float, *, stall: bool = False) -> None:
    """After a server restart or a stall: every node gets a full heartbeat timeout.

    After a stall (``stall=True``) only nodes heard from since their last stall
    grace get one, and the job's own deadlines are extended at most once per
    heartbeat timeout: stalls that repeat (a client looping on a slow request)
    cannot keep a dead node, or a last call, alive forever."""
    timeout = job.spec.heartbeat_timeout_s
    for node in job.nodes.values():
        if stall and node.graced:
            continue  # silent through a whole grace already: the next tick judges it as usual
        node.graced = stall
        node.last_seen = now
        if not node.connected:
            node.lost_deadline = now + timeout
            node.dropped = False  # the drop was the server's doing, not the node's death
    if stall and job.graced_at is not None and now - job.graced_at < timeout:
        return
    if stall:
        job.graced_at = now
    if job.last_call_deadline is not None:
        job.last_call_deadline = max(job.last_call_deadline, now + job.spec.last_call_s)
    if job.join_deadline is not None:
        job.join_deadline = max(job.join_deadline, now + timeout)


def restored(job: Job, now: float) -> None:
    """A job loaded from disk: nobody is connected yet; give everyone a timeout."""
    for node in job.nodes.values():
        node.connected, node.dropped = False, False
    grace(job, now)


def tick(job: Job, now: float) -> Effects:
    """Time passes: lose silent or disconnected nodes, fire last call, scale-up,
    join timeout, and push throttled status while a round forms."""
    fx = Effects()
    if job.finished:
        return fx
    timeout = job.spec.heartbeat_timeout_s
    for node in list(job.nodes.values()):
        if node.state == SUCCEEDED:
            continue
        if node.lost_deadline is not None and now >= node.lost_deadline:
            fx.merge(_lose(job, node.node_id, "connection lost", now, evict=True))
        elif now - node.last_seen >= timeout:
            fx.merge(_lose(job, node.node_id, f"no heartbeat for {timeout:g}s", now, evict=True))
        if job.finished:
            return fx
    if job.forming:
        if job.last_call_deadline is not None and now >= job.last_call_deadline:
            fx.merge(_complete(job, now))
        elif job.join_deadline is not None and now >= job.join_deadline:
            joined = _count(job, WAITING)
            missing = [n for n in job.prev_order if n in job.nodes and job.nodes[n].state == REJOINING]
            why = (f"previous member(s) {', '.join(missing[:8])} never rejoined" if missing and
                   joined >= job.spec.min_nodes else f"{joined} of min {job.spec.min_nodes} nodes joined")
            fx.merge(_end(job, JobState.FAILED, f"join timeout: {why} within {job.spec.join_timeout_s:g}s", now))
            return fx
    elif job.scale_up_deadline is not None and now >= job.scale_up_deadline:
        newcomers = [n.node_id for n in job.nodes.values() if n.state == WAITING]
        job.scale_up_deadline = None
        if newcomers:
            fx.merge(_open_round(job, f"scale-up: {len(newcomers)} new node(s) {', '.join(newcomers[:8])}", now))
    if job.forming and job.status_dirty and now >= job.next_status_at:
        job.status_dirty = False
        job.next_status_at = now + STATUS_PUSH_INTERVAL_S
        info = waiting_info(job, now)
        for node in job.nodes.values():
            if node.state in (WAITING, SPARE) and node.connected:
                fx.send(node.node_id, StatusMsg(round=job.round, waiting_for=info))
    return fx


def next_due(job: Job, nodes: bool = True) -> float | None:
    """The earliest time :func:`tick` could change ``job`` (None: never, it is
    finished). Heartbeats only move it later, so a caller that keeps jobs in a
    heap by this time may recompute it when the job is popped.

    ``nodes=False`` skips the nodes' deadlines (O(1) instead of O(nodes)): they
    only move later, except when a connection drops (``lost_deadline``)."""
    if job.finished:
        return None
    due = float("inf")
    timeout = job.spec.heartbeat_timeout_s
    for node in job.nodes.values() if nodes else ():
        if node.state == SUCCEEDED:
            continue
        if node.lost_deadline is not None and node.lost_deadline < due:
            due = node.lost_deadline
        if node.last_seen + timeout < due:
            due = node.last_seen + timeout
    if job.forming:
        for t in (job.last_call_deadline, job.join_deadline):
            if t is not None and t < due:
                due = t
        if job.status_dirty and job.next_status_at < due:
            due = job.next_status_at
    elif job.scale_up_deadline is not None and job.scale_up_deadline < due:
        due = job.scale_up_deadline
    return due


# ------------------------------------------------------------------ internal


def _count(job: Job, state: str) -> int:
    return job.counts.get(state, 0)


def _set_state(job: Job, node: Node, state: str) -> None:
    if node.state:
        job.counts[node.state] -= 1
    node.state = state
    job.counts[state] = job.counts.get(state, 0) + 1


def _lose(job: Job, node_id: str, why: str, now: float, *, evict: bool) -> Effects:
    node = job.nodes.pop(node_id)
    job.counts[node.state] = job.counts.get(node.state, 0) - 1
    fx = Effects()
    if evict:
        fx.evicted.append(node_id)
        fx.send(node_id, EvictedMsg(reason=f"node {node_id} {why}"))
    fx.logs.append(f"job {job.job_id} round {job.round}: node {node_id} ({node.host}) {why}")
    job.status_dirty = True
    if node.state == RUNNING and not job.forming:
        return fx.merge(_open_round(job, f"node {node_id} ({node.host}) {why}", now))
    if job.forming:
        fx.merge(_check_complete(job, now))
    return fx


def _open_round(job: Job, reason: str, now: float) -> Effects:
    """Round r+1 opens: running members must stop their workers and rejoin."""
    fx = Effects(persist=True, rounds_opened=1)
    job.prev_order = [n for n in job.order if n in job.nodes and job.nodes[n].state == RUNNING]
    job.round += 1
    job.state = JobState.WAITING
    job.order = []
    job.world_size = 0
    job.master_addr = job.master_port = None
    job.last_call_deadline = None
    job.scale_up_deadline = None
    job.join_deadline = now + job.spec.join_timeout_s
    job.status_dirty = True
    job.history.append(RoundRecord(round=job.round, reason=reason, started_at=now))
    del job.history[:-MAX_HISTORY]
    for node in list(job.nodes.values()):
        node.group_rank = None
        if node.state == RUNNING:
            _set_state(job, node, REJOINING)
            fx.send(node.node_id, RestartMsg(round=job.round, reason=reason))
        elif node.state == SUCCEEDED:
            del job.nodes[node.node_id]  # it exited; it will not come back
            job.counts[SUCCEEDED] -= 1
        elif node.state == SPARE:
            _set_state(job, node, WAITING)
    fx.logs.append(f"job {job.job_id} round {job.round} opened: {reason}; "
                   f"waiting for {len(job.prev_order)} node(s) {', '.join(job.prev_order[:16]) or 'nobody'}"
                   f"{' ...' if len(job.prev_order) > 16 else ''}")
    return fx.merge(_check_complete(job, now))


def _check_complete(job: Job, now: float) -> Effects:
    if not job.forming:
        return Effects()
    spec = job.spec
    waiting = _count(job, WAITING)
    if job.prev_order:  # a re-formed round: no last call, the server knows who lives
        # Wait for every live previous member even when max_nodes already wait
        # (promoted spares): otherwise a spare takes its slot and rank 0 moves.
        if _count(job, REJOINING) == 0 and waiting >= spec.min_nodes:
            return _complete(job, now)
        return Effects()
    if waiting >= spec.max_nodes:
        return _complete(job, now)
    if waiting >= spec.min_nodes:
        if job.last_call_deadline is None:
            job.last_call_deadline = now + spec.last_call_s
            job.status_dirty = True
    else:
        job.last_call_deadline = None
    return Effects()


def assign_ranks(prev_order: list[str], candidates: list[Node], world: int) -> tuple[list[Node], list[Node]]:
    """Pick ``world`` members and order them; return (members by group rank, spares).

    1. previous members first, in their previous order, then new nodes in
       natural host order, then node id; the first ``world`` are members;
    2. a surviving previous rank 0 keeps rank 0 (MASTER_ADDR does not move);
    3. a requested rank is honoured when free and < world;
    4. the rest fill the free slots in the order of 1.
    """
    prev_pos = {nid: i for i, nid in enumerate(prev_order)}
    old = sorted((n for n in candidates if n.node_id in prev_pos), key=lambda n: prev_pos[n.node_id])
    new = sorted((n for n in candidates if n.node_id not in prev_pos), key=natural_key)
    ordered = old + new
    members, spares = ordered[:world], ordered[world:]
    slots: list[Node | None] = [None] * len(members)
    placed: set[str] = set()
    if prev_order and members and members[0].node_id == prev_order[0]:
        slots[0] = members[0]
        placed.add(members[0].node_id)
    for node in members:
        r = node.requested_rank
        if node.node_id not in placed and r is not None and r < len(slots) and slots[r] is None:
            slots[r] = node
            placed.add(node.node_id)
    rest = iter(n for n in members if n.node_id not in placed)
    result = [s if s is not None else next(rest) for s in slots]
    return result, spares


def _complete(job: Job, now: float) -> Effects:
    """Freeze the membership: ranks, master, everyone told."""
    candidates = [n for n in job.nodes.values() if n.state == WAITING]
    members, spares = assign_ranks(job.prev_order, candidates, min(len(candidates), job.spec.max_nodes))
    job.order = [n.node_id for n in members]
    job.state = JobState.RUNNING
    job.world_size = sum(n.local_world_size for n in members)
    job.master_addr, job.master_port = members[0].addr, members[0].master_port
    job.last_call_deadline = job.join_deadline = job.scale_up_deadline = None
    rec = job.history[-1]
    rec.completed_at, rec.world_size, rec.nodes = now, job.world_size, len(members)
    fx = Effects(persist=True, rounds_completed=1)
    offset = 0
    for rank, node in enumerate(members):
        _set_state(job, node, RUNNING)
        node.group_rank, node.rank_offset = rank, offset
        offset += node.local_world_size
    for node in spares:
        _set_state(job, node, SPARE)
    for node in members:
        fx.send(node.node_id, AssignedMsg(assignment=_assignment(job, node)))
    for node in spares:
        fx.send(node.node_id, SpareMsg(round=job.round))
    shown = ", ".join(f"{n.node_id}={n.group_rank}" for n in members[:16])
    more = f" (+{len(members) - 16} more)" if len(members) > 16 else ""
    fx.logs.append(f"job {job.job_id} round {job.round} complete: {len(members)} nodes, world size "
                   f"{job.world_size}, master {job.master_addr}:{job.master_port}, spares {len(spares)}; "
                   f"ranks {shown}{more}")
    return fx


def _assignment(job: Job, node: Node) -> Assignment:
    return Assignment(
        job_id=job.job_id,
        round=job.round,
        group_rank=node.group_rank,
        group_world_size=len(job.order),
        local_world_size=node.local_world_size,
        rank_offset=node.rank_offset,
        world_size=job.world_size,
        master_addr=job.master_addr,
        master_port=job.master_port,
        max_restarts=job.spec.max_restarts,
        restarts=job.restarts,
    )


def _end(job: Job, state: JobState, reason: str, now: float) -> Effects:
    job.state = state
    job.end_reason = reason
    job.ended_at = now
    job.last_call_deadline = job.join_deadline = job.scale_up_deadline = None
    fx = Effects(persist=True)
    msg = DoneMsg(state=state.value, reason=reason, root_cause=job.root_cause)
    for node_id in job.nodes:
        fx.send(node_id, msg)
    fx.logs.append(f"job {job.job_id} round {job.round}: {state.value}: {reason}")
    return fx


# --------------------------------------------------------------------- views


def waiting_info(job: Job, now: float, detail: bool = True) -> WaitingInfo | None:
    """What a forming round waits for, in words and in fields. ``detail=False``
    skips naming the missing nodes (O(n)), for the per-join fast path."""
    if not job.forming:
        return None
    spec = job.spec
    joined = _count(job, WAITING)
    missing = [n for n in job.prev_order if n in job.nodes and job.nodes[n].state == REJOINING] if detail else []
    parts = []
    if not detail and _count(job, REJOINING):
        parts.append(f"{_count(job, REJOINING)} previous member(s) not back")
    if missing:
        parts.append(f"previous members not back: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))
    if joined < spec.min_nodes:
        parts.append(f"{spec.min_nodes - joined} more node(s) to reach min {spec.min_nodes}")
    if job.last_call_deadline is not None:
        parts.append(f"last call until {job.last_call_deadline:.3f} ({max(0.0, job.last_call_deadline - now):.1f}s "
                     f"left, or {spec.max_nodes - joined} more to reach max {spec.max_nodes})")
    return WaitingInfo(
        text="; ".join(parts) or "completing",
        joined=joined,
        min_nodes=spec.min_nodes,
        max_nodes=spec.max_nodes,
        spares=_count(job, SPARE),
        missing=missing[:64],
        last_call_deadline=job.last_call_deadline,
    )


def _node_view(node: Node, now: float, job_state: JobState | None = None) -> NodeView:
    if job_state in TERMINAL_STATES:
        state = job_state.value  # the job ended: its nodes no longer read "running"
    else:
        state = node.state if node.connected else "disconnected"
    return NodeView(node_id=node.node_id, host=node.host, addr=node.addr, state=state,
                    group_rank=node.group_rank, requested_rank=node.requested_rank,
                    local_world_size=node.local_world_size, last_seen_s=round(max(0.0, now - node.last_seen), 3))


def view(job: Job, now: float) -> JobView:
    """The job for REST, bounded: at most MAX_VIEW_NODES nodes (members in rank
    order first, spares last) and the latest MAX_VIEW_HISTORY rounds; the
    ``*_omitted`` fields count what was left out."""
    members = [job.nodes[n] for n in job.order if n in job.nodes]
    in_order = set(job.order)
    others = sorted((n for n in job.nodes.values() if n.node_id not in in_order and n.state != SPARE),
                    key=natural_key)
    spares = sorted((n for n in job.nodes.values() if n.state == SPARE), key=natural_key)
    listed = (members + others)[:MAX_VIEW_NODES]
    spares_listed = spares[:max(0, MAX_VIEW_NODES - len(listed))]
    nodes_omitted = len(members) + len(others) + len(spares) - len(listed) - len(spares_listed)
    history = job.history[-MAX_VIEW_HISTORY:]
    return JobView(
        job_id=job.job_id, state=job.state, round=job.round,
        min_nodes=job.spec.min_nodes, max_nodes=job.spec.max_nodes, world_size=job.world_size,
        restarts=job.restarts, max_restarts=job.spec.max_restarts,
        master_addr=job.master_addr, master_port=job.master_port,
        nodes=[_node_view(n, now, job.state) for n in listed],
        spares=[_node_view(n, now, job.state) for n in spares_listed],
        waiting_for=waiting_info(job, now),
        root_cause=job.root_cause or (job.end_reason if job.state == JobState.FAILED else None),
        history=[RoundView(round=r.round, reason=r.reason, started_at=r.started_at, completed_at=r.completed_at,
                           world_size=r.world_size, nodes=r.nodes) for r in history],
        nodes_omitted=nodes_omitted,
        history_omitted=len(job.history) - len(history),
    )


def summary(job: Job) -> JobSummary:
    return JobSummary(job_id=job.job_id, state=job.state, round=job.round, min_nodes=job.spec.min_nodes,
                      max_nodes=job.spec.max_nodes,
                      nodes=len(job.order) if job.order else _count(job, WAITING) + _count(job, REJOINING),
                      spares=_count(job, SPARE), world_size=job.world_size,
                      restarts=job.restarts, max_restarts=job.spec.max_restarts)


# --------------------------------------------------------------- durability


def to_record(job: Job) -> dict:
    """The job as plain JSON-able data (for the store's database)."""
    d = {k: getattr(job, k) for k in Job.__dataclass_fields__ if k not in ("spec", "nodes", "history", "state", "counts")}
    d["spec"] = job.spec.model_dump()
    d["state"] = job.state.value
    d["nodes"] = [vars(n).copy() for n in job.nodes.values()]
    d["history"] = [vars(r).copy() for r in job.history]
    return d


def from_record(d: dict) -> Job:
    d = dict(d)
    spec = JobSpec(**d.pop("spec"))
    nodes = {n["node_id"]: Node(**n) for n in d.pop("nodes")}
    history = [RoundRecord(**r) for r in d.pop("history")]
    state = JobState(d.pop("state"))
    d.pop("counts", None)
    job = Job(spec=spec, nodes=nodes, history=history, state=state, **d)
    for node in nodes.values():
        job.counts[node.state] = job.counts.get(node.state, 0) + 1
    return job
