"""torchrun's rendezvous handler for an rdzv server.

    torchrun --rdzv-backend=rdzv --rdzv-endpoint=HOST:PORT --rdzv-id=JOB --nnodes=2:3 ... train.py

torchrun finds this through the ``torchrun.handlers`` entry point; torch is not
patched. So does ``accelerate launch --rdzv_backend rdzv``, which runs torchrun
in its own process: ``--rdzv_conf job_id=NAME`` names the job there (accelerate
has no --rdzv_id), ``--rdzv_conf server=HOST:PORT`` names the server when it is
not at --main_process_ip:--main_process_port (or under --same_network),
``--rdzv_conf nnodes=MIN:MAX`` makes its one-number --num_machines a range, and
the number of local workers comes from torch's WorkerSpec, not the command line.
``--rdzv-endpoint=h1:29400,h2:29400`` names the replicas of an HA server
(torchrun passes it through as is; ``--rdzv-conf server=`` cannot, torchrun
splits it at commas): the link follows the leader among them.

The handler keeps one :class:`~rdzv_client.client.AgentLink` on a
background thread's event loop, so the server learns at once when this node
dies and pushes round changes, which :meth:`num_nodes_waiting` reports to
torchrun's monitor loop (it restarts the workers and calls
:meth:`next_rendezvous` again).

The node's side of the protocol (node id, joins, resume, eviction, reports,
assignment checks, the server-timeout bookkeeping) is the
:class:`~rdzv_client.session.NodeSession` rdzv-agent uses too.

Each round gets a fresh TCPStore hosted by that round's group rank 0 on the
port it reported, so losing any node, rank 0 included, only costs a round:
the survivors' next round has its own rank 0 and its own store.

A job that the server ends (``rdzv close``, a join timeout) stops torchrun:
:meth:`num_nodes_waiting` turns non-zero, torchrun stops its workers, and
:meth:`next_rendezvous` raises RendezvousClosedError with the server's reason.

An unreachable server is waited for ``--rdzv-conf server_timeout=S`` seconds
(default 300, as rdzv-agent's ``--server-timeout``), with a warning when the
outage starts and every 30 s; then the handler gives up: a rendezvous raises
RendezvousConnectionError, and running workers are stopped through
:meth:`num_nodes_waiting` as for a closed job. An endpoint never reached at all
(each connect refused) gives up after service.NEVER_REACHED_S instead.

torchrun keeps its own restart budget (``--max-restarts``) for this node's own
failures: a worker failure that follows a round change (a peer lost, or one
that failed first: its gloo error echoes theirs) is restarted as a membership
change and not charged (rdzv_client/torch_echo.py), so a node loss never ends
a job that keeps min_nodes, whatever --max-restarts. The server counts a
torchrun restart as a failure of the round, with a budget of its own that is
effectively unlimited unless ``--rdzv-conf max_restarts=K`` sets one. When
torchrun's budget is spent (its default is 0) it gives up: :meth:`shutdown`
sees torchrun's ChildFailedError and sends a give-up (a failure report with
``give_up``, the workers' exit records) instead of a leave; the server fails
the job and tells every node, so the other torchruns stop their workers and
exit 1 at once (RendezvousClosedError naming the failure), as under c10d,
instead of waiting the join timeout for a round that cannot form.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from datetime import timedelta
from typing import Any, TypeVar

# torch exports these without marking them as re-exported (no __all__ entry): mypy's strict mode says so
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
    rendezvous_handler_registry,
)

from rdzv_common.protocol import (
    AckMsg,
    AssignedMsg,
    Assignment,
    DoneMsg,
    ErrorCode,
    ErrorMsg,
    ExitRecord,
    JobSpec,
    JoinedMsg,
    RdzvError,
    RestartMsg,
    SpareMsg,
    StatusMsg,
    heartbeat_interval,
    job_secret_problem,
    printable,
)
from rdzv_common.tasks import cancel_and_wait

from . import peer_probe, secret_source
from .client import AgentLink
from .endpoints import Endpoints, parse_endpoint
from .launch import WITHHELD_FROM_WORKERS
from .rest import RestClient
from .service import DEFAULT_SERVER_TIMEOUT_S, RETRY_LATER_CODES, never_reached_s, never_reached_text, outage_word
from .session import Heard, Meaning, NodeSession, OutageWatch, classify, new_run_default, route_addr
from .spec_flags import conf_spec
from .torch_echo import hook_agent
from .torch_params import exit_records, node_range, server_and_job, spec_nproc, torchrun_nproc

_T = TypeVar("_T")

log = logging.getLogger(__name__)

STORE_TIMEOUT_S = 300.0
# How long a node whose local worker failed waits for the server to open a new
# round for another reason before it reports the failure (see _next_round).
# Longer than the server's default disconnect grace (store.DEFAULT_DISCONNECT_GRACE_S, 0.5 s).
FAILURE_REPORT_DELAY_S = 1.0
# while a round forms, say what it waits for this often
PROGRESS_EVERY_S = 10.0


class RdzvRendezvousHandler(RendezvousHandler):
    """torch's RendezvousHandler over the rdzv server's agent channel."""

    def __init__(self, params: RendezvousParameters) -> None:
        self.params = params
        self.endpoint, self.run_id = server_and_job(params)
        self.endpoints = Endpoints(self.endpoint)  # HOST:PORT, or a list of them (HA replicas); a bad one: ValueError
        _, host, port = parse_endpoint(self.endpoints.urls[0])
        self.token = params.get("token") or os.environ.get("RDZV_TOKEN") or None
        # the file form, RDZV_JOB_SECRET(_FILE) from the environment; job_secret= on torchrun's
        # command line works but is seen in ps (a warning says so once)
        self.job_secret = secret_source.job_secret(
            params.get("job_secret") or None,
            params.get("job_secret_file") or None,
            "--rdzv-conf job_secret=...",
            "--rdzv-conf job_secret_file=PATH",
        )
        if self.job_secret is not None and (why := job_secret_problem(self.job_secret)):
            raise ValueError(
                f"rdzv: the job secret (--rdzv-conf job_secret=... or job_secret_file=..., or RDZV_JOB_SECRET) {why}"
            )
        # torchrun's workers inherit this process's environment: the credentials stay with us
        for name in WITHHELD_FROM_WORKERS:
            os.environ.pop(name, None)
        addr = params.local_addr or route_addr(host, port)
        self.server_timeout_s = float(params.get("server_timeout", DEFAULT_SERVER_TIMEOUT_S))
        if not 0 < self.server_timeout_s < float("inf"):
            raise ValueError(f"rdzv-conf server_timeout={self.server_timeout_s}: must be a positive number of seconds")
        never_reached_s()  # $RDZV_NEVER_REACHED_TIMEOUT: a bad one is a ValueError here, not in the link's thread
        self._gave_up: str | None = None  # why, once the server was unreachable for server_timeout_s
        self._waiting_text = ""  # what the forming round waits for, as the server last said
        # the spec's --rdzv-conf keys (the table's), at the plugin's defaults where the table gives one
        # (torchrun keeps its own restart budget: the server's is unlimited and restart storms are off)
        min_nodes, max_nodes = node_range(params)  # --nnodes, or --rdzv-conf nnodes= (accelerate)
        self.spec = JobSpec(min_nodes=min_nodes, max_nodes=max_nodes, **conf_spec(params.get, plugin=True))
        self.join_timeout_s = self.spec.join_timeout_s
        self.nproc = torchrun_nproc()  # until next_rendezvous finds torch's WorkerSpec (spec_nproc)
        self._nproc_known = False
        self.session = NodeSession(
            job_id=self.run_id,
            host=socket.gethostname(),
            nproc=self.nproc,
            spec=self.spec,
            addr=addr,
            job_secret=self.job_secret,
            # --rdzv-conf new_run=0|1, else as rdzv-agent (RDZV_NO_NEW_RUN, off under Kubernetes): a finished
            # job id refuses this node instead of starting its next run
            new_run=str(params.get("new_run", "1" if new_run_default() else "0")).lower() not in ("0", "false", "no"),
        )
        self.failure_report_delay_s = float(params.get("failure_report_delay", FAILURE_REPORT_DELAY_S))
        self._assignment: Assignment | None = None
        self._restart_round = -1  # the newest round the server said is forming
        self._restart_reason = ""  # why, as the server said
        self._echo_checked = -1  # the round whose worker failure round_changed() already held (torch_echo)
        self._closed = False
        self._closed_why = "closed"  # "closed: closed by request", "failed: ..." once the server said so
        self._store: TCPStore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._link: AgentLink | None = None
        self._peers: peer_probe.PeerProbe | None = None  # probes of its peers, as rdzv-agent's (issue 23)
        self._inbox: asyncio.Queue[Heard] | None = None  # what the link hands over, classified once

    @property
    def node_id(self) -> str:
        return self.session.node_id

    @property
    def addr(self) -> str | None:
        return self.session.addr

    # ---------------------------------------------------------------- thread

    def _ensure_started(self) -> None:
        if self._loop is not None:
            return
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._start_link())
                ready.set()
                loop.run_forever()
            finally:
                ready.set()
                loop.close()  # its selector and self-pipe sockets: no ResourceWarning at exit

        self._thread = threading.Thread(target=run, name="rdzv-handler", daemon=True)
        self._thread.start()
        ready.wait()

    async def _start_link(self) -> None:
        self._link = AgentLink(self.endpoint, self.token, heartbeat_s=heartbeat_interval(self.spec))
        self.session.link = self._link
        self._peers = peer_probe.attach(self.session, self._link)
        self._inbox = asyncio.Queue()
        self._news = asyncio.Event()
        await self._link.start()
        self._dispatcher = asyncio.ensure_future(self._dispatch())
        self._watchdog = asyncio.ensure_future(self._watch_server())

    async def _watch_server(self) -> None:
        """Say that the server is unreachable (when it starts, every 30 s and
        when it ends), and give up after server_timeout_s: the job is then
        closed for this node, so torchrun stops its workers and exits."""
        watch = OutageWatch(self.server_timeout_s)
        while True:
            await asyncio.sleep(0.5)
            tried = self.session.link.first_contact.never_reached()
            out = watch.check(self.session.link.unserved_for(), self.session.link.service.stable(), tried is not None)
            if out is None or out.kind == "ongoing":
                continue
            if out.kind == "back":
                log.warning("rdzv server %s reachable again", self.endpoint)
                continue
            why = printable(self.session.link.last_error or "no answer", limit=300)
            word = outage_word(self.session.link.last_error)  # unreachable, or not serving this node
            if out.kind in ("give_up", "never_reached"):
                self._gave_up = (
                    f"gave up: {never_reached_text(out.down, tried, plugin=True)}"
                    if tried is not None and out.kind == "never_reached"
                    else f"gave up: rdzv server {self.endpoint} {word} for {self.server_timeout_s:g}s "
                    f"(rdzv-conf server_timeout; {why})"
                )
                log.error("job %s: %s", self.run_id, self._gave_up)
                self._closed_why = self._gave_up
                self._closed = True
                self._news.set()
                return
            log.warning(
                "rdzv server %s %s for %.0fs (%s); giving up in %.0fs", self.endpoint, word, out.down, why, out.left
            )

    async def _dispatch(self) -> None:
        """Keep the handler's view current while torchrun's workers run."""
        link, inbox = self.session.link, self._inbox
        assert inbox is not None  # made with the link
        while True:
            msg = await link.recv()
            heard = classify(msg)
            if isinstance(msg, RestartMsg):
                self._restart_round = max(self._restart_round, msg.round)
                self._restart_reason = printable(msg.reason, limit=200)
            elif heard.meaning is Meaning.NEW_NODE:
                self._restart_round = max(self._restart_round, (self._assignment.round + 1) if self._assignment else 0)
            elif isinstance(msg, DoneMsg) and msg.state != "succeeded":
                self._closed_why = f"{msg.state}: {printable(msg.reason)}"
                self._closed = True
            elif isinstance(msg, JoinedMsg) and msg.waiting_for is not None:  # noqa: SIM114 - keeps the narrowing
                self._waiting_text = printable(msg.waiting_for.text, limit=300)
            elif isinstance(msg, StatusMsg):
                self._waiting_text = printable(msg.waiting_for.text, limit=300)
            elif isinstance(msg, SpareMsg) and msg.reason is not None:  # this host is cordoned or cooled down
                text = printable(msg.reason, limit=300)
                if text != self._waiting_text:
                    log.warning("job %s: waiting as a spare: %s", self.run_id, text)
                self._waiting_text = text
            inbox.put_nowait(heard)
            self._news.set()

    async def _answered(self, timeout: float) -> None:
        """Wait until the server answered a report: its ack, the job's end, or a refusal."""
        inbox = self._inbox
        assert inbox is not None  # made with the link
        deadline = time.monotonic() + timeout
        while not self._closed and (left := deadline - time.monotonic()) > 0:
            heard = await asyncio.wait_for(inbox.get(), left)
            if isinstance(heard.msg, (AckMsg, DoneMsg, ErrorMsg)):
                return

    def _call(self, coro: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
        loop = self._loop
        assert loop is not None  # _ensure_started() ran
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    # ------------------------------------------------------------ rendezvous

    def get_backend(self) -> str:
        return "rdzv"

    @property
    def use_agent_store(self) -> bool:
        return False

    def get_run_id(self) -> str:
        return self.run_id

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True
        try:
            asyncio.run(RestClient(self.endpoint, self.token).close_job(self.run_id))
        except RdzvError as e:
            log.warning("could not close job %s on %s: %s", self.run_id, self.endpoint, e)

    def num_nodes_waiting(self) -> int:
        """Non-zero once the server opened a round after ours, or ended the job
        (closed, failed): torchrun then stops its workers and calls
        next_rendezvous, which starts the next round or raises
        RendezvousClosedError, and torchrun exits."""
        a = self._assignment
        return 1 if a is not None and (self._restart_round > a.round or self._closed) else 0

    def round_changed(self) -> str | None:
        """torch's monitor saw this node's workers fail (torch_echo): wait up to
        failure_report_delay for the server to open a later round (a peer lost,
        or failed first); its reason, or None: the failure is this node's."""
        a = self._assignment
        if a is None or a.group_world_size <= 1:
            return None
        self._echo_checked = a.round
        deadline = time.monotonic() + self.failure_report_delay_s
        while not self._closed:
            if self._restart_round > a.round:
                return self._restart_reason or f"round {self._restart_round}"
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        return None

    def next_rendezvous(self) -> RendezvousInfo:
        if self._gave_up:
            raise RendezvousConnectionError(f"job {self.run_id}: {self._gave_up}")
        if self._closed:
            raise RendezvousClosedError(f"job {self.run_id} {self._closed_why}")
        if not self._nproc_known:
            self._nproc_known = True
            nproc = spec_nproc(self)
            hook_agent(self, self.round_changed)  # a peer's echo is a membership change (torch_echo)
            if nproc is None:
                log.warning(
                    "rdzv: no torch WorkerSpec calls this handler; %d local worker(s), from the command line",
                    self.nproc,
                )
            else:
                self.nproc = self.session.nproc = nproc
        self._ensure_started()
        a = self._call(self._next_round(), timeout=self.join_timeout_s + 30)
        self._assignment = a
        self._store = None  # the previous round's store goes away with its round
        timeout = timedelta(seconds=STORE_TIMEOUT_S)
        if a.group_rank == 0:
            store = TCPStore(a.master_addr, a.master_port, is_master=True, wait_for_workers=False, timeout=timeout)
        else:
            store = TCPStore(a.master_addr, a.master_port, is_master=False, timeout=timeout)
        self._store = store
        prefixed = PrefixStore(f"rdzv/{self.run_id}/{a.round}", store)
        bootstrap = RendezvousStoreInfo.build(a.group_rank, prefixed, local_addr=self.addr)
        log.info(
            "job %s round %d: group rank %d of %d, store %s:%d",
            self.run_id,
            a.round,
            a.group_rank,
            a.group_world_size,
            a.master_addr,
            a.master_port,
        )
        return RendezvousInfo(prefixed, a.group_rank, a.group_world_size, bootstrap)

    async def _next_round(self) -> Assignment:
        link, inbox = self.session.link, self._inbox
        assert inbox is not None  # made with the link
        prev = self._assignment
        held = prev is not None and self._echo_checked == prev.round  # round_changed() waited already
        if prev is not None and self._restart_round <= prev.round and prev.group_world_size > 1 and not held:
            # A local worker failed. When a peer node died, our workers' collectives
            # fail within milliseconds, before the server has lost that node (its
            # disconnect grace). Give the server that long to open the next round
            # itself: then the round names the lost node as its cause, and this
            # consequential failure costs no restart.
            deadline = time.monotonic() + self.failure_report_delay_s
            while self._restart_round <= prev.round and not self._closed and (left := deadline - time.monotonic()) > 0:
                self._news.clear()
                try:
                    await asyncio.wait_for(self._news.wait(), left)
                except asyncio.TimeoutError:
                    break
        if prev is not None and self._restart_round <= prev.round:
            # torchrun restarts because a local worker failed: the others must restart too
            self.session.report_failed(
                prev.round,
                [
                    ExitRecord(
                        local_rank=0,
                        rank=prev.rank_offset,
                        pid=os.getpid(),
                        exit_code=1,
                        timestamp=time.time(),
                        message="torchrun restarted its worker group on this node (see its log for the worker error)",
                    )
                ],
            )
        self._assignment = None
        self.session.join()
        started = time.monotonic()
        deadline = started + self.join_timeout_s
        said = started
        while True:
            if self._gave_up:
                raise RendezvousConnectionError(f"job {self.run_id}: {self._gave_up}")
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                raise RendezvousTimeoutError(f"no round of job {self.run_id} formed within {self.join_timeout_s:g}s")
            if now - said >= PROGRESS_EVERY_S and link.connected.is_set():
                said = now
                log.warning(
                    "job %s: waiting %.0fs for a round (join_timeout in %.0fs)%s",
                    self.run_id,
                    now - started,
                    left,
                    f": {self._waiting_text}" if self._waiting_text else "",
                )
            try:
                heard = await asyncio.wait_for(inbox.get(), min(left, 0.5))
            except asyncio.TimeoutError:
                continue
            msg = heard.msg
            if isinstance(msg, AssignedMsg):
                a = msg.assignment
                if prev is not None and a.round <= prev.round:
                    continue  # the answer to a resume sent before this restart: a round that is over
                problem = self.session.check_assignment(a)
                if problem is not None:
                    link.protocol_error(f"round {a.round}: {problem}")
                    continue
                link.clear_reports()
                self.session.resume(a)
                return a
            if isinstance(msg, DoneMsg):
                self._closed = msg.state != "succeeded"
                raise RendezvousClosedError(f"job {self.run_id} {msg.state}: {printable(msg.reason)}")
            if heard.meaning is Meaning.NEW_NODE:
                self.session.evicted()
            elif heard.meaning is Meaning.REFUSED and heard.code not in (ErrorCode.STALE_ROUND, *RETRY_LATER_CODES):
                raise RendezvousError(f"rdzv server refused this node: {printable(heard.reason)}")
            elif heard.meaning is Meaning.LINK_ERROR:
                raise RendezvousError(printable(heard.reason))

    def shutdown(self) -> bool:
        """torchrun calls this from a ``finally``. No exception in flight: its
        workers succeeded. torchrun's ChildFailedError: its workers failed and
        its own restart budget is spent, so this node gives up: the server fails
        the job for every node (their next rendezvous raises
        RendezvousClosedError). Any other exception: this node leaves."""
        if self._loop is None:
            return True
        exc = sys.exc_info()[1]
        failed = exc is not None
        a = self._assignment
        gives_up = a is not None and isinstance(exc, ChildFailedError) and not self._closed
        records = exit_records(exc, a) if gives_up and a is not None and isinstance(exc, ChildFailedError) else []

        async def finish() -> None:
            if a is not None and not failed:
                self.session.report_succeeded(a.round)
            elif a is not None and gives_up:
                log.warning("job %s: torchrun gave up after a worker failure; the job ends on every node", self.run_id)
                assert self._inbox is not None  # made with the link
                while not self._inbox.empty():  # what came before is not the answer to this report
                    self._inbox.get_nowait()
                self.session.report_failed(a.round, records, give_up=True)
            else:
                self.session.leave("torchrun agent stopped" + (" after a failure" if failed else ""))
            try:
                await asyncio.wait_for(self.session.link.connected.wait(), 5.0)
                if gives_up:
                    await self._answered(5.0)  # the job must end for the others: wait for the server to say so
                else:
                    await asyncio.sleep(0.1)  # let the frame go out
            except asyncio.TimeoutError:
                pass
            await cancel_and_wait(self._dispatcher, self._watchdog)
            await self.session.link.close()

        try:
            self._call(finish(), timeout=10)
        except Exception as e:  # shutdown must not mask torchrun's own outcome
            log.warning("rdzv handler shutdown: %s", e)
        if self._peers is not None:
            self._peers.close()  # its thread (the link is closed: nothing more to report)
            self._peers = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._loop = None
        return True


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    return RdzvRendezvousHandler(params)


def handler_creator() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point: torch calls it with no arguments
    and registers what it returns as the creator of handlers."""
    return create_handler


# torch registers this backend from the entry point above when its rendezvous
# registry is first imported. When that first import comes from this module's
# own imports (``import rdzv_client.torch_plugin`` before anything imported
# torch's registry), the entry point finds this module half-initialized and
# torch skips it with a warning; register here as well (same creator: torch
# accepts registering it twice).
rendezvous_handler_registry.register("rdzv", create_handler)
