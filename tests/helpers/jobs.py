"""A job of the pure round machine (rdzv_server.rounds) with its round formed,
for unit tests: nodes n0..n{n-1} joined at time 0, each on its own host."""

from __future__ import annotations

from rdzv_common.protocol import JobSpec, JoinMsg
from rdzv_server import rounds


def running_job(
    n: int, probe: bool = False, heartbeat_s: float | None = None
) -> tuple[rounds.Job, list[rounds.Effects]]:
    """The job and each join's effects. ``probe``: node i answers peers' probes
    at port 40000 + i; ``heartbeat_s``: the interval the store chose (None: the spec's)."""
    job = rounds.new_job("j", JobSpec(min_nodes=n, max_nodes=n), 0.0)
    job.heartbeat_s = heartbeat_s
    effects = [rounds.join(job, node_join(job, i, 40000 + i if probe else None), 0.0) for i in range(n)]
    assert not job.forming
    return job, effects


def node_join(job: rounds.Job, i: int, probe_port: int | None = None, run: int | None = None) -> JoinMsg:
    """Node n{i}'s join to ``job`` (host h{i}, address 10.0.0.{i + 1}; ``probe_port``: where it
    answers probes; ``run``: the run it names, as after a ``restart``)."""
    return JoinMsg(
        job_id=job.job_id,
        node_id=f"n{i}",
        host=f"h{i}",
        addr=f"10.0.0.{i + 1}",
        local_world_size=1,
        master_port=29500,
        spec=job.spec,
        probe_port=probe_port,
        run=run,
    )
