"""One node's session with the server: the rules both rdzv-agent and the
torchrun plugin follow, in one place.

A :class:`NodeSession` holds the node id (the node secret the server issues
for it lives in the :class:`~rdzv_client.client.AgentLink`, keyed by that id),
the round this node runs, and builds every join:

* :meth:`NodeSession.join` - a fresh join; the round this node ran is over.
* :meth:`NodeSession.resume` - the intent while workers run a round: after a
  reconnect the link re-sends a join with ``resume_round`` and the round's
  master port, so the server keeps this node in its round.
* :meth:`NodeSession.evicted` - the server forgot this node (eviction, or a node
  secret that is not ours): drop the reports that name the old node and join
  under a new node id, which carries no secret until the server issues one.
* :meth:`NodeSession.check_assignment` - what the protocol model cannot check:
  the job id and this node's worker count.
* :meth:`NodeSession.report_failed` (also a give-up), :meth:`report_succeeded`, :meth:`leave`.

:class:`OutageWatch` is the server-timeout bookkeeping: when an outage is news,
when to say it again, when to give up.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rdzv_server.wire import join_fields

if TYPE_CHECKING:
    from rdzv_server.protocol import Assignment, ExitRecord, JobSpec

    from .client import AgentLink

# An outage shorter than this is a reconnect, not news; a longer one is logged
# when it starts, every OUTAGE_LOG_EVERY_S while it lasts, and when it ends.
OUTAGE_NOTICE_AFTER_S = 2.0
OUTAGE_LOG_EVERY_S = 30.0


def new_node_id(host: str) -> str:
    """host, pid and a random suffix: IP addresses make poor ids (reused)."""
    clean = "".join(c if c.isalnum() or c in "._-" else "-" for c in host)[:80].lstrip("-._") or "node"
    return f"{clean}-{os.getpid()}-{secrets.token_hex(3)}"


def host_label(host: str) -> str:
    clean = "".join(c if c.isalnum() or c in "._-" else "-" for c in host)[:255]
    return clean or "node"


def free_port(addr: str) -> int:
    """A port free on this node now: MASTER_PORT, fresh for every round."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr, 0))
        except OSError:
            s.bind(("", 0))
        port: int = s.getsockname()[1]
        return port


def route_addr(host: str, port: int) -> str:
    """The local address that reaches ``host``: what peers can reach us at."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(info[0], socket.SOCK_DGRAM) as s:
            s.connect(info[4])
            local: str = s.getsockname()[0]
            return local
    except OSError:
        return socket.gethostname()


class NodeSession:
    """This node, as the server knows it. ``link`` is set once it exists.

    ``spec``: the job's ``JobSpec``, or its plain fields (``check_spec``): the
    agent builds and sends its first join without pydantic. Joins are plain
    JSON objects (``join_fields``), validated as ``JoinMsg`` by the server."""

    def __init__(
        self,
        *,
        job_id: str,
        host: str,
        nproc: int,
        spec: JobSpec | dict[str, Any],
        addr: str | None = None,
        job_secret: str | None = None,
        requested_rank: int | None = None,
        new_run: bool = True,
    ) -> None:
        self.job_id = job_id
        self.host = host
        self.nproc = nproc
        self.spec: dict[str, Any] = spec if isinstance(spec, dict) else spec.model_dump()
        self.addr = addr
        self.job_secret = job_secret
        self.requested_rank = requested_rank
        self.new_run = new_run  # False: a finished job id refuses this node instead of starting its next run
        self.node_id = new_node_id(host)
        self.assignment: Assignment | None = None  # the round this node runs (or ran and reported)
        self._link: AgentLink | None = None

    @property
    def link(self) -> AgentLink:
        if self._link is None:
            raise RuntimeError("NodeSession.link is used before it is set")
        return self._link

    @link.setter
    def link(self, link: AgentLink) -> None:
        self._link = link

    def join_msg(self, resume: Assignment | None = None) -> dict[str, Any]:
        """The join (or resume) as its plain JSON object."""
        addr = self.addr
        if addr is None:
            raise RuntimeError("NodeSession.addr is set before the node joins")
        return join_fields(
            job_id=self.job_id,
            node_id=self.node_id,
            host=host_label(self.host),
            addr=addr,
            local_world_size=self.nproc,
            master_port=resume.master_port if resume is not None else free_port(addr),
            spec=self.spec,
            requested_rank=self.requested_rank,
            resume_round=resume.round if resume is not None else None,
            job_secret=self.job_secret,
            new_run=self.new_run,
        )

    def join(self) -> None:
        """Ask for a place in the next round (re-sent after every reconnect)."""
        self.assignment = None
        self.link.set_intent(self.join_msg())

    def resume(self, a: Assignment) -> None:
        """This node runs round ``a``: a reconnect re-joins into it."""
        self.assignment = a
        self.link.set_intent(self.join_msg(resume=a), send=False)

    def evicted(self) -> None:
        """The server forgot this node: a new node id (no secret yet), then join."""
        self.link.clear_reports()  # they name the old node
        self.node_id = new_node_id(self.host)
        self.join()

    def check_assignment(self, a: Assignment) -> str | None:
        """What makes an assignment unusable by this node (the model checked
        the rest), or None."""
        if a.job_id != self.job_id:
            return f"assignment for job {a.job_id!r}, this node runs job {self.job_id!r}"
        if a.local_world_size != self.nproc:
            return f"assignment for {a.local_world_size} local worker(s), this node runs {self.nproc}"
        return None

    def report_failed(self, round_no: int, failures: list[ExitRecord], give_up: bool = False) -> None:
        """``give_up``: this node's launcher stops for good after the failure
        (torchrun's own budget is spent): the server fails the job for every node."""
        from rdzv_server.protocol import FailedMsg

        self.link.report(FailedMsg(round=round_no, failures=failures, give_up=give_up))

    def report_succeeded(self, round_no: int) -> None:
        from rdzv_server.protocol import SucceededMsg

        self.link.report(SucceededMsg(round=round_no))

    def leave(self, reason: str) -> None:
        """Leave the job for good: no join after a reconnect."""
        from rdzv_server.protocol import LeaveMsg

        self.link.set_intent(None, send=False)
        self.link.report(LeaveMsg(reason=reason))


@dataclass
class Outage:
    """What :meth:`OutageWatch.check` found: ``kind`` is ``"back"`` (an outage
    that was logged ended), ``"notice"`` (say it now), ``"ongoing"`` (say it on a
    status line at most) or ``"give_up"``."""

    kind: str
    down: float = 0.0
    left: float = 0.0


class OutageWatch:
    """The --server-timeout bookkeeping shared by the agent and the plugin."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._logged_at: float | None = None  # when the outage notice was last logged

    def check(self, down: float, settled: bool = True) -> Outage | None:
        """``down``: seconds without a served join (0 while served); ``settled``:
        the service has held (a server that answers, then drops us at each join,
        is not "back" at each answer)."""
        if down < OUTAGE_NOTICE_AFTER_S:
            if down == 0 and settled and self._logged_at is not None:
                self._logged_at = None
                return Outage("back")
            return None
        left = self.timeout_s - down
        if left <= 0:
            return Outage("give_up", down, left)
        now = time.monotonic()
        if self._logged_at is None or now - self._logged_at >= OUTAGE_LOG_EVERY_S:
            self._logged_at = now
            return Outage("notice", down, left)
        return Outage("ongoing", down, left)
