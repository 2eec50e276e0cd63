"""High availability: rdzv-server replicas on etcd v3 (``--etcd``).

Several servers run against one etcd cluster; exactly one, the leader, serves
agents and REST. Leadership is a key, ``<prefix>leader``, created in a
transaction only if it does not exist and bound to the replica's lease
(``--etcd-lease-ttl``, kept alive every TTL/4). The key's create revision is
the leader's *term*: every write of job or host state is a transaction that
compares the leader key's create revision with the term, so a deposed leader
(its lease expired, the key gone or someone else's) cannot write anything.

A replica stops serving (drops every agent connection, forgets the state,
answers ``not_leader``) the moment its lease could have expired: a lease kept
alive by a request sent at ``t`` lasts at least until ``t + TTL`` in etcd, so
the replica counts from the *sending* of its last answered keep-alive and stops
a margin before that. Nobody else can be elected before the lease expires or is
revoked, so the leaderships never overlap, except that a leader whose lease a
follower revoked (see below) serves until its next read of its key (a poll):
it can change nothing then, every write being fenced. A write that etcd applied after the replica stopped
serving is not announced (a write's answer is acted on only while serving).

Followers read the leader key every ``POLL_S`` and campaign when it is gone:
the successor at once, the others after a head start (:mod:`rdzv_server.ha_peers`:
each replica registers on its lease, the first registered after the leader is
the successor, and the leader names it to its agents, who go there first).
A leader whose *process* died (killed, crashed) leaves its key until its lease
expires; followers see that sooner (:mod:`rdzv_server.ha_probe`): beside each
poll, a probe opens a TCP connection to the leader's ``--advertise-url``, and
once one succeeded in this term, refused connections in a row (nothing
listens: the process is gone) make the follower revoke the leader's lease,
and the next poll elects a new leader at once. This is an optimisation, not what safety
rests on: a leader revoked by mistake (a firewall that rejects connections
looks like a death) cannot write (its term's key is gone, its fenced writes
fail), and it stops serving when it next reads its key (every poll) or its
lease (every keep-alive). A leader that is frozen or cut off (connections time
out rather than being refused) still loses its place only when its lease
expires. A replica stopped by SIGTERM hands over (revokes its own lease)
before it closes its port. The new leader loads every job and host from etcd and serves them as a
restarted server does (every node gets a full heartbeat timeout to reconnect;
running workers are not restarted). Heartbeats never touch etcd; only round
changes, job creation and host records do (see :mod:`rdzv_server.outbox`).

Keys under the prefix (``/rdzv/`` by default): ``leader`` (JSON: url, id),
``replicas/<replica id>`` (the same JSON, bound to that replica's lease),
``jobs/<job id>`` and ``jobdata/<job id>/...`` (a job's pointer and the blobs
it names, :mod:`rdzv_server.etcd_jobs`: a write's pointer commits last, so a
new leader never loads half a round) and ``hosts/<host>`` (the ``record`` as
SQLite keeps it); every value is JSON with ``by`` the replica id and ``term``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from rdzv_common.errors import NotLeaderError
from rdzv_common.tasks import cancel_and_wait
from rdzv_common.wire import printable

from . import etcd, etcd_jobs, ha_peers, ha_standby, joblog
from .etcd_jobs import StateError
from .ha_peers import Succession, leader_of, url_of
from .ha_probe import LeaderProbe
from .hosts import HostRecord

log = logging.getLogger(__name__)

DEFAULT_LEASE_TTL_S = 2
DEFAULT_PREFIX = "/rdzv/"
POLL_S = 0.1  # a follower reads the leader key this often (a linearizable read; cheap)
WATCHDOG_S = 0.05  # how often the leader checks that its lease is still surely alive
LOAD_RETRY_S = 5.0  # an elected replica that found a record not rdzv's loads again this often


@dataclass
class HASettings:
    """``--etcd`` and its options (rdzv_server.__main__)."""

    endpoints: list[str]
    advertise_url: str
    prefix: str = DEFAULT_PREFIX
    lease_ttl_s: int = DEFAULT_LEASE_TTL_S
    ssl_ctx: ssl.SSLContext | None = None
    user: str | None = None
    password: str | None = None

    def replica(self) -> Replica:
        client = etcd.EtcdClient(self.endpoints, ssl_ctx=self.ssl_ctx, user=self.user, password=self.password)
        return Replica(client, self.advertise_url, self.prefix, self.lease_ttl_s)


def _margin(ttl: float) -> float:
    """Stop serving this long before the lease could expire (scheduling, clock rates)."""
    return max(0.25, 0.15 * ttl)


class Replica:
    """One HA replica: its leadership, and the reads and writes of the state in etcd.

    ``on_elected`` (a coroutine) loads and starts serving; ``on_deposed(reason)``
    (plain) stops serving at once. Both are set by the app before :meth:`run`."""

    def __init__(
        self,
        client: etcd.EtcdClient,
        advertise_url: str,
        prefix: str = DEFAULT_PREFIX,
        lease_ttl_s: int = DEFAULT_LEASE_TTL_S,
        replica_id: str | None = None,
    ) -> None:
        self.client = client
        self.advertise_url = advertise_url
        self.prefix = prefix.encode()
        self.leader_key = self.prefix + b"leader"
        self.lease_ttl_s = lease_ttl_s
        self.requests = 0  # write transactions sent to etcd (rdzv_storage_write_requests_total)
        self.id = replica_id or f"{socket.gethostname()[:64]}-{os.getpid()}-{secrets.token_hex(3)}"
        self.role = "follower"
        self.term = 0  # the leader key's create revision while we lead
        self.leader_url: str | None = None
        self.ready = False  # leader and its state loaded: serving
        self.lease = 0
        self._ttl = float(lease_ttl_s)
        self._lease_until = 0.0  # monotonic: the lease surely lives until then
        self.on_elected: Callable[[], Awaitable[None]] | None = None
        self.on_deposed: Callable[[str], None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._probe = LeaderProbe(client, self._error)  # a follower's connects to the leader's advertise URL
        self.succession = Succession(self.id)  # the registered replicas: who campaigns first (ha_peers)
        self.standby = ha_standby.Standby(client, self.prefix)  # the successor's copy of the state
        self._registered = 0  # the lease our registration (ha_peers.PEERS) is bound to
        self._wake = asyncio.Event()  # set: the campaign polls now
        self._ka_thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._stopped = False
        self._lease_lock = threading.Lock()  # (lease, _lease_until): the keep-alive thread writes them too
        self._last_error_log = 0.0
        self._read_at = 0.0  # monotonic: the last answered read of the leader key (what leader_url says)
        self.elections = 0  # times this replica became leader

    # ------------------------------------------------------------ state

    @property
    def serving(self) -> bool:
        """Leader, state loaded, and the lease surely alive."""
        return self.ready and self.role == "leader" and time.monotonic() < self._lease_until - _margin(self._ttl)

    def refusal(self) -> NotLeaderError:
        leader = self.leader_url if self.leader_url != self.advertise_url else None
        if self.role == "leader" and not self.ready:
            why = "this replica was just elected leader and is loading the state; retry"
        elif leader and self._probe.refusing:  # named, a client would go there and be refused
            why = f"this replica is not the leader; the leader {leader} refuses connections (an election is due); retry"
            leader = None
        elif leader:
            why = f"this replica is not the leader; the leader is {leader}"
        else:
            why = "this replica is not the leader and no leader is known now (an election); retry"
        return NotLeaderError(why, leader=leader)

    # ------------------------------------------------------- lifecycle

    async def start(self) -> None:
        await self.client.start()
        self._stopping.clear()
        self._stopped = False
        self._ka_thread = threading.Thread(
            target=self._keepalive, args=(asyncio.get_running_loop(),), name="rdzv-ha-keepalive", daemon=True
        )
        self._ka_thread.start()
        self._tasks = [
            asyncio.create_task(self._campaign(), name="rdzv-ha-campaign"),
            asyncio.create_task(self._watchdog(), name="rdzv-ha-watchdog"),
        ]

    async def stop(self) -> None:
        """Stop; a leader revokes its lease so that a follower takes over at once.
        Once: a second call does nothing."""
        if self._stopped:
            return
        self._stopped = True
        await cancel_and_wait(*self._tasks)
        await self._probe.stop()
        self._tasks = []
        self._stopping.set()
        if self._ka_thread is not None:
            await asyncio.to_thread(self._ka_thread.join, 10.0)  # at most one keep-alive's timeouts
            self._ka_thread = None
        was_leader = self.role == "leader"
        self._depose("this replica is stopping", quiet=True)
        if self.lease:
            try:
                await self.client.revoke(self.lease)
                if was_leader:
                    log.info("leadership handed over: lease revoked")
            except etcd.EtcdError as e:
                log.warning("could not revoke the lease (%s); a follower takes over when it expires", e)
        await self.client.close()

    def reload(self, reason: str) -> None:
        """Stop serving now and, if the lease still holds the leader key, lead
        again in the same term with the state loaded afresh from etcd."""
        log.warning("stepping aside to reload the state from etcd: %s", reason)
        self._depose(reason, quiet=True)

    def _depose(self, reason: str, quiet: bool = False) -> None:
        if self.role != "leader":
            return
        self.role, self.term, self.ready = "follower", 0, False
        self.leader_url = None
        if not quiet:
            log.error("leadership lost: %s; this replica stops serving (agents reconnect to the new leader)", reason)
        if self.on_deposed is not None:
            self.on_deposed(reason)

    def _error(self, what: str, e: Exception) -> None:
        now = time.monotonic()
        if now - self._last_error_log >= 5.0:
            self._last_error_log = now
            log.warning("etcd: %s: %s", what, printable(str(e), 300))

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_S)
            if self.role == "leader" and time.monotonic() >= self._lease_until - _margin(self._ttl):
                self._depose(
                    f"the lease could not be renewed in time (etcd unreachable or too slow; "
                    f"--etcd-lease-ttl {self._ttl:g}s)"
                )

    def may_pause(self, seconds: float) -> bool:
        """Whether this process may stop ``seconds`` with the GIL held (the
        collector's valve, rdzv_server.gc_policy) and still lead after it: a
        follower may; a leader while its lease surely lives that long past now,
        with the margin (the keep-alive thread cannot renew it meanwhile)."""
        if self.role != "leader":
            return True
        return time.monotonic() + seconds < self._lease_until - _margin(self._ttl)

    def _keepalive(self, loop: asyncio.AbstractEventLoop) -> None:
        """The lease's keep-alive, in a thread of its own (blocking HTTP): an
        event loop busy with a reconnect storm, or starved of CPU, must not cost
        the leadership (bench.ha saw a leader depose itself while 1,000 nodes
        reconnected to it on a loaded machine). Safety does not depend on it:
        the lease is counted from the sending of an answered keep-alive either way."""
        while not self._stopping.is_set():
            interval = max(0.1, self._ttl / 4)
            lease = self.lease
            if not lease:
                self._stopping.wait(interval)
                continue
            sent = time.monotonic()
            try:
                left = self.client.keepalive_blocking(lease, timeout_s=interval)
            except etcd.EtcdError as e:
                loop.call_soon_threadsafe(self._error, "lease keep-alive failed", e)
            except Exception as e:  # a bug here must not end the keep-alive for good
                loop.call_soon_threadsafe(self._error, "lease keep-alive failed (bug)", e)
            else:
                with self._lease_lock:
                    if self.lease == lease and left > 0:
                        self._lease_until = max(self._lease_until, sent + left)
                if left <= 0:
                    loop.call_soon_threadsafe(self._lease_gone, lease)
            self._stopping.wait(max(0.0, interval - (time.monotonic() - sent)))

    def _lease_gone(self, lease: int) -> None:
        """(event loop) etcd says ``lease`` no longer exists."""
        with self._lease_lock:
            if self.lease != lease:
                return
            self.lease = 0
        self._depose("the lease expired in etcd")

    async def _grant(self) -> None:
        sent = time.monotonic()
        lease, ttl = await self.client.grant(self.lease_ttl_s)
        with self._lease_lock:
            self.lease, self._ttl, self._lease_until = lease, float(ttl), sent + ttl

    async def _campaign(self) -> None:
        while True:
            try:
                if self.role != "leader":
                    await self._try_lead()
                else:
                    await self._check_key()
            except etcd.EtcdError as e:
                self._error("campaign", e)
                if self.role != "leader" and time.monotonic() - self._read_at > self._ttl:
                    self.leader_url = None  # that leadership may be over by now: name none rather than a dead one
            except StateError:  # said by _depose (which key); it stays until someone removes it: retry slowly
                await asyncio.sleep(LOAD_RETRY_S)
            except Exception:  # a bug here must not end the campaign for good
                log.exception("campaign failed")
            try:
                await self._keep_registered()
            except etcd.EtcdError as e:
                self._error("registering this replica, or its standby copy of the state", e)
            except Exception:  # a bug here must not end the campaign for good
                log.exception("registering this replica, or its standby copy of the state, failed")
            with contextlib.suppress(asyncio.TimeoutError):  # a poll, or at once after the probe revoked
                await asyncio.wait_for(self._wake.wait(), POLL_S)
            self._wake.clear()

    async def _keep_registered(self) -> None:
        """This replica's registration (ha_peers) on its lease, the others' read when due, and
        (the successor) its copy of the state kept current (ha_standby)."""
        if self._stopped:
            return
        if not self.lease:
            await self._grant()
        lease = self.lease
        if lease and self._registered != lease:
            await self.client.txn([], [etcd.put(self.prefix + ha_peers.PEERS + self.id.encode(), self._value, lease)])
            self._registered = lease
        if self.succession.due(time.monotonic()):
            await self._read_peers()
        if self.role == "leader":
            self.standby.drop()
        else:  # the marks checked here; a read of the copy runs in a task, cancelled at an election
            await self.standby.keep(self.succession.is_successor(), time.monotonic())

    async def _read_peers(self) -> None:
        kvs, _ = await self.client.range_prefix(self.prefix + ha_peers.PEERS)
        self.succession.read(ha_peers.parse(kvs), time.monotonic())

    @property
    def _value(self) -> bytes:
        """The leader key's value and this replica's registration: its URL and id."""
        return json.dumps({"url": self.advertise_url, "id": self.id}).encode()

    @property
    def successor_url(self) -> str | None:
        """(serving leader) The replica its agents go to first when it goes, if any (ha_peers)."""
        return self.succession.successor_url() if self.serving else None

    def _revoked(self, url: str) -> None:
        """(the probe) The lease of the leader at ``url`` was revoked: it names no leader
        now, and the campaign polls at once."""
        if self.leader_url == url:
            self.leader_url = None
        self._wake.set()

    async def _check_key(self) -> None:
        """(leader) Stop serving when the leader key of this term is gone: a
        follower revoked the lease (it took this replica for dead), or someone
        deleted the key. The keep-alive would tell within TTL/4; this, within a poll."""
        term = self.term
        kv = await self.client.get(self.leader_key)
        if self.role == "leader" and self.term == term and (kv is None or kv.create_revision != term):
            self._depose("the leader key of this term is gone from etcd (its lease was revoked, or the key deleted)")

    async def _try_lead(self) -> None:
        kv = await self.client.get(self.leader_key)
        now = self._read_at = time.monotonic()
        if kv is not None and not (self.lease and kv.lease == self.lease):
            self.leader_url, leader_id = leader_of(kv.value)
            self.succession.leader_seen(leader_id)
            self._probe.beside(kv, self.leader_url, self._revoked)
            return
        if kv is None and not self.succession.may_campaign(now):
            self.leader_url = None  # the successor's turn first (ha_peers)
            if self.succession.gone_since == now:  # said once an election
                first = ha_peers.successor(self.succession.peers, self.succession.leader_id)
                log.info(
                    "the leader key is gone: its successor %s campaigns first (this replica waits up to %gs)",
                    first.url if first else "?",
                    ha_peers.HEAD_START_S,
                )
            return
        if not self.lease or time.monotonic() >= self._lease_until - _margin(self._ttl):
            if kv is not None:
                # The key is bound to our lease, which etcd still holds (it restores leases
                # after an outage of the whole cluster) but we have not renewed in time. Leading
                # on it with a new lease would leave the key to expire with the old one, and
                # another replica would be elected while this one still serves (seen in
                # tests/ha/test_failover.py: two replicas said leader). The keep-alive renews the
                # old lease first (or finds it gone, and the key goes with it).
                # (found by bench.ha too: a leader deposed by its watchdog under load re-led this way)
                self.leader_url = None
                return
            await self._grant()
        if kv is not None:  # the key is ours (our lease): we lead again in its term
            term = kv.create_revision
        else:
            value = self._value
            r = await self.client.txn(
                [etcd.created_at(self.leader_key, 0)],
                [etcd.put(self.leader_key, value, self.lease)],
                [etcd.get(self.leader_key)],
            )
            if not r.succeeded:
                got = r.ranged(0)
                self.leader_url = url_of(got[0].value) if got else None
                return
            term = r.revision
            try:  # who succeeds this replica, before any agent is told (ha_peers)
                await self._read_peers()
            except etcd.EtcdError as e:  # the next poll reads them (0.1 s); the leadership is won
                self._error("reading the registered replicas", e)
        self.succession.leader_seen(self.id)  # the next time the key goes, the wait counts from then
        self.role, self.term, self.ready = "leader", term, False
        self.leader_url = self.advertise_url
        self.elections += 1
        log.info(
            "elected leader (term %d, lease %x, ttl %gs); loading the state from etcd", term, self.lease, self._ttl
        )
        try:
            if self.on_elected is not None:
                await self.on_elected()
        except Exception as e:
            if self.role == "leader" and self.term == term:
                self._depose(f"cannot load the state: {e}")
            raise
        if self.role == "leader" and self.term == term:
            self.ready = True

    # ----------------------------------------------------- the state

    def _wrap(self, record_json: str, field: str = "record") -> bytes:
        head = json.dumps({"by": self.id, "term": self.term}, separators=(",", ":"))
        return (head[:-1] + f',"{field}":' + record_json + "}").encode()

    async def load(self) -> ha_standby.State:
        """Every job (and what etcd holds of it) and host record under the prefix
        (raises StateError on a foreign record): the successor's copy when etcd
        holds nothing newer (rdzv_server.ha_standby), else read now."""
        state = await self.standby.take()
        if state is not None:
            log.info("the state is the standby copy read before the election (etcd holds nothing newer)")
            return state
        return await ha_standby.load(self.client, self.prefix)

    async def write(self, ops: list[dict[str, Any]]) -> None:
        """Apply ``ops`` (etcd.put/delete) in order, only while this replica
        leads in its term: in one transaction, or in several (each fenced) when
        they are over etcd.MAX_TXN_OPS or etcd.MAX_TXN_BYTES. Raises NotLeaderError (and stops serving)
        when it does not; etcd.EtcdError when etcd cannot be reached."""
        for batch in etcd.batches(ops):
            if not self.serving:
                raise self.refusal()
            term = self.term
            self.requests += 1
            fence, check = [etcd.created_at(self.leader_key, term)], [etcd.get(self.leader_key)]
            r = await self.client.txn(fence, batch, check, timeout_s=self.write_timeout())
            if not r.succeeded:
                if self.term == term:
                    self._depose("a write found the leader key changed (another replica leads)")
                # after _depose (which forgets the leader): the refusal names the one just read
                got = r.ranged(0)
                self.leader_url = url_of(got[0].value) if got else None
                raise self.refusal()
            if not self.serving:  # applied, but too late to announce: the next leader loads it
                raise self.refusal()

    def write_timeout(self) -> float:
        """How long a write may wait for etcd: while the lease surely holds (the answer of a
        write that came later is not acted on: see write), and at least the client's timeout. A
        starved etcd that answers in 3 s must not cost a job its round change (and every agent
        of it a reconnect) under a lease of 10 s; under the default 2 s lease this is the client's."""
        with self._lease_lock:
            until = self._lease_until
        return max(self.client.timeout_s, until - _margin(self._ttl) - time.monotonic())

    def job_ops(self, job_id: str, plan: joblog.Plan | None) -> list[dict[str, Any]]:
        """The operations of a job's write (``plan``), or its removal (None), in this term."""
        return etcd_jobs.ops(self.prefix, job_id, plan, self._wrap)

    def host_ops(self, records: list[HostRecord], removed: list[str]) -> list[dict[str, Any]]:
        ops = [etcd.delete(self.prefix + b"hosts/" + h.encode()) for h in removed]
        ops += [
            etcd.put(self.prefix + b"hosts/" + r.host.encode(), self._wrap(json.dumps(r.to_record()))) for r in records
        ]
        return ops
