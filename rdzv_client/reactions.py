"""How the agent answers what the server says: assignments, restarts,
evictions, the end of the job, errors. A mixin of :class:`~rdzv_client.agent.Agent`
(its state and its steps are the agent's, declared here for the type checker),
kept apart so the agent's loop reads in one screen. Also the agent's
:class:`Phase` and exit codes (see docs/design.md, "Exit codes of rdzv-agent").
"""

from __future__ import annotations

import enum
import logging
import signal
import sys
from typing import TYPE_CHECKING

from rdzv_common.errors import ErrorCode, RdzvError
from rdzv_common.wire import printable

from .quiet import Quiet
from .session import Heard, Meaning, classify
from .status import first_line

if TYPE_CHECKING:
    import asyncio

    from rdzv_common.protocol import Assignment, RestartMsg, ServerMessage, WaitingInfo

    from .client import AgentLink
    from .config import AgentConfig
    from .session import NodeSession
    from .status import StatusLine
    from .workers import WorkerGroup

log = logging.getLogger("rdzv_agent")

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_GAVE_UP = 3
# the job failed in a restart storm (no progress in N restarts): do not requeue
EXIT_NO_PROGRESS = 4
FATAL_CODES = {
    ErrorCode.SPEC_MISMATCH,
    ErrorCode.JOB_FINISHED,
    ErrorCode.VALIDATION_ERROR,
    ErrorCode.UNAUTHORIZED,
    ErrorCode.BAD_REQUEST,
    ErrorCode.JOB_SECRET_MISMATCH,
}


# ------------------------------------------------------------------ helpers


class Phase(enum.Enum):
    """Where the agent is; one value instead of interacting flags."""

    JOINING = "joining"  # a join is the link's intent: waiting for a round
    SPARE = "spare"  # the job is at max nodes: waiting to replace one
    RUNNING = "running"  # this round's workers are up
    STOPPING = "stopping"  # workers are being stopped (a restart, a signal, the end)
    REPORTED = "reported"  # workers failed and that is reported: waiting for the next round
    SUCCEEDED = "succeeded"  # workers all exited 0 and that is reported: waiting for the ack
    DONE = "done"  # the loop returns an exit status


class ServerReactions:
    """The agent's answers to server messages (mixed into Agent)."""

    cfg: AgentConfig
    session: NodeSession
    phase: Phase
    status: StatusLine
    group: WorkerGroup | None
    _held_for: str | None
    _quiet: Quiet  # what a server can make this agent repeat at each join, said at most every 30 s
    failure_summary: tuple[int, str] | None  # (round, torchrun's block) of this node's last failure
    signals: asyncio.Queue[int]  # signals the loop has yet to handle

    if TYPE_CHECKING:  # the agent's own, used here

        @property
        def link(self) -> AgentLink: ...

        @property
        def assignment(self) -> Assignment | None: ...

        def _say(self, text: str, *args: object) -> None: ...

        def _join(self) -> None: ...

        async def _join_when_healthy(self, rejoining: bool) -> bool: ...

        async def _start_workers(self, a: Assignment) -> None: ...

        def _keep_workers(self, new_round: int) -> bool: ...

        def _end_reform(self) -> None: ...

        async def _stop_workers(self, timeout: float | None = None, sig: int = signal.SIGTERM) -> None: ...

    async def _on_message(self, msg: ServerMessage | RdzvError) -> int | None:
        from rdzv_common.protocol import AckMsg, AssignedMsg, DoneMsg, JoinedMsg, RestartMsg, SpareMsg, StatusMsg

        heard = classify(msg)
        if heard.meaning is Meaning.NEW_NODE:
            return await self._on_new_node(heard)
        if heard.meaning is Meaning.REFUSED:
            return await self._on_error(heard)
        if heard.meaning is Meaning.LINK_ERROR:  # e.g. the token was refused
            print(f"[rdzv-agent] error: {printable(heard.reason)}", file=sys.stderr, flush=True)
            await self._stop_workers()
            return EXIT_USAGE
        cfg = self.cfg
        if isinstance(msg, JoinedMsg):
            if msg.waiting_for:
                self._show_waiting(msg.round, msg.waiting_for)
        elif isinstance(msg, StatusMsg):
            self._show_waiting(msg.round, msg.waiting_for)
        elif isinstance(msg, SpareMsg):
            if self.group is not None:
                # in-place mode kept them over the rejoin (drained, or replaced as a straggler):
                # a spare runs no workers
                self._say("made a spare: stopping the workers kept in place")
                self._end_reform()
                await self._stop_workers()
            if self.phase is Phase.JOINING:
                self.phase = Phase.SPARE
            if msg.reason is not None:  # this host may not be admitted now (cordoned, cooled down)
                if msg.reason != self._held_for:
                    self._say("waiting as a spare: %s", printable(msg.reason, limit=500))
                self._held_for = msg.reason
            else:
                if self._held_for is not None:
                    self._say("this host may be admitted again; waiting as a spare")
                self._held_for = None
                self.status.show(
                    f"[rdzv-agent] job {cfg.job_id}: spare (the job is at max {cfg.max_nodes} "
                    "nodes); waiting to replace a node"
                )
        elif isinstance(msg, AssignedMsg):
            a = msg.assignment
            problem = self.session.check_assignment(a)
            if problem is not None:
                self.link.protocol_error(f"round {a.round}: {problem}")
                return None
            if self.assignment is not None and self.assignment.round == a.round:
                # A reconnect re-sent this round's assignment: the workers run it, or
                # ran it and their outcome is reported (the report follows the resume).
                return None
            await self._start_workers(a)
        elif isinstance(msg, RestartMsg):
            await self._on_restart(msg)
        elif isinstance(msg, DoneMsg):
            self.link.clear_reports()
            await self._stop_workers()
            self.phase = Phase.DONE
            if msg.state == "succeeded":
                self._say("job succeeded")
                return 0
            self.status.done()
            if self.failure_summary and self.assignment and self.failure_summary[0] == self.assignment.round:
                print(self.failure_summary[1], file=sys.stderr, flush=True)  # torchrun's, for log scrapers
            text = f"[rdzv-agent] job {cfg.job_id} {msg.state}: {printable(msg.reason)}"
            if msg.root_cause and msg.root_cause not in msg.reason:
                text += f"\n[rdzv-agent] root cause: {printable(msg.root_cause)}"
            print(text, file=sys.stderr, flush=True)
            return EXIT_NO_PROGRESS if msg.stop == "no_progress" else EXIT_FAILED
        elif isinstance(msg, AckMsg):
            self.link.clear_reports()
            if msg.of == "succeeded":
                self.phase = Phase.DONE
                self._say("workers succeeded; done")
                return 0
        return None

    async def _on_restart(self, msg: RestartMsg) -> None:
        """A round change: stop the workers (in place: keep them), then join
        again; or, when the restart carries this node's place (the server
        formed the round itself, design.md "Direct re-formation"), start it."""
        self.link.clear_reports()
        if self.assignment is not None and msg.round <= self.assignment.round:
            return
        a = msg.assignment
        problem = self.session.check_assignment(a) if a is not None else None
        if a is not None and problem is None and a.round != msg.round:
            problem = f"the assignment of round {a.round} came with the restart of round {msg.round}"
        if problem is not None:
            self.link.protocol_error(f"round {msg.round}: {problem}")
            return
        why, then = printable(first_line(msg.reason)), "rejoining" if a is None else "taking its place"
        if self._keep_workers(msg.round):
            self._say("round %d: %s; workers stay in place; %s", msg.round, why, then)
        else:
            self._say("round %d: %s; stopping workers and %s", msg.round, why, then)
            await self._stop_workers()
        if a is None:
            await self._join_when_healthy(rejoining=True)  # after a signal: the loop handles it next
        elif not self.signals.empty():  # the loop handles it first (it leaves the round)
            return
        else:
            await self._start_workers(a)

    async def _on_new_node(self, heard: Heard) -> int | None:
        """The server has no node of ours under this id (evicted, or its node of
        this id is not ours: session.NEW_NODE_CODES). Fencing: workers die before
        anything else, then this is a new node."""
        self.link.clear_reports()
        if self.group is not None:
            self.group.kill_now()
            await self._stop_workers(timeout=1.0)
        if self._quiet_ok("evicted"):
            self._say("evicted (%s); rejoining as a new node", printable(heard.reason))
        self.phase = Phase.JOINING
        self.session.evicted()
        return None

    async def _on_error(self, heard: Heard) -> int | None:
        """A refusal with its code (not one that makes a new node)."""
        code, message = heard.code, heard.reason
        if code == ErrorCode.UNAVAILABLE:
            # the server cannot serve us now: the link backs off and joins again
            # (--server-timeout counts); said at most every 30 s
            self._warn("unavailable", "server unavailable: %s", printable(message))
            return None
        self.link.clear_reports()
        if code == ErrorCode.STALE_ROUND:
            if self.phase is Phase.SUCCEEDED:
                return 0  # our success was recorded before the connection dropped
            if self.group is not None and self.phase is Phase.RUNNING and not self.session.direct:
                # we resumed a round that is over: stop and join the next one (a server tells a
                # session that offers direct ports that with the next round's restart, so its
                # stale round is a report's, sent before that restart: harmless, below)
                self._say("%s; stopping workers and rejoining", printable(message))
                await self._stop_workers()
                self._join()
            else:  # harmless: a report (or resume) the server no longer needs, said as such
                log.info("the round changed before this node's report arrived; nothing to do, nothing charged")
                log.debug("server: %s", printable(message))
            return None
        if code in FATAL_CODES:
            print(
                f"[rdzv-agent] error: the server refused this node: {printable(message)}",
                file=sys.stderr,
                flush=True,
            )
            await self._stop_workers()
            return EXIT_USAGE
        assert code is not None  # a refusal has its code
        self._warn(code.value, "server error %s: %s", code.value, printable(message))
        return None

    def _quiet_ok(self, kind: str) -> bool:
        return self._quiet.allow(kind) is not None

    def _warn(self, kind: str, text: str, *args: object) -> None:
        """A warning a server can repeat at each join: said once, then at most every 30 s per kind."""
        suffix = self._quiet.allow(kind)
        if suffix is not None:
            log.warning(text + "%s", *args, suffix)

    def _show_waiting(self, round_no: int, info: WaitingInfo) -> None:
        self.status.show(
            f"[rdzv-agent] job {self.cfg.job_id} round {round_no}: {info.joined} joined "
            f"(min {info.min_nodes}, max {info.max_nodes}, spares {info.spares}); "
            f"{printable(info.text, limit=500)}"
        )
