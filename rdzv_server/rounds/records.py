"""Jobs as plain JSON-able records, for the store's database, and back.

A node's state is stored as its :class:`NodeState` value (a string), as it
always was: records saved before states were an enum load unchanged."""

from __future__ import annotations

import operator
from typing import Any

from rdzv_common.protocol import JobSpec, JobState
from rdzv_common.sizes import MAX_OLD_REASON_BYTES, RECENT_REASONS, clip
from rdzv_common.spec_table import spec_from_record, spec_record

from . import culprit, departed
from .model import Job, Node, NodeState, RoundRecord, RunRecord

# Progress that agents send with heartbeats is not saved: the next heartbeat
# brings it back (and records stay what older code wrote and reads).
_NOT_SAVED_NODE = frozenset(
    {
        "step",
        "step_rate",
        "progress_at",
        "slow_since",
        "straggler",
        "straggler_note",
        "timings",
        "timings_at",
        "rank_slow_since",
        "slow_rank",
        "nccl_lag",
        "nccl_lag_at",
        "probe_port",  # the node's next join (a resume too) brings it back
        "probe_addr",  # ... and its connection this one
        "direct_ports",  # ... and fresh ones (those of a node that does not come back are of no use)
        "lost_why",
    }
)
_NOT_SAVED_JOB = frozenset(
    {
        "spec",
        "nodes",
        "history",
        "state",
        "counts",
        "stragglers_at",
        "gate",
        "culprit",
        "departed",
        "probe_seed",
        "heartbeat_s",
        "comebacks",
        "texts",
        "peer_texts",
    }
)


# Job counters of restart storms (Job) at their defaults: left out of the record, so a
# job that never used them saves what older code wrote. (The spec's fields: the table's
# rule, spec_table.spec_record.)
_STORM_DEFAULTS: dict[str, Any] = {"no_progress": 0, "max_step": None, "round_step": None}
# Runs of a job id: left out for a job that never started a second run.
_RUN_DEFAULTS: dict[str, Any] = {"run": 1, "runs": [], "run_started_at": None}


def add_round(job: Job, rec: RoundRecord, max_rounds: int) -> None:
    """Append a round record, keeping the history bounded in count and bytes
    (a failure loop must not grow the job's record, rewritten at each step):
    the run's first two records (its start, and what first re-formed it: the
    first failure) stay, the oldest after them go beyond ``max_rounds``, and a
    reason older than the newest RECENT_REASONS rounds is cut short."""
    job.history.append(rec)
    del job.history[2 : -(max_rounds - 2)]
    aged = len(job.history) - 1 - RECENT_REASONS
    if aged >= 2:
        job.history[aged].reason = clip(job.history[aged].reason, MAX_OLD_REASON_BYTES)


_STATES = {s.value: s for s in NodeState}  # (a lookup: NodeState(value) is ~5 us, 16,384 of them a load)


def _state(value: str) -> NodeState:
    """A node's saved state (raises on one that is none, as NodeState(value))."""
    return _STATES.get(value) or NodeState(value)


def _known(state: NodeState | None) -> NodeState:
    assert state is not None  # a node in job.nodes has a state
    return state


def to_record(job: Job) -> dict[str, Any]:
    """The job as plain JSON-able data (for the store's database)."""
    d = {k: getattr(job, k) for k in Job.__dataclass_fields__ if k not in _NOT_SAVED_JOB}
    d["spec"] = spec_record(job.spec.model_dump())  # fields at their defaults left out, as the table says
    for name, default in _STORM_DEFAULTS.items():  # at their defaults: the record older code wrote
        if d.get(name) == default:
            d.pop(name, None)
    d["runs"] = [vars(r).copy() for r in job.runs]
    for name, default in _RUN_DEFAULTS.items():
        if d.get(name) == default:
            d.pop(name, None)
    d["state"] = job.state.value
    d["nodes"] = [_node_record(n) for n in job.nodes.values()]
    d["history"] = [vars(r).copy() for r in job.history]
    if job.culprit is not None:  # left out without one: the record older code wrote
        d["culprit"] = culprit.to_record(job.culprit)
    if job.departed:  # likewise
        d["departed"] = departed.to_records(job.departed)
    return d


_SAVED_NODE = tuple(f for f in Node.__dataclass_fields__ if f not in _NOT_SAVED_NODE)  # in the record's order
_saved_values = operator.attrgetter(*_SAVED_NODE)


def _node_record(node: Node) -> dict[str, Any]:
    d = dict(zip(_SAVED_NODE, _saved_values(node), strict=True))
    d["state"] = _known(node.state).value
    if d["note"] is None:  # only spares held off by their host have one: records stay as they were
        del d["note"]
    if d["replaced"] is None:  # only a straggler replaced under straggler_policy "replace"
        del d["replaced"]
    return d


def from_record(d: dict[str, Any]) -> Job:
    d = dict(d)
    spec = JobSpec(**spec_from_record(d.pop("spec")))
    nodes = {n["node_id"]: Node(**{**n, "state": _state(n["state"])}) for n in d.pop("nodes")}
    history = [RoundRecord(**r) for r in d.pop("history")]
    d["runs"] = [RunRecord(**r) for r in d.pop("runs", [])]
    state = JobState(d.pop("state"))
    d.pop("counts", None)
    d["culprit"] = culprit.from_record(d.pop("culprit", None))
    d["departed"] = departed.from_records(d.pop("departed", []))
    job = Job(spec=spec, nodes=nodes, history=history, state=state, **d)
    for node in nodes.values():
        node_state = _known(node.state)
        job.counts[node_state] = job.counts.get(node_state, 0) + 1
    return job
