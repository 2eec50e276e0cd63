"""One node's session with the server: the rules both rdzv-agent and the
torchrun plugin follow, in one place.

A :class:`NodeSession` is this node's identity: the node id, the node secret
the server issued for it (held in memory only), the job's run the first
``joined`` named, and the round this node runs. The
:class:`~rdzv_client.client.AgentLink` is only its transport: the session
sets the intent the link re-sends after a reconnect, and hears every server
message before the link queues it (:meth:`NodeSession.heard`), so a
reconnect right after ``joined`` already carries the secret. It builds every
join:

* :meth:`NodeSession.join` - a fresh join; the round this node ran is over.
* :meth:`NodeSession.resume` - the intent while workers run a round: after a
  reconnect the link re-sends a join with ``resume_round`` and the round's
  master port, so the server keeps this node in its round.
* :meth:`NodeSession.evicted` - the server forgot this node (eviction, or a node
  secret that is not ours): drop the reports that name the old node and join
  under a new node id, which carries no secret until the server issues one.
  Every join carries the run, whatever its node id (a late agent of a finished
  run is then told so, never starting the next).
* :meth:`NodeSession.check_assignment` - what the protocol model cannot check:
  the job id and this node's worker count.
* :meth:`NodeSession.report_failed` (also a give-up), :meth:`report_succeeded`, :meth:`leave`.

:func:`classify` says what a server message or a link error means for this
node, once for the agent, the plugin and the link: news to act on, a new node
needed (:data:`NEW_NODE_CODES`), a refusal with its code, or a link error.

:class:`OutageWatch` is the server-timeout bookkeeping: when an outage is news,
when to say it again, when to give up.
"""

from __future__ import annotations

import enum
import os
import secrets
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rdzv_common.errors import ErrorCode, RdzvError
from rdzv_common.wire import join_fields, printable

from .ports import PortHold

if TYPE_CHECKING:
    from rdzv_common.protocol import Assignment, ExitRecord, JobSpec

    from .client import AgentLink

# An outage shorter than this is a reconnect, not news; a longer one is logged
# when it starts, every OUTAGE_LOG_EVERY_S while it lasts, and when it ends.
OUTAGE_NOTICE_AFTER_S = 2.0
OUTAGE_LOG_EVERY_S = 30.0


# Error codes that mean "the server has no node of ours under this id": it
# forgot this node (evicted), or its node of this id is not ours (we never got
# its secret, or it was lost and re-created). Fence, then join as a new node.
NEW_NODE_CODES = frozenset({ErrorCode.EVICTED, ErrorCode.NODE_SECRET_MISMATCH})


class Meaning(enum.Enum):
    """What one thing the link hands over means for this node."""

    NEWS = "news"  # a server message to act on (joined, assigned, restart, done, ...)
    NEW_NODE = "new_node"  # an eviction, or an error of NEW_NODE_CODES: fence, join as a new node
    REFUSED = "refused"  # any other error: ``code`` says which
    LINK_ERROR = "link_error"  # the link's own RdzvError (the token refused at the handshake)


@dataclass(frozen=True)
class Heard:
    """A server message or link error, classified (:func:`classify`).
    ``reason``: the eviction's reason or the error's message, as sent."""

    meaning: Meaning
    msg: Any
    code: ErrorCode | None = None
    reason: str = ""

    def refusal(self) -> str:
        """How the link names it as a refusal of our join."""
        return f"join refused: {self.code.value if self.code else 'evicted'}: {printable(self.reason, 200)}"


def classify(msg: Any) -> Heard:
    """What ``msg`` (a protocol model from the link, or its RdzvError) means:
    the one place that says which codes make a new node."""
    from rdzv_common.protocol import ErrorMsg, EvictedMsg

    if isinstance(msg, EvictedMsg):
        return Heard(Meaning.NEW_NODE, msg, None, msg.reason)
    if isinstance(msg, ErrorMsg):
        meaning = Meaning.NEW_NODE if msg.code in NEW_NODE_CODES else Meaning.REFUSED
        return Heard(meaning, msg, msg.code, msg.message)
    if isinstance(msg, RdzvError):
        return Heard(Meaning.LINK_ERROR, msg, msg.code, msg.message)
    return Heard(Meaning.NEWS, msg)


NO_NEW_RUN_ENV = "RDZV_NO_NEW_RUN"
# set in every Kubernetes pod: a scheduler that restarts pods (a lost pod comes back)
KUBERNETES_ENV = "KUBERNETES_SERVICE_HOST"


def new_run_default(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a fresh agent (or torchrun plugin) may start the next run of a
    finished job id when no flag says (``--no-new-run`` / ``--new-run``,
    ``--rdzv-conf new_run=``): ``$RDZV_NO_NEW_RUN`` when set (``0``: may);
    else not under Kubernetes, where a node that starts after its job ended is
    most likely a lost pod the scheduler restarted, which must not start a lone
    new run of a job that failed moments ago; elsewhere (a person, a new SLURM
    allocation) it may."""
    env = os.environ if environ is None else environ
    value = env.get(NO_NEW_RUN_ENV, "")
    if value:
        return value == "0"
    return not env.get(KUBERNETES_ENV)


def _ascii_label(host: str) -> str:
    """``host`` with every character but ASCII letters, digits and ``._-``
    replaced by ``-`` (the server's id and host patterns are ASCII: ``é`` is
    alphanumeric to ``str.isalnum`` but would make a join it refuses)."""
    return "".join(c if (c.isascii() and c.isalnum()) or c in "._-" else "-" for c in host)


# ports each join offers for the rounds this node holds rank 0 in without a join again
# (JoinMsg.direct_ports; at most wire.MAX_DIRECT_PORTS): the next join brings fresh ones
DIRECT_PORTS = 4


def new_node_id(host: str) -> str:
    """host, pid and a random suffix: IP addresses make poor ids (reused)."""
    clean = _ascii_label(host)[:80].lstrip("-._") or "node"
    return f"{clean}-{os.getpid()}-{secrets.token_hex(3)}"


def host_label(host: str) -> str:
    return _ascii_label(host)[:255] or "node"


def port_taken(port: int) -> bool:
    """Whether a store could not listen on ``port`` now (bound as torch's
    TCPStore binds: every address, SO_REUSEADDR): another process took it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return True
    return False


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
    """This node, as the server knows it. ``link`` is set once it exists (the
    session then hears every server message first: :meth:`heard`).

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
        direct: bool = False,
    ) -> None:
        self.job_id = job_id
        # its joins offer DIRECT_PORTS: a round change's restart may carry its place (no join again)
        self.direct = direct
        self.host = host
        self.nproc = nproc
        self.spec: dict[str, Any] = spec if isinstance(spec, dict) else spec.model_dump()
        self.addr = addr
        self.job_secret = job_secret
        self.requested_rank = requested_rank
        self.new_run = new_run  # False: a finished job id refuses this node instead of starting its next run
        self.node_id = new_node_id(host)
        self._secret: tuple[str, str] | None = None  # (node id, the node secret the server issued it)
        self.run: int | None = None  # the job's run the first ``joined`` named: on every later join
        self.assignment: Assignment | None = None  # the round this node runs (or ran and reported)
        self.probe_port: int | None = None  # where its agent answers peers' probes (rdzv_client.peer_probe)
        self._link: AgentLink | None = None
        self.ports = PortHold()  # what its latest join offered, held (rdzv_client.ports)

    @property
    def node_secret(self) -> str | None:
        """The secret the server issued this node id, if it did: on its every later join."""
        secret = self._secret
        return secret[1] if secret is not None and secret[0] == self.node_id else None

    @property
    def link(self) -> AgentLink:
        if self._link is None:
            raise RuntimeError("NodeSession.link is used before it is set")
        return self._link

    @link.setter
    def link(self, link: AgentLink) -> None:
        self._link = link
        link.observer = self.heard

    def heard(self, msg: Any) -> None:
        """A server message, as the link received it (before the agent or the
        plugin sees it): a ``joined`` names the run and issues this node's secret,
        and the intent the link re-sends after a reconnect carries them from now on."""
        from rdzv_common.protocol import JoinedMsg

        if not isinstance(msg, JoinedMsg):
            return
        if self.run is None:
            self.run = msg.run
        if msg.node_secret is not None:
            self._secret = (msg.node_id, msg.node_secret)
        intent = self.link.intent
        if intent is not None and intent.get("op") == "join":
            self.link.set_intent(self._identify(intent), send=False)

    def _identify(self, msg: dict[str, Any]) -> dict[str, Any]:
        """A join of this node as it must go: with the run once known, and the
        node secret when it is this node id's."""
        if msg.get("run") is None and self.run is not None:
            msg = {**msg, "run": self.run}  # this agent's run, for every node id it joins as
        secret = self._secret
        if msg.get("node_secret") is None and secret is not None and msg.get("node_id") == secret[0]:
            msg = {**msg, "node_secret": secret[1]}
        return msg

    def join_msg(self, resume: Assignment | None = None) -> dict[str, Any]:
        """The join (or resume) as its plain JSON object."""
        addr = self.addr
        if addr is None:
            raise RuntimeError("NodeSession.addr is set before the node joins")
        # the ports this join offers (its store's, the direct rounds'), held until the next offer
        # (rdzv_client.ports); a resume keeps its master_port, where its store may run
        keep = resume.master_port if resume is not None else None
        fresh = self.ports.offer(addr, (0 if keep is not None else 1) + (DIRECT_PORTS if self.direct else 0), keep)
        master_port = keep if keep is not None else fresh.pop(0)
        return join_fields(
            job_id=self.job_id,
            node_id=self.node_id,
            host=host_label(self.host),
            addr=addr,
            local_world_size=self.nproc,
            master_port=master_port,
            spec=self.spec,
            requested_rank=self.requested_rank,
            resume_round=resume.round if resume is not None else None,
            node_secret=self.node_secret,
            job_secret=self.job_secret,
            run=self.run,
            new_run=self.new_run,
            probe_port=self.probe_port,
            direct_ports=fresh if self.direct else None,
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
        self.node_id = new_node_id(self.host)  # the old id's secret goes on none of its joins
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
        from rdzv_common.protocol import FailedMsg

        self.link.report(FailedMsg(round=round_no, failures=failures, give_up=give_up))

    def report_succeeded(self, round_no: int) -> None:
        from rdzv_common.protocol import SucceededMsg

        self.link.report(SucceededMsg(round=round_no))

    def leave(self, reason: str) -> None:
        """Leave the job for good: no join after a reconnect."""
        from rdzv_common.protocol import LeaveMsg

        self.link.set_intent(None, send=False)
        self.link.report(LeaveMsg(reason=reason))


@dataclass
class Outage:
    """What :meth:`OutageWatch.check` found: ``kind`` is ``"back"`` (an outage
    that was logged ended), ``"notice"`` (say it now), ``"ongoing"`` (say it on a
    status line at most), ``"give_up"`` or ``"never_reached"`` (give up: no
    endpoint was ever reached, see service.NEVER_REACHED_S)."""

    kind: str
    down: float = 0.0
    left: float = 0.0


class OutageWatch:
    """The --server-timeout bookkeeping shared by the agent and the plugin."""

    def __init__(self, timeout_s: float) -> None:
        from .service import never_reached_s

        self.timeout_s = timeout_s
        self.never_reached_s = never_reached_s()
        self._logged_at: float | None = None  # when the outage notice was last logged

    def check(self, down: float, settled: bool = True, never_reached: bool = False) -> Outage | None:
        """``down``: seconds without a served join (0 while served); ``settled``:
        the service has held (a server that answers, then drops us at each join,
        is not "back" at each answer); ``never_reached``: no endpoint was ever
        reached, every try refused or naming an unknown host."""
        if down < OUTAGE_NOTICE_AFTER_S:
            if down == 0 and settled and self._logged_at is not None:
                self._logged_at = None
                return Outage("back")
            return None
        left = self.timeout_s - down
        if left <= 0:
            return Outage("give_up", down, left)
        if never_reached:  # (the countdown is to this deadline while nothing was ever reached)
            if down >= self.never_reached_s:
                return Outage("never_reached", down, left)
            left = min(left, self.never_reached_s - down)
        now = time.monotonic()
        if self._logged_at is None or now - self._logged_at >= OUTAGE_LOG_EVERY_S:
            self._logged_at = now
            return Outage("notice", down, left)
        return Outage("ongoing", down, left)
