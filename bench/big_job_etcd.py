"""bench/big_job.py on etcd (``--etcd [--replicas 3]``): the same job against
``rdzv-server --etcd`` replicas on a 3-member etcd (bench/ha.py's helpers:
lease TTL 2 s, etcd's default request limits). Storage bytes are what the etcd
members wrote to disk (/proc io of their processes: WAL, snapshots, their
logs); requests are the leader's ``rdzv_storage_write_requests_total`` (etcd
transactions); the largest request is the leaders'
``rdzv_storage_max_request_bytes`` (the body as sent: its JSON, values in
base64, more than what etcd's 1.5 MiB ``--max-request-bytes`` counts).

The nodes are bench/bigagents.py ``--follow`` clients: each is given every
replica's address and keeps its link as the agent does (bench/follow.py).
After the scale-up, one more row:

leader kill
    kill -9 of the leader replica (with more than one). From the kill: a new
    leader elected and serving (its log's "elected leader" and "loaded"
    lines); the first resume taken by it (its log's first "node N
    reconnected", the server's clock: the job's first 64 such lines are
    logged, then one every 5 s, rdzv_server.rounds.events.comeback) and
    every node holding its assignment again on its new connection (the
    node's own clock, which reads it after the server took the resume);
    then the new leader's job view:
    the round the nodes resumed, complete, with every node. "Everything
    back" is the last of these. A re-formation (nodes lost meanwhile) shows
    as a later round, and everything back waits for it.

``--lease-ttl S``: the replicas' ``--etcd-lease-ttl`` (2 s, bench.ha's, by
default; the kill -9 takeover does not wait for it, so a longer one changes
only how much starvation a leader rides out). ``--profile FILE``: every
replica under cProfile, its stats in ``FILE.<pid>`` (the new leader's pid is
in the results, ``new_leader_pid``). The table says when a leader lost its
lease during the run (then the phases' CPU and storage read the first leader).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from . import _common as C
from . import ha
from .server_scale import Server


def kill_timeout(n: int) -> float:
    """The bound of each wait of the leader kill: 20 s at 8 nodes (a node that does not
    follow fails the smoke test fast), 61 s at 16,384."""
    return 20.0 + n / 400


TARGET_S = 5.0  # issue 24: leader kill -> everything back
# The job runs this long after its last round change (the scale-up) before its leader is
# killed: a failure comes at any time of a run, seldom within seconds of a round change, and
# by then the successor holds a current copy of the state (rdzv_server.ha_standby). The row
# says whether the new leader served it; --kill-after 0 measures a kill right after a change.
RUNNING_S = 4.0
ETCD_LIMIT = 1_572_864  # etcd's default --max-request-bytes (1.5 MiB)


class EtcdServer:
    """What big_job.run uses of a server: the leader replica's url, pid, log, metrics."""

    def __init__(self, tmp: Path, replicas: int, python: str = "", lease_ttl: int | None = None) -> None:
        """``python``: what runs each replica (big_job's --profile: cProfile, its stats in a file per pid)."""
        self.etcd = ha._etcd(tmp / "etcd")
        try:
            prefix = f"/bench-big-{os.getpid()}/"
            ttl = str(lease_ttl or ha.LEASE_TTL_S)
            from .big_job import JOIN_DEADLINE_S

            flags = ("--join-deadline", str(JOIN_DEADLINE_S), "--etcd-lease-ttl", ttl)  # (the last ttl counts)
            self.replicas = ha.Replicas(replicas, tmp, self.etcd.endpoints, prefix, flags, python)
        except BaseException:
            ha._stop_etcd(self.etcd)
            raise
        leader = self.replicas.leader(30)
        assert leader is not None
        self._lead(leader)
        self.largest = 0  # the largest request of the leaders before the current one

    def _lead(self, leader: ha.Replica) -> None:
        self.leader = leader
        self.url, self.proc, self.log = leader.url, leader.proc, leader.proc.log

    @property
    def endpoint(self) -> str:
        """Every replica, as the nodes are given them (``--endpoint``)."""
        return self.replicas.endpoint

    @property
    def pid(self) -> int:
        return self.leader.pid

    def metrics(self) -> dict[str, float]:
        return Server.metrics(self)  # type: ignore[arg-type]  # only reads self.url

    def max_request_bytes(self) -> int:
        """The largest request any replica of this run sent to etcd (a killed one's: read before the kill)."""
        live = [r for r in self.replicas.all if r.proc.poll() is None]
        got = [Server.metrics(r).get("rdzv_storage_max_request_bytes", 0) for r in live]  # type: ignore[arg-type]
        return int(max([self.largest, *got]))

    def job(self, job_id: str) -> dict | None:
        return self.leader.job(job_id)

    def close_job(self, job_id: str) -> None:
        self.leader.close_job(job_id)

    def stalls(self) -> int:
        return self.proc.text().count("did not run for a while")

    def elections(self) -> int:
        """Leaders elected so far (1 without a failover; more: a leader lost its lease, on a starved machine)."""
        return sum(r.proc.text().count("elected leader (term") for r in self.replicas.all)

    def written(self, io_written) -> tuple[int, int]:
        return sum(io_written(self.etcd.pid(i)) for i in range(len(self.etcd.members))), 0

    def stop(self, grace: float = 5) -> None:
        self.replicas.stop(grace)
        ha._stop_etcd(self.etcd)


def leader_kill(server: EtcdServer, clients: Any, job: str, n: int, log=print, running_s: float = RUNNING_S) -> dict:
    """kill -9 of the leader, ``running_s`` after the last round change; see the module doc.
    ``clients``: big_job.BigClients (``--follow``)."""
    time.sleep(running_s)
    old = server.replicas.leader(kill_timeout(n))  # the leader now (a lease lost under load moves it)
    if old is None:
        raise RuntimeError("no leader to kill")
    server._lead(old)
    before = server.job(job) or {}
    out: dict[str, Any] = {"round_before": before.get("round"), "elections_before": server.elections()}
    server.largest = server.max_request_bytes()
    others = [r for r in server.replicas.all if r is not old]
    cpu0 = {r.pid: C.cpu_ticks(r.pid) or 0 for r in others}
    ccpu, overflows = clients.cpu(), listen_overflows()
    t_kill = time.time()
    C.kill_tree(old.pid)
    new = server.replicas.leader(kill_timeout(n))
    if new is None or new is old:
        raise RuntimeError("no new leader after the leader kill")
    out["serving_s"] = time.time() - t_kill  # (polled: /healthz says leader)
    server._lead(new)
    out["new_leader_pid"] = new.pid  # (--profile: its stats are FILE.<this pid>)
    back = clients.same({"cmd": "back", "since": t_kill, "timeout": kill_timeout(n)})
    times = sorted(t - t_kill for a in back for t in a["back"])
    out["behind"] = sum(a["behind"] for a in back)
    out["refused"] = sum(a["refused"] for a in back)
    out["resumed_rounds"] = sorted({r for a in back for r in a["rounds"]})
    view = server.job(job) or {}
    rnd, world = view.get("round"), view.get("world_size")
    out["round_after"], out["world_after"] = rnd, world
    last_back = times[-1] if times else None
    if rnd is not None and rnd != out["round_before"]:  # re-formed meanwhile: everyone in that round
        got = clients.wait(rnd)
        last_back = got["last"] - t_kill if got["last"] and not got["behind"] else None
        out["behind"] += got["behind"]
        view = server.job(job) or {}
    hist = view.get("history") or [{}]
    complete = hist[-1].get("round") == view.get("round") and hist[-1].get("completed_at") is not None
    out["round_complete"] = complete and view.get("world_size") == n and not out["behind"]
    out["elected_s"] = _rel(new.first("elected leader", t_kill), t_kill)
    out["loaded_s"] = _rel(new.first("loaded ", t_kill), t_kill)
    out["standby"] = new.first("the state is the standby copy", t_kill) is not None  # rdzv_server.ha_standby
    srv = sorted(
        ha._iso_to_unix(ln["time"]) - t_kill
        for ln in ha._json_lines(new.proc.text())
        if ln.get("job") == job and " reconnected" in ln.get("message", "")
    )
    out["srv_first_s"] = srv[0] if srv else None  # (the job's first resumes are logged, not each one)
    out["nodes_p50_s"], out["nodes_p99_s"] = _pct(times, 50), _pct(times, 99)
    out["nodes_max_s"] = last_back
    out["all_s"] = last_back if out["round_complete"] else None
    out["cpu_s"] = (C.cpu_ticks(new.pid) - cpu0[new.pid]) / C.CLK_TCK  # type: ignore[operator]
    out["follower_cpu_s"] = sum((C.cpu_ticks(r.pid) or 0) - cpu0[r.pid] for r in others if r is not new) / C.CLK_TCK
    out["client_cpu_s"] = (clients.cpu() - ccpu) / C.CLK_TCK
    out["load"] = C.loadavg()
    out["listen_overflows"] = listen_overflows() - overflows
    out["elections_after"] = server.elections()  # 1 more than before: the kill's, and no other
    log(f"[big_job] N={n}: leader kill: everything back {out['all_s']} s ({out})")
    return out


def listen_overflows() -> int:
    """The kernel's count of connections a full accept queue turned away (TcpExt ListenOverflows;
    this network namespace, every process in it): each one's client retries after 1, 2, 4 ... s."""
    try:
        head, values = [ln.split() for ln in Path("/proc/net/netstat").read_text().splitlines()[:2]]
        return int(dict(zip(head, values, strict=True)).get("ListenOverflows", 0))
    except (OSError, ValueError):
        return 0


def _rel(t: float | None, t0: float) -> float | None:
    return None if t is None else t - t0


def _pct(values: list[float], q: float) -> float | None:
    return C.percentile(values, q) if values else None


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} s"


def _flaps(lk: dict) -> str:
    """Leaders that lost their lease (a starved machine) besides the kill's election."""
    before, after = lk["elections_before"] - 1, lk["elections_after"] - lk["elections_before"] - 1
    out = f"; {before} leader(s) lost the lease BEFORE the kill (phase CPU/storage read the first)" if before else ""
    return out + (f"; {after} more election(s) after the kill's" if after > 0 else "")


def rows(r: dict) -> list[list[str]]:
    """The table's etcd rows of one run (big_job.table)."""
    n = r["nodes"]
    out = []
    lk = r.get("leader_kill")
    if lk is not None:
        met = "met" if lk["all_s"] is not None and lk["all_s"] < TARGET_S else "NOT met"
        what = (
            f"round {lk['round_after']}, world {lk['world_after']}"
            + (" (re-formed)" if lk["round_after"] != lk["round_before"] else ", no re-formation")
            + (f", {lk['behind']} nodes NOT back" if lk["behind"] else "")
            + _flaps(lk)
        )
        out += [
            [
                f"N={n} leader kill -9 -> every node back on the new leader and the round complete "
                f"(target < {TARGET_S:g} s)",
                f"{_s(lk['all_s'])} ({met}; {what}; CPU: new leader {lk['cpu_s']:.2f} s, the other follower "
                f"{lk['follower_cpu_s']:.2f} s, clients {lk['client_cpu_s']:.2f} s; load {lk['load']})",
            ],
            [
                f"N={n} ... kill -> new leader elected / serving (state loaded) / /healthz says leader",
                f"{_s(lk['elected_s'])} / {_s(lk['loaded_s'])} / {_s(lk['serving_s'])} "
                f"({'its standby copy of the state' if lk.get('standby') else 'the state read at the election'})",
            ],
            [
                f"N={n} ... kill -> the first resume taken by the new leader (its log)",
                f"{_s(lk.get('srv_first_s'))} ({lk['refused']} connection attempts refused on the way; "
                f"{lk.get('listen_overflows', 0)} connections turned away by a full accept queue, any process)",
            ],
            [
                f"N={n} ... kill -> nodes hold their assignment again (their clocks, p50 / p99 / last)",
                f"{_s(lk['nodes_p50_s'])} / {_s(lk['nodes_p99_s'])} / {_s(lk['nodes_max_s'])}",
            ],
        ]
    if "max_request_bytes" in r:
        big = r["max_request_bytes"]
        out.append(
            [
                f"N={n} largest request sent to etcd (rdzv_storage_max_request_bytes, as sent: JSON, base64)",
                f"{big:,} B ({big / 1024:.0f} KiB): {'under' if big < ETCD_LIMIT else 'OVER'} etcd's default "
                f"--max-request-bytes ({ETCD_LIMIT:,} B)",
            ]
        )
    return out
