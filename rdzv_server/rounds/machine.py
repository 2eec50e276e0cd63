"""The round state machine of one job: its steps (reports, disconnects, time;
a join is in :mod:`.joins`). Pure, no I/O, no clock; the data it works on is
in :mod:`.model`.

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
    any --budget spent / join timeout / restart storm / a node gave up--> failed;  any --close--> closed
    succeeded / failed / closed --a fresh join--> waiting (the job id's next run; see new_run)

Node states: ``waiting`` (joined the forming round, or queued for a scale-up),
``rejoining`` (member of the previous round, alive, stopping its workers),
``running``, ``succeeded``, ``spare`` (beyond max_nodes): :class:`.model.NodeState`,
changed only through :func:`.model.move` (the table of allowed transitions).
A round that re-forms completes as soon as no node is ``rejoining`` and at
least ``min_nodes`` wait.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Literal

from rdzv_common.protocol import (
    DoneMsg,
    EvictedError,
    EvictedMsg,
    ExitRecord,
    JobFinishedError,
    JobSpec,
    JobState,
    RestartMsg,
    StaleRoundError,
    StatusMsg,
    printable,
)
from rdzv_common.sizes import MAX_CAUSE_BYTES, MAX_REASON_BYTES, clip

from . import departed, events
from .culprit import culprit
from .forming import _check_complete, _complete, direct, reform_directly
from .model import (
    REJOINING,
    RUNNING,
    SPARE,
    SUCCEEDED,
    WAITING,
    Effects,
    Job,
    Node,
    RoundRecord,
    RunRecord,
    blocked,
    count,
    job_secret_hash,
    move,
)
from .records import add_round
from .views import waiting_info

# The job state a done message names (only an ended job gets one).
_DONE_STATE: dict[JobState, Literal["succeeded", "failed", "closed"]] = {
    JobState.SUCCEEDED: "succeeded",
    JobState.FAILED: "failed",
    JobState.CLOSED: "closed",
}

STATUS_PUSH_INTERVAL_S = 1.0
# status messages a forming round sends per second, at most: a big round pushes less often
# (16,384 waiting nodes: every 16 s), or its status alone would be N messages a second
MAX_STATUS_RATE = 1000.0
MAX_HISTORY = 200  # round records a job keeps (its first two and the newest; see _open_round)
MAX_RUNS = 20  # summaries of a job id's previous runs kept (older ones are dropped)


# ------------------------------------------------------------------- create


def new_job(job_id: str, spec: JobSpec, now: float, job_secret: str | None = None) -> Job:
    job = Job(job_id=job_id, spec=spec, created_at=now)
    if job_secret is not None:
        job.secret_hash = job_secret_hash(job_id, job_secret)
    job.history.append(RoundRecord(round=0, reason="job created", started_at=now))
    job.join_deadline = now + spec.join_timeout_s
    return job


def new_run(job: Job, spec: JobSpec, now: float, job_secret: str | None = None) -> None:
    """A finished job id starts its next run (a fresh join, see joins.starts_run):
    the run that ended is kept as a summary (the latest MAX_RUNS), everything
    else starts over as for a new job, with the settings and job secret of the
    join that starts it. The job keeps its id, creation time and listing place."""
    assert job.finished
    job.runs.append(
        RunRecord(
            run=job.run,
            state=job.state.value,
            reason=job.end_reason or "",
            root_cause=job.root_cause,
            started_at=job.run_started_at if job.run_started_at is not None else job.created_at,
            ended_at=job.ended_at if job.ended_at is not None else now,
            rounds=job.round + 1,
            restarts=job.restarts,
        )
    )
    del job.runs[:-MAX_RUNS]
    ended = f"run {job.run} {job.state.value}"
    fresh = new_job(job.job_id, spec, now, job_secret)
    for f in fields(Job):
        if f.name not in ("created_at", "runs", "gate", "probe_seed", "heartbeat_s"):
            setattr(job, f.name, getattr(fresh, f.name))
    job.run = job.runs[-1].run + 1
    job.run_started_at = now
    job.history[0].reason = f"run {job.run} started ({ended})"


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


def _member(job: Job, node_id: str, round_no: int, what: str) -> Node:
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
        raise StaleRoundError(
            f"node {node_id!r} already succeeded in round {job.round}; a failure report cannot follow its success"
        )
    first = min(failures, key=lambda r: (r.timestamp or float("inf"), r.rank))
    # signal and message came over the network: one line, control characters escaped
    cause = clip(printable(f"node {node.node_id} ({node.host}) {first.describe()}"), MAX_CAUSE_BYTES)
    fx = Effects()
    # (nodes restored from disk and not back yet are not gone: they have a heartbeat timeout)
    gone = [n for n in job.order if n in job.nodes and job.nodes[n].state == RUNNING and job.nodes[n].dropped]
    if gone:
        # A member's connection already dropped: its death is the root cause and this
        # failure its echo (a collective lost its peer). Lose it now, charge nothing.
        fx.event(events.node_failed(job, node, failures, cause))
        for node_id in gone:
            if node_id in job.nodes:
                fx.merge(
                    _lose(job, node_id, job.nodes[node_id].lost_why or "connection lost", now, evict=True, lost=True)
                )
        return fx
    if all(r.reason == "collective" for r in failures):
        # In-place mode: a parked worker's echo, and no member is known gone: the
        # cause (a peer's own failure report) follows, or the agent's plain report
        # of the same worker a second later (design.md "In-place re-formation").
        # Nothing happened: no node_failed event.
        return Effects()
    fx.event(events.node_failed(job, node, failures, cause))
    job.culprit = culprit(job.round, node.node_id, node.host, first, cause)
    # In-place mode's rank 0 found the round's store port (its agent's pick at join) taken by
    # another process: neither the training's fault nor the host's. A new round (fresh ports),
    # not charged; a storm of them still ends the job.
    port_taken = all(r.reason == "store_port" for r in failures)
    if not port_taken:
        fx.host_failures.append((node.host, f"worker failure: {first.describe()}"))
    if job.restarts >= job.spec.max_restarts and not port_taken:
        job.root_cause = cause
        return fx.merge(
            _end(job, JobState.FAILED, f"restart budget of {job.spec.max_restarts} spent; last failure: {cause}", now)
        )
    if storm(job, now):  # (no root_cause: the job view shows this reason, the failure in it)
        return fx.merge(
            _end(
                job,
                JobState.FAILED,
                f"no progress in {job.no_progress} restarts; last failure: {cause}",
                now,
                stop="no_progress",
            )
        )
    if port_taken:
        return fx.merge(_open_round(job, f"store port taken, not charged: {cause}", now))
    job.restarts += 1
    # a failure that cools its host down holds its node out of the next round at its join: it must join
    cools = job.gate is not None and not port_taken and job.gate.cools_down(node.host, now)
    opened = _open_round(
        job, f"worker failure: {cause} (restart {job.restarts}/{job.spec.max_restarts})", now, may_place=not cools
    )
    fx.event(events.restart_charged(job))  # (the round it opened, that round's reason)
    return fx.merge(opened)


def give_up(job: Job, node_id: str, round_no: int, failures: list[ExitRecord], now: float) -> Effects:
    """A node's launcher stops for good after its workers failed in ``round_no``
    (torchrun's own ``--max-restarts`` is spent): it will neither restart nor
    rejoin, so the job cannot go on as its other nodes expect. It fails now and
    every node is told (``done``), as when the server's own budget is spent;
    nothing is charged. The root cause is what broke that round first: a member
    whose connection had already dropped, or whatever opened the next round
    before this report; else this failure."""
    if job.finished:
        raise JobFinishedError(f"job {job.job_id!r} already {job.state.value}")
    node = job.nodes.get(node_id)
    if node is None:
        raise EvictedError(f"node {node_id!r} is not part of job {job.job_id!r} (evicted?)")
    if node.state == SUCCEEDED or round_no > job.round:
        raise StaleRoundError(
            f"give-up for round {round_no} from node {node_id!r} is stale: job {job.job_id!r} is at round "
            f"{job.round}{' and the node succeeded' if node.state == SUCCEEDED else ''}"
        )
    # only a member of that round may end the job: running in it, or (its round over) not rejoined since;
    # a spare or a node queued for a later round has no workers of round_no to give up on
    if node.state != (RUNNING if round_no == job.round else REJOINING):
        raise StaleRoundError(
            f"give-up for round {round_no} from node {node_id!r} ({node.state}): it was not a member of that "
            f"round of job {job.job_id!r}"
        )
    first = min(failures, key=lambda r: (r.timestamp or float("inf"), r.rank))
    cause = clip(printable(f"node {node.node_id} ({node.host}) {first.describe()}"), MAX_CAUSE_BYTES)
    root = cause
    if round_no < job.round:  # its round had already ended: what ended it came first
        root = next((r.reason for r in reversed(job.history) if r.round == round_no + 1), cause)
    else:
        gone = [n for n in job.order if n in job.nodes and job.nodes[n].state == RUNNING and job.nodes[n].dropped]
        if gone:  # a collective lost its peer: the peer's death is the root cause
            root = f"node {gone[0]} ({job.nodes[gone[0]].host}) connection lost"
    fx = Effects()
    fx.event(events.node_failed(job, node, failures, cause))
    if root == cause:
        fx.host_failures.append((node.host, f"worker failure: {first.describe()}"))
        job.culprit = culprit(round_no, node.node_id, node.host, first, cause)
    job.root_cause = root
    why = clip(
        printable(
            f"node {node.node_id} ({node.host}) gave up (its launcher's restart budget is spent) after "
            f"{first.describe()}"
        ),
        MAX_CAUSE_BYTES,
    )
    return fx.merge(_end(job, JobState.FAILED, why + ("" if root == cause else f"; first: {root}"), now))


def storm(job: Job, now: float) -> bool:
    """A worker failure ends the running round: count it as a restart without
    progress unless a node reported a step beyond the highest seen when the round
    began, or the round ran ``min_round_s`` (scripts that never call progress()).
    True: ``storm_restarts`` restarts in a row brought none, the job must stop."""
    if not job.spec.storm_restarts:
        return False  # off
    began = job.history[-1].completed_at if job.history else None
    moved = job.max_step is not None and (job.round_step is None or job.max_step > job.round_step)
    lasted = began is not None and now - began >= job.spec.min_round_s
    if moved or lasted:
        job.no_progress = 0
        return False
    if job.spec.storm_restarts and job.no_progress >= job.spec.storm_restarts:
        return True
    job.no_progress += 1
    return False


def succeed(job: Job, node_id: str, round_no: int, now: float) -> Effects:
    """A node's workers all exited 0. The job succeeds when every member has.
    A repeat from a node that already succeeded in this round (a lost ack)
    changes nothing and asks for no write."""
    node = job.nodes.get(node_id)
    if node is not None and node.state == SUCCEEDED and round_no == job.round:
        return Effects()
    node = _member(job, node_id, round_no, "success report")
    move(job, node, SUCCEEDED)
    fx = Effects(persist=True)
    fx.event(events.node_succeeded(job, node))
    if count(job, RUNNING) == 0:  # members are running or succeeded: O(1), not a scan per report
        fx.merge(_end(job, JobState.SUCCEEDED, f"all {len(job.order)} nodes of round {job.round} succeeded", now))
    return fx


def leave(job: Job, node_id: str, reason: str, now: float) -> Effects:
    """A node leaves on purpose (SIGTERM to its agent): re-form without it now."""
    if job.finished or job.nodes.get(node_id) is None:
        return Effects()  # a finished job stays finished; agents leave after DoneMsg
    return _lose(job, node_id, f"left ({printable(reason)})", now, evict=False, lost=True)


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
        node.last_seen = max(node.last_seen, now)
        if not node.connected:  # never sooner than a grace it has already (a failover's, longer)
            node.lost_deadline = max(node.lost_deadline or now, now + timeout)
            node.dropped = False  # the drop was the server's doing, not the node's death
    if stall and job.graced_at is not None and now - job.graced_at < timeout:
        return
    if stall:
        job.graced_at = now
    if job.last_call_deadline is not None:
        job.last_call_deadline = max(job.last_call_deadline, now + job.spec.last_call_s)
    if job.join_deadline is not None:
        job.join_deadline = max(job.join_deadline, now + timeout)


def restored(job: Job, now: float, extra_s: float = 0.0) -> None:
    """A job loaded from disk (or by a new HA leader): nobody is connected yet;
    give everyone a heartbeat timeout, plus ``extra_s``, to come back."""
    for node in job.nodes.values():
        node.connected, node.dropped, node.lost_deadline = False, False, None
    grace(job, now)
    for node in job.nodes.values():
        node.lost_deadline = now + job.spec.heartbeat_timeout_s + extra_s


def tick(job: Job, now: float) -> Effects:
    """Time passes: lose silent or disconnected nodes, fire last call, scale-up,
    join timeout, and push throttled status while a round forms."""
    fx = Effects()
    if job.finished:
        return fx
    if line := events.comebacks_held(job, now):
        fx.logs.append(line)
    timeout = job.spec.heartbeat_timeout_s
    for node in list(job.nodes.values()):
        if node.state == SUCCEEDED:
            continue
        if node.lost_deadline is not None:  # not connected: judged by the grace it was given
            if now >= node.lost_deadline:
                fx.merge(_lose(job, node.node_id, node.lost_why or "connection lost", now, evict=True, lost=True))
        elif now - node.last_seen >= timeout:
            fx.host_failures.append((node.host, f"evicted: no heartbeat for {timeout:g}s"))
            fx.merge(_lose(job, node.node_id, f"no heartbeat for {timeout:g}s", now, evict=True, lost=False))
        if job.finished:
            return fx
    if job.forming:
        if job.last_call_deadline is not None and now >= job.last_call_deadline:
            fx.merge(_complete(job, now))
        elif job.join_deadline is not None and now >= job.join_deadline:
            joined = count(job, WAITING)
            missing = [n for n in job.prev_order if n in job.nodes and job.nodes[n].state == REJOINING]
            why = (
                f"previous member(s) {', '.join(missing[:8])} never rejoined"
                if missing and joined >= job.spec.min_nodes
                else f"{joined} of min {job.spec.min_nodes} nodes joined"
            )
            fx.merge(_end(job, JobState.FAILED, f"join timeout: {why} within {job.spec.join_timeout_s:g}s", now))
            return fx
    elif job.scale_up_deadline is not None and now >= job.scale_up_deadline:
        newcomers = [n.node_id for n in job.nodes.values() if n.state == WAITING]
        job.scale_up_deadline = None
        if newcomers:
            fx.merge(_open_round(job, f"scale-up: {len(newcomers)} new node(s) {', '.join(newcomers[:8])}", now))
    if job.forming and job.status_dirty and now >= job.next_status_at:
        job.status_dirty = False
        info = waiting_info(job, now)
        assert info is not None  # job.forming
        status = StatusMsg(round=job.round, waiting_for=info)  # one message for all
        told = [n.node_id for n in job.nodes.values() if n.state in (WAITING, SPARE) and n.connected]
        for node_id in told:
            fx.send(node_id, status)
        job.next_status_at = now + max(STATUS_PUSH_INTERVAL_S, len(told) / MAX_STATUS_RATE)
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
        if node.lost_deadline is not None:
            due = min(due, node.lost_deadline)
        elif node.last_seen + timeout < due:
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


def _lose(job: Job, node_id: str, why: str, now: float, *, evict: bool, lost: bool) -> Effects:
    """The node is out of the job. ``evict``: the server drops its connection
    (told why); ``lost``: it left or its connection stayed lost (node_lost),
    else the server gave up on a silent node (node_evicted)."""
    node = job.nodes[node_id]
    move(job, node, None)
    departed.note(job.departed, node_id, node.host, job.round, why, now)
    fx = Effects()
    if evict:
        fx.evicted.append(node_id)
        fx.send(node_id, EvictedMsg(reason=f"node {node_id} {why}"))
    fx.event(events.node_gone(job, node, why, lost=lost))
    job.status_dirty = True
    if node.state == RUNNING and not job.forming:
        return fx.merge(_open_round(job, f"node {node_id} ({node.host}) {why}", now))
    if job.forming:
        fx.merge(_check_complete(job, now))
    return fx


def _open_round(job: Job, reason: str, now: float, may_place: bool = True) -> Effects:
    """Round r+1 opens: running members must stop their workers and rejoin; or,
    when the server can place them itself, it is formed at once and each
    member's ``restart`` carries its place (:func:`.forming.reform_directly`)."""
    fx = Effects(persist=True)
    previous = job.state.value
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
    reason = clip(reason, MAX_REASON_BYTES)
    rec = RoundRecord(round=job.round, reason=reason, started_at=now)
    add_round(job, rec, MAX_HISTORY)
    rejoining: list[Node] = []
    for node in list(job.nodes.values()):
        node.group_rank, node.rank_offset = None, 0  # ranks are the next round's to give
        if node.state == RUNNING:
            move(job, node, REJOINING)
            rejoining.append(node)
        elif node.state == SUCCEEDED:
            move(job, node, None)  # it exited; it will not come back
            departed.note(job.departed, node.node_id, node.host, job.round - 1, "succeeded", now)
        elif node.state == SPARE and blocked(job, node, now) is None:
            node.note = None
            move(job, node, WAITING)
    placed = may_place and direct(job, rejoining, now)
    fx.event(events.round_opened(job, rec, job.prev_order, placed))
    if previous != job.state.value:
        fx.event(events.job_state(job, previous))
    if placed:
        return fx.merge(reform_directly(job, rejoining, reason, now))
    restart = RestartMsg(round=job.round, reason=reason)  # one message for all members
    for node in rejoining:
        fx.send(node.node_id, restart)
    return fx.merge(_check_complete(job, now))


def _end(job: Job, state: JobState, reason: str, now: float, stop: Literal["no_progress"] | None = None) -> Effects:
    reason = clip(reason, MAX_REASON_BYTES)
    previous = job.state.value
    job.state = state
    job.end_reason = reason
    job.ended_at = now
    job.texts = job.peer_texts = None  # (no member is told its place again)
    job.last_call_deadline = job.join_deadline = job.scale_up_deadline = None
    fx = Effects(persist=True)
    msg = DoneMsg(state=_DONE_STATE[state], reason=reason, root_cause=job.root_cause, stop=stop)
    for node_id in job.nodes:
        fx.send(node_id, msg)
    fx.event(events.job_state(job, previous, f"job {job.job_id} round {job.round}: {state.value}: {reason}"))
    return fx
