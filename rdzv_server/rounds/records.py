"""Jobs as plain JSON-able records, for the store's database, and back.

A node's state is stored as its :class:`NodeState` value (a string), as it
always was: records saved before states were an enum load unchanged."""

from __future__ import annotations

from ..protocol import JobSpec, JobState
from .model import Job, Node, NodeState, RoundRecord


def to_record(job: Job) -> dict:
    """The job as plain JSON-able data (for the store's database)."""
    skip = ("spec", "nodes", "history", "state", "counts", "gate")  # gate: the store's, set again on load
    d = {k: getattr(job, k) for k in Job.__dataclass_fields__ if k not in skip}
    d["spec"] = job.spec.model_dump()
    d["state"] = job.state.value
    d["nodes"] = [_node_record(n) for n in job.nodes.values()]
    d["history"] = [vars(r).copy() for r in job.history]
    return d


def _node_record(node: Node) -> dict:
    d = {**vars(node), "state": node.state.value}
    if d["note"] is None:  # only spares held off by their host have one: records stay as they were
        del d["note"]
    return d


def from_record(d: dict) -> Job:
    d = dict(d)
    spec = JobSpec(**d.pop("spec"))
    nodes = {n["node_id"]: Node(**{**n, "state": NodeState(n["state"])}) for n in d.pop("nodes")}
    history = [RoundRecord(**r) for r in d.pop("history")]
    state = JobState(d.pop("state"))
    d.pop("counts", None)
    job = Job(spec=spec, nodes=nodes, history=history, state=state, **d)
    for node in nodes.values():
        job.counts[node.state] = job.counts.get(node.state, 0) + 1
    return job
