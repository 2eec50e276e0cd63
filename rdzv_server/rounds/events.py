"""What happened to a job, as the round machine's steps return it: typed
events (:class:`.model.Event`) in ``Effects.events``. Pure, no I/O, no clock.

The one place an event is made: its type (one of ``logs.EVENTS``), job, run,
round, node, fields and the words of its log line. The store publishes each
one to the event stream (``rdzv_server.events``), logs its line (the json
log's ``event`` field) and counts it in the metrics, so the three never
disagree. Lines that are no event (a node reconnected, a straggler flagged by its steps/s)
are notes: :func:`note`.
"""

from __future__ import annotations

from typing import Any

from rdzv_common.logs import Line, event_line
from rdzv_common.protocol import ExitRecord, printable
from rdzv_common.sizes import TRUNCATED, clip, tail_lines

from .model import Effects, Event, Job, Node, NoteBudget, RoundRecord, SlowRank

MAX_FAILURES = 8  # exit records a node_failed event carries (a node may report one per local rank)
MAX_FAILURE_TEXT = 1024  # bytes (as JSON) of a text field of one exit record in an event
MAX_EVENT_TAIL_BYTES = 2048  # bytes (as JSON) of the first failure's stderr lines in a node_failed event
# node_joined events of one forming round: the first this many nodes waiting; a 16,384-node
# formation is not 16,384 events (the ring holds 10,000): round_completed counts them (new_nodes)
MAX_JOIN_EVENTS = 64
# "node N reconnected" (and "... is a spare" again) lines of one job: a failover's 16,384 resumes
# are not 16,384 lines, and a node that reconnects in a loop (its secret is all it takes) does not
# write the server's log: the first COMEBACK_BURST, then one every 1/COMEBACK_RATE s; the next line
# let through says how many were held back (its field ``held``)
COMEBACK_BURST = 64
COMEBACK_RATE = 0.2  # lines a second, once the burst is spent


def note(job: Job, text: str, node: str | None = None, **fields: Any) -> Line:
    """A log line about ``job`` in its current round that is no event."""
    return event_line(job, None, text, node, **fields)


def comeback(job: Job, now: float, text: str, node: Node, **fields: Any) -> Line | None:
    """A note that ``node`` is back (it reconnected, or rejoined while a round runs), or None
    when the job's budget of them is spent (:data:`COMEBACK_BURST`, :data:`COMEBACK_RATE`)."""
    b = job.comebacks
    if not _spend(b, now):
        b.held += 1
        return None
    if b.held:
        text, fields["held"], b.held = f"{text} ({_held(b.held)})", b.held, 0
    return note(job, text, node.node_id, **fields)


def comebacks_held(job: Job, now: float) -> Line | None:
    """From the job's tick: the count of "node back" notes held back since the last one let
    through, once the budget allows a line (a failover's burst is told whole, no later
    reconnect needed); None: none held, or no budget yet."""
    b = job.comebacks
    if not b.held or not _spend(b, now):
        return None
    held, b.held = b.held, 0
    return note(job, f"job {job.job_id} round {job.round}: {_held(held)}", held=held)


def _spend(b: NoteBudget, now: float) -> bool:
    """One line of the budget at ``now``; False: none left (a clock that went back refills nothing)."""
    tokens = COMEBACK_BURST if b.tokens < 0 else min(COMEBACK_BURST, b.tokens + max(0.0, now - b.at) * COMEBACK_RATE)
    b.at = now
    if tokens < 1:
        b.tokens = tokens
        return False
    b.tokens = tokens - 1
    return True


def _held(n: int) -> str:
    return f"{n} more nodes back, not logged one by one"


def _event(job: Job, kind: str, text: str, node: str | None = None, **fields: Any) -> Event:
    return Event(kind, job.job_id, job.run, job.round, node, text, fields)


def job_created(job: Job) -> Effects:
    """A new job (its first run): the first event of its stream, saved with it."""
    spec = job.spec
    text = f"job {job.job_id} created: nnodes {spec.min_nodes}:{spec.max_nodes}, max_restarts {spec.max_restarts}" + (
        ", with a job secret" if job.secret_hash is not None else ""
    )
    fx = Effects(persist=True)
    fx.event(_event(job, "job_state", text, state=job.state.value, previous=None, reason="job created"))
    return fx


def run_started(job: Job, previous: str) -> Event:
    """A finished job id started its next run (``previous``: how the last one ended)."""
    reason = job.history[0].reason
    return _event(
        job, "job_state", f"job {job.job_id} {reason}", state=job.state.value, previous=previous, reason=reason
    )


def job_state(job: Job, previous: str, text: str | None = None) -> Event:
    """The job's state changed from ``previous``; an ended job says why."""
    fields: dict[str, Any] = {"state": job.state.value, "previous": previous}
    if job.finished:
        fields.update(reason=job.end_reason, root_cause=job.root_cause)
    if text is None:
        text = f"job {job.job_id} round {job.round}: {previous} -> {job.state.value}"
    return _event(job, "job_state", text, **fields)


def node_joined(job: Job, node: Node, text: str, **fields: Any) -> Event:
    """A node's first join (``state``: waiting or spare, as it joined)."""
    state = node.state.value if node.state is not None else "waiting"
    return _event(
        job,
        "node_joined",
        text,
        node.node_id,
        host=node.host,
        addr=node.addr,
        nproc=node.local_world_size,
        state="spare" if state == "spare" else "waiting",
        **fields,
    )


def node_gone(job: Job, node: Node, why: str, *, lost: bool) -> Event:
    """A node left the job: ``lost`` (it left, or its connection stayed lost past
    the grace: node_lost) or else evicted (no heartbeat in time: node_evicted)."""
    text = f"job {job.job_id} round {job.round}: node {node.node_id} ({node.host}) {why}"
    return _event(job, "node_lost" if lost else "node_evicted", text, node.node_id, host=node.host, reason=why)


def node_failed(job: Job, node: Node, failures: list[ExitRecord], cause: str) -> Event:
    text = f"job {job.job_id} round {job.round}: worker failure on {cause}"
    return _event(job, "node_failed", text, node.node_id, host=node.host, **failure_fields(failures))


def node_succeeded(job: Job, node: Node) -> Event:
    text = f"job {job.job_id} round {job.round}: node {node.node_id} succeeded"
    return _event(job, "node_succeeded", text, node.node_id)


def restart_charged(job: Job) -> Event:
    """A restart was charged against the budget (the round it opened is ``job.round``)."""
    reason = job.history[-1].reason if job.history else None
    text = f"job {job.job_id} round {job.round}: restart {job.restarts}/{job.spec.max_restarts} charged"
    return _event(
        job, "restart_charged", text, restarts=job.restarts, max_restarts=job.spec.max_restarts, reason=reason
    )


def round_opened(job: Job, rec: RoundRecord, waiting_for: list[str], placed: bool = False) -> Event:
    """``placed``: the server places those members itself, in this step (forming.reform_directly):
    the round waits for nobody."""
    named = f"{', '.join(waiting_for[:16]) or 'nobody'}{' ...' if len(waiting_for) > 16 else ''}"
    what = f"placing its {len(waiting_for)} member(s) at once" if placed else f"waiting for {len(waiting_for)} node(s)"
    text = f"job {job.job_id} round {job.round} opened: {rec.reason}; {what} {named}"
    return _event(
        job,
        "round_opened",
        text,
        reason=rec.reason,
        started_at=rec.started_at,
        waiting_for=0 if placed else len(waiting_for),
        restarts=job.restarts,
    )


def round_completed(job: Job, rec: RoundRecord, members: list[Node], spares: int) -> Event:
    """``new_nodes``: members that were not in the previous round (joins beyond
    MAX_JOIN_EVENTS of a forming round have no node_joined event of their own)."""
    assert rec.completed_at is not None
    before = set(job.prev_order)
    shown = ", ".join(f"{n.node_id}={n.group_rank}" for n in members[:16])
    more = f" (+{len(members) - 16} more)" if len(members) > 16 else ""
    text = (
        f"job {job.job_id} round {job.round} complete: {len(members)} nodes, world size "
        f"{job.world_size}, master {job.master_addr}:{job.master_port}, spares {spares}; "
        f"ranks {shown}{more}"
    )
    return _event(
        job,
        "round_completed",
        text,
        reason=rec.reason,
        formation_s=round(rec.completed_at - rec.started_at, 6),
        world_size=rec.world_size,
        nodes=rec.nodes,
        new_nodes=sum(1 for n in members if n.node_id not in before),
    )


def straggler_flagged(job: Job, node: Node, slow: SlowRank, now: float) -> Event:
    """A rank's compute stayed above its job's median for the straggler window
    (rounds.slow_ranks): the rank, its host, the ratio and the window measured."""
    rank = node.rank_offset + slow.local_rank
    spec = job.spec
    if slow.rule == "nccl_lag":
        return _nccl_lag(job, node, slow, rank, now)
    text = (
        f"job {job.job_id} round {job.round}: rank {rank} (local rank {slow.local_rank}) of node {node.node_id} "
        f"({node.host}) is a straggler: compute score {slow.ratio:.2f} (job median compute fraction "
        f"{slow.median:.3f} / its own {slow.fraction:.3f}) below {spec.straggler_score:g} for "
        f"{now - slow.since:.0f}s (straggler policy {spec.straggler_policy})"
    )
    return _event(
        job,
        "straggler_flagged",
        text,
        node.node_id,
        host=node.host,
        rank=rank,
        local_rank=slow.local_rank,
        rule=slow.rule,
        ratio=round(slow.ratio, 4),
        compute_fraction=round(slow.fraction, 4),
        median_fraction=round(slow.median, 4),
        window_s=round(now - slow.since, 3),
        policy=spec.straggler_policy,
    )


def _nccl_lag(job: Job, node: Node, slow: SlowRank, rank: int, now: float) -> Event:
    """straggler_flagged by NCCL RAS (rounds.nccl_lag): the share of the agent's readings, their window."""
    spec = job.spec
    text = (
        f"job {job.job_id} round {job.round}: rank {rank} (local rank {slow.local_rank}) of node {node.node_id} "
        f"({node.host}) is a straggler: NCCL RAS saw it behind its communicator in {slow.ratio:.0%} of "
        f"{slow.readings} readings over {now - slow.since:.0f}s (by up to {slow.behind} collectives) "
        f"(straggler policy {spec.straggler_policy})"
    )
    return _event(
        job,
        "straggler_flagged",
        text,
        node.node_id,
        host=node.host,
        rank=rank,
        local_rank=slow.local_rank,
        rule=slow.rule,
        lag_share=round(slow.ratio, 4),
        readings=slow.readings,
        collectives_behind=slow.behind,
        window_s=round(now - slow.since, 3),
        policy=spec.straggler_policy,
    )


def failure_fields(failures: list[ExitRecord]) -> dict[str, Any]:
    """A node_failed event's fields from its exit records (bounded, printable;
    ``truncated`` true when a text was clipped): ``cause`` (the first failure in
    one line), ``exit`` (its record), ``failures`` (up to MAX_FAILURES records)."""
    first = min(failures, key=lambda r: (r.timestamp or float("inf"), r.rank))
    clipped = False

    def text(value: str) -> str:
        nonlocal clipped
        out = clip(printable(value), MAX_FAILURE_TEXT)
        clipped = clipped or out.endswith(TRUNCATED)
        return out

    def record(r: ExitRecord) -> dict[str, Any]:
        return {
            k: (text(v) if isinstance(v, str) else v) for k, v in r.model_dump(mode="json", exclude={"stderr"}).items()
        }

    fields: dict[str, Any] = {
        "cause": text(first.describe()),
        "exit": record(first),  # the first failure's record (the cause)
        "failures": [record(r) for r in failures[:MAX_FAILURES]],
        "failures_omitted": max(0, len(failures) - MAX_FAILURES),
    }
    if first.stderr:  # the failing rank's last lines, in its record only (the event stays within its cap)
        fields["exit"]["stderr"] = tail_lines(first.stderr, MAX_EVENT_TAIL_BYTES)
    if clipped:
        fields["truncated"] = True
    return fields
