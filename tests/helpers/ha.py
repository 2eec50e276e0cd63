"""rdzv-server replicas on a real etcd cluster, for the HA tests (issue 11).

:class:`HAServers` starts N ``rdzv-server`` replicas of one deployment
against an :class:`tests.helpers.etcd.EtcdCluster`, each a process of a
:class:`tests.helpers.cluster.Cluster` (so the cluster's teardown kills it,
by pid, with everything else the test started)::

    ha = HAServers(cluster, etcd_cluster)
    ha.start(3)                   # every replica on every etcd endpoint
    ha.start(3, per_member=True)  # replica i talks to etcd member i only
    leader = ha.leader()          # polls /healthz until exactly one leads
    agent = ha.start_agent("job1", "loop.py", "--steps", "40")
    ha.kill9(leader)

* a replica is ``python -m rdzv_server --host 127.0.0.1 --port <free>
  --etcd <endpoints> --etcd-prefix <prefix> --advertise-url
  http://127.0.0.1:<port> --etcd-lease-ttl 2`` (no ``--data-dir``: the state
  is in etcd), logged to ``tmp/<name>.log``; :meth:`HAServers.start_replica`
  returns once its ``/healthz`` answers (a follower answers it too; a
  replica that exits first most likely lost its port: another is tried);
* the prefix is unique per :class:`HAServers` (``/rdzv-<cluster tag>/``),
  so replicas of two tests never meet in one etcd;
* :attr:`HAServers.endpoint_list` is what agents get: ``127.0.0.1:p1,...``
  in replica order; :meth:`HAServers.start_agent` starts a real agent with it
  (the flags of :meth:`Cluster.agent_argv`);
* :meth:`HAServers.leader` is the replica whose /healthz says ``role:
  leader`` (waited for, with a deadline, until exactly one does);
  :meth:`Replica.role` / :meth:`HAServers.roles` read one or all;
* :meth:`HAServers.kill9`, :meth:`HAServers.stop` (SIGTERM, the graceful
  hand-over) act on a replica by its pid;
* :func:`log_times` reads the timestamps of a replica's log lines matching a
  pattern (the server's text log: ``2026-01-01 12:00:00,123 LEVEL ...``);
* :meth:`HAServers.leader_lease` is the lease the leader key is bound to in
  etcd now, :func:`elected_lease` the lease a replica said it was elected
  with (its log);
* :meth:`HAServers.leader_terms` and :func:`fencing_violations` read etcd's
  history under the prefix: which replica held which term, and every job or
  host write that was not made by the replica holding the live leader key of
  its term at that revision.

Stdlib only, like the other helpers.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cluster import E2E_SCRIPTS, Cluster
from .etcd import EtcdCluster, Event, b64
from .procs import Proc, Server, free_port, wait_healthy, wait_until

LEASE_TTL_S = 2
LOG_TIME_RE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


@dataclass
class Replica(Server):
    """One rdzv-server replica: a :class:`Server` (REST, log) plus its index
    and the etcd endpoints it was given."""

    index: int = 0
    etcd: tuple[str, ...] = ()

    @property
    def advertise_url(self) -> str:
        return self.url

    def health(self, timeout: float = 1.0) -> dict[str, Any] | None:
        """Its /healthz body, or None when it does not answer 200."""
        try:
            status, body = self.request("GET", "/healthz", timeout=timeout)
        except (OSError, ValueError):
            return None
        return body if status == 200 and isinstance(body, dict) else None

    def role(self) -> str | None:
        """``leader`` or ``follower`` as its /healthz says; None when it does not answer."""
        h = self.health()
        return None if h is None else h.get("role")

    @property
    def running(self) -> bool:
        return self.popen.poll() is None


@dataclass
class HAServers:
    """The replicas of one rdzv deployment on ``etcd`` (see the module docstring)."""

    cluster: Cluster
    etcd: EtcdCluster
    prefix: str = ""
    lease_ttl: int = LEASE_TTL_S
    replicas: list[Replica] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prefix:
            self.prefix = f"/rdzv-{self.cluster.tag}/"

    # ------------------------------------------------------------ starting

    def start(
        self, n: int = 3, per_member: bool = False, flags: tuple[str, ...] = (), timeout: float = 30.0
    ) -> list[Replica]:
        """Start ``n`` replicas: each on every etcd endpoint, or with
        ``per_member`` replica i on member i's endpoint only (i modulo the
        members); return them once each answers /healthz."""
        out = []
        for i in range(n):
            endpoints = [self.etcd.endpoints[i % len(self.etcd.endpoints)]] if per_member else self.etcd.endpoints
            out.append(self.start_replica(endpoints, flags=flags, timeout=timeout))
        return out

    def argv(self, port: int, etcd_endpoints: list[str], flags: tuple[str, ...] = ()) -> list[str]:
        """The command line of a replica on ``port``."""
        return [
            sys.executable, "-m", "rdzv_server",
            "--host", "127.0.0.1",
            "--port", str(port),
            "--etcd", ",".join(etcd_endpoints),
            "--etcd-prefix", self.prefix,
            "--advertise-url", f"http://127.0.0.1:{port}",
            "--etcd-lease-ttl", str(self.lease_ttl),
            *flags,
        ]  # fmt: skip

    def start_replica(
        self,
        etcd_endpoints: list[str] | None = None,
        name: str | None = None,
        flags: tuple[str, ...] = (),
        timeout: float = 30.0,
    ) -> Replica:
        """One more replica (on ``etcd_endpoints``, default every member's),
        named ``name`` (default ``replica<i>``); returns once /healthz answers."""
        index = len(self.replicas)
        endpoints = list(etcd_endpoints or self.etcd.endpoints)
        base = name or f"replica{index}"
        for attempt in range(3):
            port = free_port()
            proc_name = base if attempt == 0 else f"{base}.try{attempt}"
            replica = self.cluster.start(
                proc_name, self.argv(port, endpoints, flags), cls=Replica, port=port, index=index, etcd=tuple(endpoints)
            )
            if wait_healthy(replica, timeout):
                self.replicas.append(replica)
                return replica
        raise AssertionError(f"replica {base} would not start:\n{replica.text()[-3000:]}")

    # ------------------------------------------------------------ reading

    @property
    def endpoint_list(self) -> str:
        """Every replica's ``127.0.0.1:port``, comma-separated, in replica order (an agent's --endpoint)."""
        return ",".join(r.endpoint for r in self.replicas)

    def roles(self) -> dict[str, str | None]:
        """Replica name -> its /healthz role (None: not answering)."""
        return {r.name: r.role() if r.running else None for r in self.replicas}

    def leader(self, timeout: float = 20.0, exclude: tuple[Replica, ...] = ()) -> Replica:
        """The replica that leads: polled until exactly one running replica
        (not in ``exclude``) says ``role: leader`` and no other one does."""

        def one() -> Replica | None:
            leading = [r for r in self.replicas if r.running and r.role() == "leader"]
            if len(leading) == 1 and leading[0] not in exclude:
                return leading[0]
            return None

        try:
            found: Replica = wait_until(one, timeout, "exactly one replica to lead")
        except AssertionError as e:
            raise AssertionError(f"{e}; roles now: {self.roles()}") from None
        return found

    def by_url(self, url: str) -> Replica:
        for r in self.replicas:
            if r.advertise_url == url.rstrip("/"):
                return r
        raise KeyError(url)

    def events(self) -> list[Event]:
        """etcd's whole history under this deployment's prefix."""
        return self.etcd.events(self.prefix)

    def leader_terms(self, events: list[Event] | None = None) -> dict[int, tuple[str, str]]:
        """term -> (replica id, advertise URL) of every leadership etcd saw
        under the prefix (the leader key's create revisions)."""
        events = self.events() if events is None else events
        out = {}
        for e in events:
            if e.key == self.prefix + "leader" and e.value is not None and e.create_revision == e.revision:
                v = json.loads(e.value)
                out[e.revision] = (str(v.get("id")), str(v.get("url")))
        return out

    def leader_lease(self) -> int | None:
        """The lease the leader key is bound to in etcd now (None: no leader key)."""
        answer = self.etcd.call("/v3/kv/range", {"key": b64(self.prefix + "leader")}, member=self._live_member())
        kvs = answer.get("kvs") or []
        return int(kvs[0].get("lease", 0)) if kvs else None

    def _live_member(self) -> int:
        return next(i for i, m in enumerate(self.etcd.members) if m.running and not m.paused)

    # ------------------------------------------------------------ stopping

    def kill9(self, replica: Replica, timeout: float = 10.0) -> None:
        """SIGKILL the replica by its pid and reap it."""
        if replica.running:
            os.kill(replica.pid, signal.SIGKILL)
        replica.wait_exit(timeout)

    def stop(self, replica: Replica, timeout: float = 10.0) -> int:
        """SIGTERM (a leader hands over: it revokes its lease), SIGKILL after ``timeout``."""
        return replica.stop(timeout)

    # ------------------------------------------------------------ agents

    def start_agent(
        self,
        job_id: str,
        script: str | Path,
        *script_args: str,
        nnodes: str = "2",
        nproc: int = 1,
        flags: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        name: str | None = None,
    ) -> Proc:
        """A real rdzv-agent with ``--endpoint`` = every replica
        (:attr:`endpoint_list`) running ``script`` (a path, or a name in
        tests/e2e/scripts); logged to ``tmp/NAME.log``."""
        script_path = Path(script) if os.sep in str(script) else E2E_SCRIPTS / script
        n = sum(1 for p in self.cluster.procs if not isinstance(p, Server))
        argv = self.cluster.agent_argv(self.endpoint_list, job_id, nnodes, nproc, flags)
        proc: Proc = self.cluster.start(name or f"agent{n + 1}", [*argv, str(script_path), *script_args], env)
        return proc


def log_times(proc: Proc, pattern: str) -> list[dt.datetime]:
    """The timestamps of ``proc``'s text-log lines (``YYYY-mm-dd HH:MM:SS,mmm ...``)
    that match ``pattern`` (a regex searched in the line), in log order."""
    rx = re.compile(pattern)
    out = []
    for line in proc.text().splitlines():
        m = LOG_TIME_RE.match(line)
        if m and rx.search(line):
            out.append(dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f"))
    return out


def elected_lease(replica: Proc) -> int | None:
    """The lease of the replica's latest "elected leader (term N, lease HEX, ..." log line."""
    found = re.findall(r"elected leader \(term \d+, lease ([0-9a-f]+)", replica.text())
    return int(found[-1], 16) if found else None


def fencing_violations(events: list[Event], prefix: str) -> list[str]:
    """Every job/host write (a job's pointer and blobs too) under ``prefix`` whose ``(by, term)`` is not the
    leadership live at its revision: the leader key must exist then, have
    been created at revision ``term`` (and not deleted since), and name
    ``by`` as its replica id. Also a write without by/term, and a leader key
    whose value is not ``{"url", "id"}``. Empty: etcd's history shows no
    replica writing outside its term, so no two leaders' writes interleave."""
    leader_key = prefix + "leader"
    live: tuple[int, str] | None = None  # (create revision, id) of the live leader key
    problems = []
    for e in events:
        if e.key == leader_key:
            if e.value is None:
                live = None
                continue
            try:
                v = json.loads(e.value)
                live = (e.create_revision, str(v["id"]))
                if not isinstance(v.get("url"), str):
                    raise KeyError("url")
            except (ValueError, KeyError, TypeError):
                problems.append(f"rev {e.revision}: leader key value {e.value[:200]!r} is not {{url, id}}")
                live = None
            continue
        if not e.key.startswith((prefix + "jobs/", prefix + "jobdata/", prefix + "hosts/")):
            continue
        if e.value is None:
            # a delete carries no by/term; it must still happen inside a leadership
            if live is None:
                problems.append(f"rev {e.revision}: delete of {e.key} while no leader key was live")
            continue
        try:
            v = json.loads(e.value)
            by, term = str(v["by"]), int(v["term"])
        except (ValueError, KeyError, TypeError):
            problems.append(f"rev {e.revision}: {e.key} holds no by/term: {e.value[:200]!r}")
            continue
        if live is None:
            problems.append(f"rev {e.revision}: {e.key} written by {by} (term {term}) while no leader key was live")
        elif live != (term, by):
            problems.append(
                f"rev {e.revision}: {e.key} written by {by} (term {term}) while {live[1]} led (term {live[0]})"
            )
    return problems
