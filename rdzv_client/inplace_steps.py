"""The agent's in-place re-formation (design.md "In-place re-formation"): keep
the workers over a round change, hand them the next round, restart them past
``--in-place-timeout``, and report a parked worker's failed collective. A mixin
of :class:`~rdzv_client.agent.Agent` (its state and its steps are the agent's,
declared here for the type checker); what is done with the kept workers
themselves is :class:`~rdzv_client.reform.InPlace`'s.
"""

from __future__ import annotations

import asyncio
import signal
from typing import TYPE_CHECKING

from .attempt import place_text
from .reactions import Phase
from .reform import PLAIN_REPORT_AFTER_S

if TYPE_CHECKING:
    from rdzv_common.protocol import Assignment

    from .config import AgentConfig
    from .reform import InPlace
    from .session import NodeSession
    from .watch import WorkerWatch
    from .workers import WorkerGroup


class InPlaceSteps:
    """The agent's in-place steps (mixed into Agent)."""

    cfg: AgentConfig
    session: NodeSession
    phase: Phase
    group: WorkerGroup | None
    in_place: InPlace
    watch: WorkerWatch

    if TYPE_CHECKING:  # the agent's own, used here

        @property
        def assignment(self) -> Assignment | None: ...

        def _say(self, text: str, *args: object) -> None: ...

        async def _start_workers(self, a: Assignment) -> None: ...

        async def _stop_workers(self, timeout: float | None = None, sig: int = signal.SIGTERM) -> None: ...

    def _keep_workers(self, new_round: int) -> bool:
        """In-place mode, on a round change: keep the workers (they leave their
        step). False: stop them the process way."""
        a, group = self.assignment, self.group
        if self.cfg.restart_mode != "in-place" or a is None or group is None or self.phase is not Phase.RUNNING:
            return False
        return self.in_place.keep(a.round, new_round, group)

    def _end_reform(self) -> None:
        """Kept workers are not moving to a next round any more (they are stopped)."""
        self.in_place.end()

    async def _assign_in_place(self, a: Assignment) -> bool:
        """Hand kept workers round ``a``; False: they must be restarted."""
        if not await self.in_place.assign(a, self.group):
            return False
        self.session.assignment = a
        self._say("round %d: %s: workers kept in place", a.round, place_text(a))
        self.watch.new_round(a.round)
        self.phase = Phase.RUNNING
        self.session.resume(a)
        return True

    async def _check_reform(self) -> None:
        """Every kept worker parked: done. Past --in-place-timeout: restart them."""
        if not await self.in_place.check(self.group, self.phase is Phase.RUNNING):
            return
        a, running = self.assignment, self.phase is Phase.RUNNING
        await self._stop_workers()
        if running and a is not None:
            await self._start_workers(a)

    def _on_parked(self, local_rank: int, round_no: int) -> None:
        """A worker reached its safe point. Unasked (no round change under way),
        a collective of the round it runs failed: say so now as an echo (the
        round re-forms at once if a member's connection dropped), and as a
        plain failure PLAIN_REPORT_AFTER_S later if the round is still the same."""
        if self._report_parked(local_rank, round_no, echo=True):
            asyncio.get_running_loop().call_later(
                PLAIN_REPORT_AFTER_S, self._report_parked, local_rank, round_no, False
            )

    def _report_parked(self, local_rank: int, round_no: int, echo: bool) -> bool:
        a, group = self.assignment, self.group
        if a is None or group is None or self.phase is not Phase.RUNNING:
            return False  # the round changed meanwhile: the server knew
        rec = self.in_place.parked_failure(a, group, local_rank, round_no, echo)
        if rec is None:
            return False
        self.session.report_failed(a.round, [rec])
        return True
