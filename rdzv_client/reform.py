"""In-place re-formation, the agent's side (design.md "In-place re-formation"):
on a round change the agent keeps its workers, tells each to leave its step
(``stop``), hands them the next round (``assign``) and waits for every one to
reach its safe point (``parked``); one that does not within --in-place-timeout,
or that is gone, is restarted the process way. A worker that parks unasked saw
a collective fail: reported at once as an echo, later as a plain failure.

:class:`InPlace` is the agent's collaborator for this: it holds the
re-formation under way and talks to the workers over the worker channel; the
agent keeps its phase, its session and its worker group, and acts on what
these steps return.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import channel_grammar as grammar
from .launch import WORKER_EXIT_RESTART
from .workers import worker_env

if TYPE_CHECKING:
    from rdzv_common.protocol import Assignment, ExitRecord

    from .config import AgentConfig
    from .watch import WorkerWatch
    from .workers import WorkerGroup

log = logging.getLogger("rdzv_agent")

# What an in-place assignment sets in a kept worker's environment: the worker channel's grammar says.
IN_PLACE_VARS = grammar.ASSIGNED_VARS


def in_place_assignment(a: Assignment, local_rank: int, job_id: str, virtual_local_rank: bool) -> str:
    """The ``assign`` datagram for a kept worker of ``local_rank`` in round
    ``a``: the variables it takes, as worker_env gives a started one."""
    env = worker_env({}, a, local_rank, job_id, "", virtual_local_rank=virtual_local_rank)
    return grammar.assign(a.round, {k: env[k] for k in IN_PLACE_VARS})


# A worker that parks unasked saw a collective fail. Its agent says so at once
# (reason "collective": the server only loses a member whose connection already
# dropped, the usual cause, and otherwise waits for the cause's own report); if
# the round has not changed this much later, it reports a plain (charged) failure.
PLAIN_REPORT_AFTER_S = 1.0
# A kept worker that no longer takes its round may be exiting (exit 75: NCCL or its
# GPU did not recover) with its exit not yet reaped: this long to learn its status.
REAP_WAIT_S = 0.5


@dataclass
class Reform:
    """An in-place re-formation under way: the kept workers left ``old_round``
    and must all reach their safe point (``parked``) by ``deadline``."""

    old_round: int
    new_round: int
    started: float
    deadline: float


class InPlace:
    """The re-formation under way (``reform``) and the steps that move kept
    workers through it. ``say`` is the agent's log line."""

    def __init__(self, cfg: AgentConfig, watch: WorkerWatch, say: Callable[..., None]) -> None:
        self.cfg = cfg
        self.watch = watch
        self._say = say
        self.reform: Reform | None = None  # kept workers moving to the next round
        # the round a parked worker's failure was reported for, and whether as an echo
        self._broken_reported: tuple[int, bool] | None = None

    def keep(self, old_round: int, new_round: int, group: WorkerGroup) -> bool:
        """On a round change: tell every worker of ``group`` (running
        ``old_round``) to leave its step and keep them. False (stop them the
        process way) when a worker is gone or does not listen (it does not use
        rdzv_client.worker.rounds())."""
        cfg, channel = self.cfg, self.watch.channel
        if not all(group.running(lr) for lr in range(cfg.nproc)):
            return False
        if not all(channel.tell(lr, grammar.stop(new_round)) for lr in range(cfg.nproc)):
            self._say("a worker does not take rounds in place (rdzv_client.worker.rounds()): restarting them")
            return False
        now = time.monotonic()
        self.reform = Reform(old_round, new_round, now, now + cfg.in_place_timeout_s)
        return True

    def end(self) -> None:
        """Kept workers are not moving to a next round any more (they are stopped)."""
        self.reform = None

    async def assign(self, a: Assignment, group: WorkerGroup | None) -> bool:
        """Hand kept workers round ``a`` (the agent then runs it); False: they
        must be restarted."""
        cfg, channel = self.cfg, self.watch.channel
        if self.reform is None or group is None:
            return False
        gone = [lr for lr in range(cfg.nproc) if not group.running(lr)]
        if gone:
            return self._exited(a, gone[0], group.returncode(gone[0]))
        for lr in range(cfg.nproc):
            if not channel.tell(lr, in_place_assignment(a, lr, cfg.job_id, cfg.virtual_local_rank)):
                code = await group.reaped(lr, REAP_WAIT_S)  # it may have closed its channel as it exited
                if code is not None:
                    return self._exited(a, lr, code)
                self._say("round %d: local rank %d no longer listens; restarting this node's workers", a.round, lr)
                return False
        return True

    def _exited(self, a: Assignment, local_rank: int, code: int | None) -> bool:
        asked = code == WORKER_EXIT_RESTART
        why = " (it asked for a process restart: NCCL or its GPU did not recover)" if asked else ""
        say = "round %d: kept local rank %d exited %s%s; restarting this node's workers"
        self._say(say, a.round, local_rank, code, why)
        return False

    async def check(self, group: WorkerGroup | None, assigned: bool) -> bool:
        """Every kept worker parked (and, ``assigned``, handed the new round):
        done. True: past --in-place-timeout, the workers must be restarted."""
        r = self.reform
        if r is None:
            return False
        if group is None:
            self.reform = None
            return False
        late = [lr for lr in range(self.cfg.nproc) if self.watch.channel.parked.get(lr) != r.old_round]
        if not late:
            if assigned:  # assigned in place too: done
                self.reform = None
                log.debug("round %d: in place %.3fs after the round change", r.new_round, time.monotonic() - r.started)
            return False
        if time.monotonic() < r.deadline:
            return False
        self.reform = None
        blocked = await self.watch.where(group, r.new_round, late)
        self._say(
            "local rank(s) %s did not reach a safe point within %gs (--in-place-timeout): %s; restarting this "
            "node's workers",
            ",".join(map(str, late)),
            self.cfg.in_place_timeout_s,
            blocked,
        )
        return True

    def parked_failure(
        self, a: Assignment, group: WorkerGroup, local_rank: int, round_no: int, echo: bool
    ) -> ExitRecord | None:
        """A worker of round ``a`` parked unasked (a collective failed): the
        failure to report (``echo``: at once, reason "collective"; else the
        plain one PLAIN_REPORT_AFTER_S later), or None when a round change is
        under way, the worker parked in another round, or this was reported."""
        if self.reform is not None:
            return None  # the round changed meanwhile: the server knew
        if round_no != a.round or self._broken_reported == (a.round, echo):
            return None
        from rdzv_common.protocol import ExitRecord

        self._broken_reported = (a.round, echo)
        if echo:
            self._say(
                "round %d: local rank %d left its step (a collective failed); telling the server", a.round, local_rank
            )
        else:
            self._say("round %d: still no new round %gs later; reporting a failure", a.round, PLAIN_REPORT_AFTER_S)
        return ExitRecord(
            local_rank=local_rank,
            rank=a.rank_offset + local_rank,
            pid=group.pids[local_rank] if local_rank < len(group.pids) else 0,
            message="a collective failed; the worker waits in place for the next round",
            timestamp=time.time(),
            reason="collective" if echo else None,
        )
