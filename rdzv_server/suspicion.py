"""Suspicion from the peers, the server's side (issue 23): an agent that
stopped hearing a peer says so (``SuspectMsg``); the server probes the suspect
over its own connection at once and evicts it only when the suspect's *kernel*
acknowledged nothing by the deadline. The rules and the eviction are pure
(:mod:`rdzv_server.rounds.suspicion`); this module does the I/O: the probe is a
WebSocket ping (any client answers it; its kernel acknowledges the segment even
when the process is frozen), the verdict is the kernel's ``tcp_info``
(:mod:`rdzv_common.liveness`), and the deadline follows the connection's RTT.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import TYPE_CHECKING, Any

from rdzv_common.errors import RequestError, UnavailableError
from rdzv_common.liveness import acked_within, rtt_s

from .conns import LogLimiter
from .rounds.suspicion import Suspicions, confirmed, probe_deadline, suspects

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger(__name__)
_note = LogLimiter(log, logging.INFO, burst=20, rate=2.0)


class Suspicion:
    """The store's peer suspicions: open probes and their timers."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.table = Suspicions()
        self._pings: set[asyncio.Future[Any]] = set()

    def forget(self) -> None:
        """An HA replica stepped down: its probes, hold-offs and budgets go (a
        probe's pending judgment then finds nothing open: it judges nobody)."""
        self.table = Suspicions()

    def report(self, job_id: str, reporter: str, round_no: int, nodes: list[str]) -> None:
        """``reporter`` (a node of ``job_id``, the connection's own) suspects ``nodes``."""
        job = self.store.jobs.get(job_id)
        if job is None:
            return
        try:
            named = suspects(job, reporter, round_no, nodes)
        except ValueError as e:
            raise RequestError(str(e)) from None
        if not named:
            return  # stale (the round moved on, the suspect is gone): nothing to do
        now = time.monotonic()
        if not self.table.allow(job_id, reporter, now):
            _note("job %s: suspicion reports of node %s over its rate; ignored", job_id, reporter)
            return
        for suspect in named:
            if self.table.open(job_id, suspect, reporter, round_no, now):
                self._probe(job_id, suspect, round_no, now)

    def silent(self, job_id: str, node_id: str, round_no: int, silent_s: float, now: float) -> bool:
        """The server's own judgment (rdzv_server.pacing): ``node_id``, a running
        member of round ``round_no``, has been silent ``silent_s``; True: probed."""
        if not self.table.open(job_id, node_id, None, round_no, now, silent_s=silent_s):
            return False
        self._probe(job_id, node_id, round_no, now, f"silent for {silent_s * 1000:.0f} ms")
        return True

    def _probe(self, job_id: str, suspect: str, round_no: int, now: float, why: str = "suspected by a peer") -> None:
        chan = self.store.channels.get((job_id, suspect))
        ws = getattr(chan, "ws", None)
        transport = getattr(chan, "transport", None)
        sock = transport.get_extra_info("socket") if transport is not None else None
        if ws is None or sock is None or getattr(chan, "killed", False):
            # nothing to probe (not connected now: the disconnect grace judges it)
            self.table.close(job_id, suspect, answered=True, now=now)
            return
        deadline = probe_deadline(rtt_s(sock))
        _note("job %s: node %s %s; probing it (%.0f ms)", job_id, suspect, why, deadline * 1000)
        ping = asyncio.ensure_future(_ping(ws))
        self._pings.add(ping)
        ping.add_done_callback(self._pings.discard)
        asyncio.get_running_loop().call_later(deadline, self._judge, job_id, suspect, round_no, sock, now)

    def _judge(self, job_id: str, suspect: str, round_no: int, sock: socket.socket, sent: float) -> None:
        now = time.monotonic()
        waited = now - sent
        # an acknowledgement (or any segment) from its host since the probe went out
        acked = acked_within(sock, waited)
        probe = self.table.close(job_id, suspect, answered=acked is not False, now=now, round_no=round_no)
        if probe is None:
            return
        if acked is not False:  # answered; or the kernel cannot say: nobody is judged on it
            _note("job %s: node %s answered the probe; suspicion cleared", job_id, suspect)
            return
        job = self.store.jobs.get(job_id)
        if job is None or not self.store.serving:  # an HA replica that stopped leading meanwhile
            return
        if not probe.reporters and probe.silent_s is not None:  # its silence alone: a lost connection
            self.store.pacing.unanswered(job, suspect, round_no, probe.silent_s + waited, waited)
            return
        t = self.store.clock()
        fx = confirmed(job, suspect, round_no, len(probe.reporters), waited, t, probe.silent_s)
        if not fx.events:
            return  # the round or the node changed meanwhile
        try:
            self.store._apply(job, fx, t)
        except UnavailableError:
            pass  # the write failed: the job is as saved, its heartbeat timeout still runs


async def _ping(ws: Any) -> None:
    try:
        await ws.ping()
    except Exception:  # closing or closed: the connection's own end judges it
        pass
