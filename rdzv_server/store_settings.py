"""The store's settings and their defaults (``rdzv-server`` flags fill them in,
:mod:`rdzv_server.flags`); re-exported by :mod:`rdzv_server.store`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .hosts import HostRules
from .quotas import DEFAULT_WAITING_JOBS_PER_ADDRESS

# After an election, on top of the heartbeat timeout: agents of a leader whose
# host died learn it only when a heartbeat goes unacknowledged for the link's
# TCP_USER_TIMEOUT_S (4 s), up to a heartbeat interval (2 s) after the death;
# the new leader is elected about a lease TTL (2 s) after it. Without this,
# 6 s (the default heartbeat timeout) left them ~1 s to spare.
FAILOVER_GRACE_S = 5.0
# After a restart or an election, on top of that, per node to reload: every agent
# reconnects at once, and the server takes each one's upgrade and resume in turn
# (0.45-0.6 ms of its CPU each at 8,192 nodes on etcd, bench.big_job --etcd; 4x
# for a loaded server). 16,384 nodes: 33 s more; without it a 35 s grace ran out
# after 1,224 of them had resumed and the rest were lost (a re-formation).
RECONNECT_PER_NODE_S = 0.002


def reconnect_grace_s(nodes: int) -> float:
    """What a restarted server or a new leader adds to each node's heartbeat
    timeout for the reconnect storm of ``nodes`` nodes (FAILOVER_GRACE_S apart)."""
    return RECONNECT_PER_NODE_S * max(0, nodes)


DEFAULT_DISCONNECT_GRACE_S = 0.5  # a dropped connection has this long to come back (--disconnect-grace)
DEFAULT_RETAIN_FINISHED_S = 7 * 24 * 3600.0
DEFAULT_MAX_WAITING_JOBS = 1000
DEFAULT_MIN_FREE_DISK = 64 * 1024 * 1024


@dataclass
class StoreSettings:
    data_dir: Path | None = None  # None: memory only (embedded/standalone server)
    disconnect_grace_s: float = DEFAULT_DISCONNECT_GRACE_S
    retain_finished_s: float = DEFAULT_RETAIN_FINISHED_S  # finished jobs older than this are removed
    max_waiting_jobs: int = DEFAULT_MAX_WAITING_JOBS  # beyond it a new job is refused (or an unheld one closed)
    waiting_jobs_per_address: int = DEFAULT_WAITING_JOBS_PER_ADDRESS  # held by one creator address (0: no limit)
    min_free_disk: int = DEFAULT_MIN_FREE_DISK  # bytes; below it a new job is refused (0: no check)
    host_rules: HostRules = field(default_factory=HostRules)  # cool-downs of failing hosts, the host table's cap
