"""A join and its named cases (the round machine's busiest step). Pure, like
:mod:`.machine`, whose helpers it uses to complete a round and build an
assignment.

Order of checks: the run (a late agent of a finished or earlier run is told
``job_finished``; a fresh join to a finished job starts its next run if it
owns the id: :func:`check_owner`), the job secret, the whole spec, and for a
known node its node secret; only then does anything change."""

from __future__ import annotations

import hmac
from typing import Any

from rdzv_common.protocol import (
    EvictedError,
    JobFinishedError,
    JobSecretMismatchError,
    JoinMsg,
    NodeSecretMismatchError,
    RestartMsg,
    SpareMsg,
    SpecMismatchError,
    StaleRoundError,
)

from . import events, templates
from .events import note
from .forming import _check_complete, told_again
from .machine import new_run
from .model import (
    REJOINING,
    RUNNING,
    SPARE,
    SUCCEEDED,
    WAITING,
    Effects,
    Job,
    Node,
    blocked,
    count,
    job_secret_hash,
    move,
    node_secret_hash,
)
from .pace import told_interval
from .probe_addr import probe_addr
from .templates import Prepared
from .views import waiting_fields


def _check_job_secret(job: Job, msg: JoinMsg) -> None:
    if job.secret_hash is None:
        if msg.job_secret is not None:
            raise JobSecretMismatchError(
                f"job {job.job_id!r} was created without a job secret, but this join brings one: "
                "another job uses this id; pick another job id"
            )
        return
    if msg.job_secret is None:
        raise JobSecretMismatchError(
            f"job {job.job_id!r} requires a job secret (--job-secret or RDZV_JOB_SECRET); this join brings none"
        )
    if not hmac.compare_digest(job.secret_hash, job_secret_hash(job.job_id, msg.job_secret)):
        raise JobSecretMismatchError(f"wrong job secret for job {job.job_id!r}")


def check_owner(job: Job, msg: JoinMsg) -> None:
    """A finished job's next run: an id whose last run had a job secret is
    owned by whoever knows that secret; a join without it (or with another) is
    refused and changes nothing. An id whose last run had none is anyone's (as
    any new job id is). The owner may change every other setting."""
    if job.secret_hash is None:
        return
    if msg.job_secret is not None and hmac.compare_digest(job.secret_hash, job_secret_hash(job.job_id, msg.job_secret)):
        return
    raise JobSecretMismatchError(
        f"job id {job.job_id!r} is owned by its run {job.run} ({job.state.value}), which had a job secret; "
        f"this join brings {'another' if msg.job_secret is not None else 'none'}: a new run of this id needs "
        "the same job secret (--job-secret or RDZV_JOB_SECRET), or an operator's "
        f"`rdzv delete {job.job_id}` releases the id; or pick another job id"
    )


def _show(value: object) -> str:
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
    differ = [
        f"{name} {_show(getattr(spec, name))}, but node {msg.node_id!r} asked for {_show(getattr(asked, name))}"
        for name in type(spec).model_fields
        if getattr(spec, name) != getattr(asked, name)
    ]
    if differ:
        raise SpecMismatchError(
            f"job {job.job_id!r} has " + "; and ".join(differ) + " (every node of a job must use the same settings)"
        )


def _check_node_secret(job: Job, node: Node, msg: JoinMsg) -> None:
    if node.secret_hash is None:
        return  # saved before node secrets existed
    given = node_secret_hash(msg.node_secret) if msg.node_secret is not None else ""
    if not hmac.compare_digest(node.secret_hash, given):
        raise NodeSecretMismatchError(
            f"node {node.node_id!r} of job {job.job_id!r} is held by another agent: this join "
            f"{'carries a wrong' if msg.node_secret else 'does not carry its'} node secret; "
            "a new agent joins with a new node id"
        )


def starts_run(job: Job, msg: JoinMsg) -> bool:
    """Whether ``msg`` starts the next run of a finished job: a fresh agent's
    join (no run, no resume, no node secret, a node id the ended run did not
    have) that may start one (``new_run``). Any other join to a finished job is
    a late agent of its run."""
    return (
        job.finished
        and msg.new_run
        and msg.run is None
        and msg.resume_round is None
        and msg.node_secret is None
        and msg.node_id not in job.nodes
    )


def _check_run(job: Job, msg: JoinMsg) -> None:
    """A late agent, of this run or an earlier one, is told the run ended:
    it must never start or join another run by accident."""
    if msg.run is not None and msg.run != job.run:
        raise JobFinishedError(
            f"run {msg.run} of job {job.job_id!r} is over and the job is at run {job.run} "
            f"({job.state.value}); this agent belongs to run {msg.run}"
        )
    if job.finished and not starts_run(job, msg):
        raise JobFinishedError(
            f"job {job.job_id!r} run {job.run} already {job.state.value}: {job.end_reason}; "
            + (
                f"this agent belongs to that run (the same command started again starts run {job.run + 1})"
                if msg.new_run
                else "this agent may not start its next run (--no-new-run, the default in a Kubernetes pod: "
                "--new-run, or a new job id, starts one)"
            )
        )


def join(job: Job, msg: JoinMsg, now: float, node_secret: str | None = None, seen_addr: str | None = None) -> Effects:
    """A node joins the forming round, queues for a scale-up, becomes a spare,
    or (with ``resume_round``) reconnects to the round it still runs.

    A join that creates the node gives it ``node_secret`` (the caller draws a
    fresh random one), sent back in ``joined``; every later join naming that
    node must carry it. The job secret and the whole spec must match the job's.
    ``seen_addr``: the IP the join's connection came from, the address its
    peers probe (:mod:`.probe_addr`; None: the claimed ``addr``).

    The cases, each its own function: :func:`_reconnect` (a running member is
    back), :func:`_resume` (a node resumes a round: refused, or told to
    restart), else :func:`_new_node` or :func:`_rejoin`, then :func:`_enter`
    (the forming round, a scale-up, or a spare)."""
    _check_run(job, msg)
    if job.finished:  # a fresh agent: the job id's next run, with this join's settings
        check_owner(job, msg)
        ended = job.state.value
        new_run(job, msg.spec, now, msg.job_secret)
        started = Effects(persist=True)
        started.event(events.run_started(job, ended))
        return started.merge(join(job, msg, now, node_secret, seen_addr))  # (once: the job is not finished any more)
    _check_job_secret(job, msg)
    _check_spec(job, msg)
    node = job.nodes.get(msg.node_id)
    if node is not None:
        _check_node_secret(job, node, msg)
    if node is not None and node.state == RUNNING and not job.forming and msg.resume_round in (None, job.round):
        _probed_at(node, msg, seen_addr)  # (its peers hear of a new one with the next round)
        _offered(job, node, msg)
        return _reconnect(job, node, now)
    if msg.resume_round is not None:
        fx = _resume(job, node, msg, now, seen_addr)
        if fx is not None:
            return fx
        # a waiting/spare node that resumes: treat as a join
    if node is not None and node.state == SUCCEEDED:
        raise StaleRoundError(f"node {msg.node_id!r} already succeeded in round {job.round}; it cannot join again")
    if node is None:
        node = _new_node(job, msg, now, node_secret)
        _probed_at(node, msg, seen_addr)
        return _enter(job, node, now, issued=node_secret, new=True)
    # a previous member back for the round its `restart` opened, whose agent holds this run's
    # `joined` (its join names the run): it knows the round, and is told nothing until `assigned`
    known = node.state == REJOINING and msg.run == job.run
    _rejoin(node, msg, now)
    _probed_at(node, msg, seen_addr)
    return _enter(job, node, now, issued=None, new=False, known=known)


def _probed_at(node: Node, msg: JoinMsg, seen_addr: str | None) -> None:
    """Where its peers probe it from now on: the port its join names, at the address the server saw."""
    node.probe_port, node.probe_addr = msg.probe_port, probe_addr(msg.addr, seen_addr)


def _heard(node: Node, now: float) -> None:
    """The node's agent is connected and speaking now."""
    node.connected, node.lost_deadline, node.last_seen, node.dropped = True, None, now, False
    node.graced, node.lost_why = False, None


def _reconnect(job: Job, node: Node, now: float) -> Effects:
    """A member of the running round reconnects: with resume_round its workers
    run on; without, its assignment was sent while it was away (a round that
    completed during a server restart or a reconnect). Either way: the same
    assignment again, nothing else changes."""
    _heard(node, now)
    fx = Effects()
    fx.send(node.node_id, told_again(job, node))
    text = f"job {job.job_id} round {job.round}: node {node.node_id} reconnected"
    if line := events.comeback(job, now, text, node):
        fx.logs.append(line)
    return fx


def _resume(job: Job, node: Node | None, msg: JoinMsg, now: float, seen_addr: str | None) -> Effects | None:
    """A node resumes a round that is not (or no longer) its running one:
    refused, or told to restart; None: it is waiting or a spare, and joins."""
    if node is None:
        raise EvictedError(f"node {msg.node_id!r} is not part of job {job.job_id!r} any more (evicted)")
    if node.state == SUCCEEDED:
        raise StaleRoundError(f"node {msg.node_id!r} already reported success in round {job.round}")
    if node.state == RUNNING and msg.direct_ports and msg.resume_round is not None and msg.resume_round < job.round:
        # placed in this round by its restart (reform_directly), which it missed: that restart again
        _heard(node, now)
        _probed_at(node, msg, seen_addr)  # (as a reconnect: its peers hear of it with the next round)
        _offered(job, node, msg)
        fx = Effects()
        fx.send(node.node_id, told_again(job, node, restart=True))
        return fx
    if node.state == RUNNING:  # running in the current round but resuming an older one
        raise StaleRoundError(f"round {msg.resume_round} is over; job {job.job_id!r} runs round {job.round}")
    if node.state == REJOINING:
        # It missed the news: its round is over. Tell it to stop and rejoin.
        _heard(node, now)
        fx = Effects()
        fx.send(node.node_id, RestartMsg(round=job.round, reason=job.history[-1].reason))
        return fx
    return None


def _new_node(job: Job, msg: JoinMsg, now: float, node_secret: str | None) -> Node:
    """The first join of a node id: the job keeps the hash of its new secret."""
    node = Node(
        node_id=msg.node_id,
        host=msg.host,
        addr=msg.addr,
        local_world_size=msg.local_world_size,
        master_port=msg.master_port,
        requested_rank=msg.requested_rank,
        last_seen=now,
        joined_at=now,
        direct_ports=list(msg.direct_ports) or None,
        secret_hash=node_secret_hash(node_secret) if node_secret is not None else None,
    )
    job.nodes[node.node_id] = node
    return node


def _rejoin(node: Node, msg: JoinMsg, now: float) -> None:
    """A known node joins again (a previous member, a waiting node or a spare):
    it may come back with a new address, port or size."""
    node.host, node.addr = msg.host, msg.addr
    node.local_world_size, node.master_port = msg.local_world_size, msg.master_port
    node.direct_ports = list(msg.direct_ports) or None
    node.requested_rank = msg.requested_rank
    _heard(node, now)


def _offered(job: Job, node: Node, msg: JoinMsg) -> None:
    """A member's resume offers fresh direct ports (a new leader does not keep
    them): they replace its unused ones; and as the running round's rank 0 its
    ``master_port`` may still be the port that round's store listens on (a
    record saved before direct ports existed): then it takes a fresh one."""
    if not msg.direct_ports:
        return
    node.direct_ports = list(msg.direct_ports)
    if node.group_rank == 0 and node.master_port == job.master_port:
        node.master_port = node.direct_ports.pop(0)


def _enter(job: Job, node: Node, now: float, issued: str | None, new: bool, known: bool = False) -> Effects:
    """Place a joining node: in the forming round; or, while a round runs, in
    the queue of a scale-up below max_nodes, else as a spare. ``issued``: the
    node secret to send in ``joined`` (only to the join that created the node);
    ``new``: the node's first join (a node_joined event); ``known``: a previous
    member's rejoin after ``restart``: placed in the forming round without a
    ``joined`` (a round change of N nodes writes N fewer messages; its
    ``assigned``, or ``status`` while the round waits, is what it hears next)."""
    spec = job.spec
    fx = Effects()
    why = blocked(job, node, now)
    if why is not None:
        return _hold(job, node, now, why, issued, new)
    if node.replaced is not None:  # a straggler replaced by a spare (straggler_policy replace)
        why, node.replaced = node.replaced, None
        fx = _hold(job, node, now, why, issued, new)
        node.note = None  # a spare like any other from now on: its host is not blocked
        return fx
    node.note = None
    if job.forming:
        move(job, node, WAITING)
        job.status_dirty = True
        # as it joined: waiting (a round its join completes is the next event); beyond the first
        # MAX_JOIN_EVENTS of a forming round, counted in its round_completed (new_nodes) instead
        if new and count(job, WAITING) <= events.MAX_JOIN_EVENTS:
            fx.event(
                events.node_joined(
                    job, node, f"job {job.job_id} round {job.round}: node {node.node_id} ({node.host}) joined"
                )
            )
        done = _check_complete(job, now)
        if known:
            return fx.merge(done)
        fx.send(node.node_id, _joined(job, node, job.round, issued, waiting_fields(job, now, detail=False)))
        return fx.merge(done)
    fx.send(node.node_id, _joined(job, node, job.round + 1, issued))
    queued = count(job, WAITING) - (node.state == WAITING)
    if len(job.order) + queued < spec.max_nodes:
        move(job, node, WAITING)
        if job.scale_up_deadline is None:
            job.scale_up_deadline = now + spec.scale_up_window_s
        text = (
            f"job {job.job_id} round {job.round}: node {node.node_id} ({node.host}) arrived; "
            f"scale-up in {spec.scale_up_window_s:g}s"
        )
        _arrived(fx, job, node, text, new, now)
    else:
        move(job, node, SPARE)
        fx.send(node.node_id, SpareMsg(round=job.round))
        text = f"job {job.job_id} round {job.round}: node {node.node_id} ({node.host}) is a spare"
        _arrived(fx, job, node, text, new, now)
    return fx


def _joined(job: Job, node: Node, round_no: int, issued: str | None, waiting: dict[str, Any] | None = None) -> Prepared:
    """The ``joined`` that places ``node`` in ``round_no`` (``issued``: its new secret;
    ``waiting``: what a forming round waits for, :func:`.views.waiting_fields`)."""
    return templates.joined(round_no, node.node_id, told_interval(job), waiting, issued, job.run)


def _arrived(fx: Effects, job: Job, node: Node, text: str, new: bool, now: float) -> None:
    """A node placed while a round runs: its first join is an event, a later one a note
    (within the job's budget of them, events.comeback)."""
    if new:
        fx.event(events.node_joined(job, node, text))
    elif line := events.comeback(job, now, text, node, host=node.host):
        fx.logs.append(line)


def _hold(job: Job, node: Node, now: float, why: str, issued: str | None, new: bool) -> Effects:
    """The node's host is cordoned or cooled down: it waits as a spare, told
    why, and is admitted when that ends (see gates.hosts_changed)."""
    was = node.state
    round_no = job.round if job.forming else job.round + 1
    fx = Effects()
    fx.send(node.node_id, _joined(job, node, round_no, issued))
    move(job, node, SPARE)
    fx.send(node.node_id, SpareMsg(round=job.round, reason=why))
    text = f"job {job.job_id} round {job.round}: node {node.node_id} waits as a spare: {why}"
    if new:
        fx.event(events.node_joined(job, node, text, reason=why))
    elif node.note != why:
        fx.logs.append(note(job, text, node.node_id, host=node.host, reason=why))
    node.note = why
    job.status_dirty = True
    if job.forming and was in (REJOINING, WAITING):
        fx.merge(_check_complete(job, now))
    return fx
