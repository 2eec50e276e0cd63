"""bench/big_job.py on etcd (``--etcd [--replicas 3]``): the same job against the
leader of ``rdzv-server --etcd`` replicas on a 3-member etcd (bench/ha.py's
helpers). Storage bytes are what the etcd members wrote to disk (/proc io of
their processes: WAL, snapshots, their logs); requests are the leader's
``rdzv_storage_write_requests_total`` (etcd transactions). The clients talk to
the leader only: a leader kill (they would have to follow the new leader) is
bench/ha.py's."""

from __future__ import annotations

import os
from pathlib import Path

from . import ha
from .server_scale import Server


class EtcdServer:
    """What big_job.run uses of a server: the leader replica's url, pid, log, metrics."""

    def __init__(self, tmp: Path, replicas: int) -> None:
        self.etcd = ha._etcd(tmp / "etcd")
        try:
            prefix = f"/bench-big-{os.getpid()}/"
            self.replicas = ha.Replicas(replicas, tmp, self.etcd.endpoints, prefix, ("--join-deadline", "600"))
        except BaseException:
            ha._stop_etcd(self.etcd)
            raise
        leader = self.replicas.leader(30)
        assert leader is not None
        self.leader = leader
        self.url, self.proc, self.log = leader.url, leader.proc, leader.proc.log

    @property
    def pid(self) -> int:
        return self.leader.pid

    def metrics(self) -> dict[str, float]:
        return Server.metrics(self)  # type: ignore[arg-type]  # only reads self.url

    def job(self, job_id: str) -> dict | None:
        return self.leader.job(job_id)

    def close_job(self, job_id: str) -> None:
        self.leader.close_job(job_id)

    def stalls(self) -> int:
        return self.proc.text().count("did not run for a while")

    def written(self, io_written) -> tuple[int, int]:
        return sum(io_written(self.etcd.pid(i)) for i in range(len(self.etcd.members))), 0

    def stop(self, grace: float = 5) -> None:
        self.replicas.stop()
        ha._stop_etcd(self.etcd)
