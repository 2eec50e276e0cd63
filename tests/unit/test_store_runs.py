"""Re-runs of a job id and progress in the store's derived views: the event
stream, the job's metrics and rdzv_job_since_progress_seconds, driven with a
fake clock and a real Store, EventLog and Metrics. (Channels are recorders: this is a unit.)"""

from __future__ import annotations

import json
from typing import Any

from rdzv_common.protocol import SERVER_MESSAGE, JobSpec, JoinMsg
from rdzv_server.metrics import Metrics
from rdzv_server.rounds.views import view
from rdzv_server.store import Store, StoreSettings


class Recorder:
    def __init__(self) -> None:
        self.msgs: list[Any] = []

    def deliver(self, text: str) -> None:
        self.msgs.append(SERVER_MESSAGE.validate_json(text))

    def drop(self) -> None:
        pass


def join(node_id: str, spec: JobSpec, **kw: Any) -> JoinMsg:
    return JoinMsg(
        job_id="j",
        node_id=node_id,
        host=node_id,
        addr="10.0.0.1",
        local_world_size=1,
        master_port=29500,
        spec=spec,
        **kw,
    )


def events_after(store: Store, n: int) -> list[dict[str, Any]]:
    return [json.loads(e.data) for e in list(store.events.ring)[n:]]


def job_lines(metrics: Metrics) -> set[str]:
    text = metrics.render().decode()
    return {line for line in text.splitlines() if 'job_id="j"' in line or line.startswith("rdzv_jobs{")}


def run_one() -> tuple[list[float], Store, Metrics, JobSpec]:
    """Job ``j`` (1:1): node ``a`` joins, its run 1 succeeds."""
    clock = [1000.0]
    metrics = Metrics()
    store = Store(StoreSettings(), clock=lambda: clock[0], metrics=metrics)
    spec = JobSpec(min_nodes=1, max_nodes=1)
    store.join(join("a", spec), Recorder())
    store.succeed("j", "a", 0)
    assert store.jobs["j"].finished
    return clock, store, metrics, spec


def test_events_of_run_1_carry_run_1() -> None:
    _, store, _, _ = run_one()
    evs = events_after(store, 0)
    assert evs and all(e["run"] == 1 for e in evs)


def test_a_rerun_publishes_its_events_with_its_run() -> None:
    clock, store, _, spec = run_one()
    n = len(store.events.ring)
    clock[0] += 10
    store.join(join("b", spec), Recorder())
    assert store.jobs["j"].run == 2
    evs = events_after(store, n)
    kinds = [(e["type"], e["round"], e.get("state")) for e in evs]
    assert ("job_state", 0, "waiting") in kinds, kinds
    first = evs[0]
    assert first["type"] == "job_state" and first["previous"] == "succeeded" and "run 2" in first["reason"]
    assert ("node_joined", 0, "waiting") in kinds, kinds
    assert ("round_completed", 0, None) in kinds, kinds
    assert ("job_state", 0, "running") in kinds, kinds
    assert all(e["run"] == 2 for e in evs)
    n = len(store.events.ring)
    store.succeed("j", "b", 0)
    ended = [e for e in events_after(store, n) if e["type"] == "job_state"]
    assert [(e["state"], e["previous"], e["run"]) for e in ended] == [("succeeded", "running", 2)]


def test_a_rerun_updates_the_jobs_metrics() -> None:
    clock, store, metrics, spec = run_one()
    clock[0] += 10
    store.join(join("b", spec), Recorder())
    metrics.refresh(store.jobs.values(), store.hosts, clock[0])
    lines = job_lines(metrics)
    assert 'rdzv_job_state{job_id="j",state="running"} 1.0' in lines, sorted(lines)
    assert not any('rdzv_job_state{job_id="j",state="succeeded"}' in line for line in lines), sorted(lines)
    assert 'rdzv_job_nodes{job_id="j",state="running"} 1.0' in lines, sorted(lines)
    assert 'rdzv_jobs{state="running"} 1.0' in lines
    store.succeed("j", "b", 0)
    metrics.refresh(store.jobs.values(), store.hosts, clock[0])
    lines = job_lines(metrics)
    assert 'rdzv_job_state{job_id="j",state="succeeded"} 1.0' in lines, sorted(lines)
    assert not any('rdzv_job_state{job_id="j",state="running"}' in line for line in lines), sorted(lines)


def test_since_progress_ignores_a_replaced_straggler() -> None:
    """A straggler replaced by a spare waits as a spare: its last step (long
    ago) is not the job's progress."""
    clock = [1000.0]
    store = Store(StoreSettings(), clock=lambda: clock[0])
    spec = JobSpec(min_nodes=3, max_nodes=3, straggler_policy="replace", straggler_window_s=1.0)
    chans = {n: Recorder() for n in "abcs"}
    for n in "abcs":
        store.join(join(n, spec), chans[n])
    for t in range(5):
        clock[0] += 1.1
        for n, rate in (("a", 10.0), ("b", 10.0), ("c", 1.0)):
            store.heartbeat("j", n, step=t * 10, rate=rate)
        store.heartbeat("j", "s")
    job = store.jobs["j"]
    secret = {n: next(m.node_secret for m in chans[n].msgs if m.op == "joined") for n in "abc"}
    for n in "abc":  # the round changed: they rejoin (c as a spare)
        store.join(join(n, spec, node_secret=secret[n]), chans[n])
    clock[0] += 1.0
    store.tick()
    assert job.nodes["c"].state.value == "spare", {k: v.state.value for k, v in job.nodes.items()}
    assert job.nodes["s"].state.value == "running"
    for t in range(100):
        clock[0] += 1.0
        for n, node in job.nodes.items():
            if node.state.value == "running":
                store.heartbeat("j", n, step=1000 + t, rate=10.0)
            else:
                store.heartbeat("j", n)
    assert store.reads.since_progress()["j"] < 5.0, store.reads.since_progress()
    jv = view(job, clock[0])
    shown = {n.node_id: n.since_progress_s for n in jv.nodes + jv.spares}
    assert shown["c"] is None and shown["s"] is not None and shown["s"] < 5.0, shown
