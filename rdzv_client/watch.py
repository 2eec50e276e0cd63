"""The agent's watch over its running workers (issue 15): the worker channel
(``progress()`` datagrams, from which hangs and the progress heartbeats sent to
the server come) and torch's FileTimer pipe when ``TORCHELASTIC_ENABLE_FILE_TIMER=1``.

:class:`WorkerWatch` is owned by the :class:`~rdzv_client.agent.Agent`, which
calls it; the agent keeps the decisions (stopping workers, what is reported).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

# Not rdzv_common.protocol (pydantic) at import: the agent imports this before its first join.
from rdzv_common.errors import MAX_ERROR_MESSAGE
from rdzv_common.spec_table import DEFAULT_STRAGGLER_WINDOW_S
from rdzv_common.wire import MAX_TIMING_WINDOW_S, MAX_TIMINGS, printable

from . import channel_grammar as grammar
from .channel import FileTimerServer, WorkerChannel
from .nccl_trace import RasWatch

if TYPE_CHECKING:
    from rdzv_common.protocol import Assignment, ExitRecord

    from .client import AgentLink
    from .config import AgentConfig
    from .workers import ExitInfo, WorkerGroup

# After SIGUSR1 (and SIGCONT, for a stopped worker), how long workers get to
# write their stacks before a hung round's workers are stopped.
STACK_DUMP_WAIT_S = 1.0
# An in-place escalation waits this long for the late workers to say where they are blocked.
WHERE_WAIT_S = 0.5


class WorkerWatch:
    """Hang checks, progress heartbeats and torch FileTimers for one agent."""

    def __init__(self, cfg: AgentConfig, say: Callable[..., None], dir: Path | None = None) -> None:
        self.cfg = cfg
        self._say = say
        # the worker channel: progress() datagrams, and torch's FileTimer pipe when enabled
        self.channel = WorkerChannel(cfg.nproc, dir)
        self.timer: FileTimerServer | None = None
        self._timer_killed: dict[int, str] = {}  # worker pid -> the expired timer's scope
        self._progress_sent_at = 0.0
        self._lag_sent = False  # the last heartbeat sent named ranks behind in NCCL RAS
        # NCCL RAS: ranks behind in collective count (issue 22's zero-code fallback), where NCCL is in use
        self.ras = RasWatch(float(cfg.spec_values.get("straggler_window_s") or DEFAULT_STRAGGLER_WINDOW_S))

    async def start(self, worker_pids: Callable[[], list[int]]) -> None:
        self.channel.workers = worker_pids  # datagrams from any other process are ignored
        await self.channel.start()
        if os.environ.get("TORCHELASTIC_ENABLE_FILE_TIMER") == "1":
            path = os.environ.get("TORCHELASTIC_TIMER_FILE") or str(self.channel.dir / "timer")
            self.timer = FileTimerServer(path, allowed=worker_pids, on_expired=self._on_timer_expired)
            self.timer.start()

    def close(self) -> None:
        if self.timer is not None:
            self.timer.close()
        self.channel.close()

    def tick_s(self) -> float:
        """How often the loop looks at the server link and the workers' progress."""
        hang = self.cfg.hang_timeout_s
        return 1.0 if hang is None else max(0.05, min(1.0, hang / 4))

    def add_env(self, env: dict[str, str]) -> None:
        """What a worker needs to reach the channel (and the timer pipe)."""
        env["RDZV_AGENT_SOCKET"] = self.channel.path
        env["RDZV_AGENT_PID"] = str(os.getpid())  # an in-place worker takes stop/assign from this pid only
        if self.timer is not None:
            env["TORCHELASTIC_TIMER_FILE"] = self.timer.path

    def new_round(self, round_no: int) -> None:
        """Workers of round ``round_no`` are about to start."""
        self.channel.new_round(round_no)
        self._progress_sent_at = time.monotonic()
        self.ras.new_round()
        if self.timer is not None:
            self.timer.clear()
        self._timer_killed.clear()

    def _on_timer_expired(self, pid: int, scope_id: str) -> None:
        self._timer_killed[pid] = scope_id
        self._say("torch elastic timer %r of worker pid %d expired: killed it", printable(scope_id, limit=100), pid)

    def check(self, group: WorkerGroup | None, link: AgentLink | None, now: float) -> list[int]:
        """While workers run: torch's timers, hangs, and progress for the server.
        Returns the local ranks that hung (nothing is sent then)."""
        if self.timer is not None:
            self.timer.check()
        hang = self.cfg.hang_timeout_s
        if hang is not None:
            # a worker that exited without finished() (os._exit) is not hung: its end is reported
            hung = [lr for lr in self.channel.hung(hang, now) if group is not None and group.running(lr)]
            if hung:
                return hung
        if group is not None:
            for lr, f in self.ras.tick(now, group.pids):
                self._say(
                    "local rank %d (pid %d) is behind its NCCL communicator %s in %d%% of %d RAS readings over "
                    "%gs (by up to %d collectives): a lock-step straggler",
                    lr, f.pid, f.comm, round(f.share * 100), f.samples, self.ras.tracker.window_s, f.behind,
                )  # fmt: skip
        if link is not None and now - self._progress_sent_at >= link.heartbeat_s:
            sample = self.channel.sample(now)
            # ranks NCCL RAS sees behind go with every heartbeat while they lag, [] once when none does
            lagging, said = self.ras.lagging if group is not None else [], self._lag_sent
            if sample is not None or lagging or said:
                self._progress_sent_at, self._lag_sent = now, bool(lagging)
                from rdzv_common.protocol import HeartbeatMsg, RankLag, RankTiming

                lag = [
                    RankLag(local_rank=lr, share=f.share, readings=f.samples, behind=min(f.behind, 2**53),
                            window_s=min(self.ras.tracker.window_s, MAX_TIMING_WINDOW_S))
                    for lr, f in lagging[:MAX_TIMINGS]  # the wire's bound: the first local ranks
                ]  # fmt: skip
                if sample is None:
                    msg = HeartbeatMsg(nccl_lag=lag)
                else:
                    timings = [RankTiming.model_validate(t) for t in self.channel.timings()]
                    msg = HeartbeatMsg(step=sample[0], rate=sample[1], timings=timings or None, nccl_lag=lag or None)
                link.send_nowait(msg.model_dump_json())
        return []

    async def dump_hung(self, a: Assignment, group: WorkerGroup, hung: list[int], now: float) -> list[ExitRecord]:
        """Say which workers hung and dump every local worker's stack into the
        log; the ``hang`` records to report once the workers are stopped."""
        from rdzv_common.protocol import ExitRecord  # loaded once the join is out

        cfg = self.cfg
        records: list[ExitRecord] = []
        for lr in hung:
            rp = self.channel.ranks[lr]
            idle = now - rp.at
            pid = group.pids[lr] if lr < len(group.pids) else 0
            why = (
                f"no progress() for {idle:.1f}s (hang timeout {cfg.hang_timeout_s:g}s) on host "
                f"{cfg.host}, last step {rp.step}"
            )
            self._say(
                "round %d: local rank %d (rank %d) pid %d hung: %s; dumping every worker's stack",
                a.round,
                lr,
                a.rank_offset + lr,
                pid,
                why,
            )
            records.append(
                ExitRecord(
                    local_rank=lr,
                    rank=a.rank_offset + lr,
                    pid=pid,
                    message=why[:MAX_ERROR_MESSAGE],
                    timestamp=time.time(),
                    reason="hang",
                    last_step=rp.step,
                )
            )
        # faulthandler (registered by rdzv_client.worker) writes the stack to the
        # worker's stderr; a stopped worker writes it once it continues
        for sig in (signal.SIGUSR1, signal.SIGCONT):
            for pid in group.pids:
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        await asyncio.sleep(STACK_DUMP_WAIT_S)
        return records

    async def where(self, group: WorkerGroup, new_round: int, late: list[int]) -> str:
        """Which call each late worker is blocked in (an in-place escalation):
        asked on the worker channel, whose thread in the worker answers with
        the main thread's innermost frames; SIGUSR1 dumps every thread's stack
        into the log as well (as for a hang). A stopped worker does not answer."""
        ch = self.channel
        for lr in late:
            ch.where.pop(lr, None)
            ch.tell(lr, grammar.ask_where(new_round))
            if lr < len(group.pids):
                try:
                    os.kill(group.pids[lr], signal.SIGUSR1)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + WHERE_WAIT_S
        # the answers come in through the channel's reader on this loop: a short poll, bounded
        while time.monotonic() < deadline and any(lr not in ch.where for lr in late):  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        return "; ".join(
            f"local rank {lr} blocked in {ch.where[lr]}" if lr in ch.where else f"local rank {lr} did not answer"
            for lr in late
        )

    def timer_killed(self, pid: int) -> bool:
        return pid in self._timer_killed

    def exit_message(self, i: ExitInfo) -> str:
        scope = self._timer_killed.get(i.pid)
        if scope is None:
            return i.message[:MAX_ERROR_MESSAGE]
        head = f"torch elastic timer {printable(scope, limit=200)!r} expired; the agent killed the worker"
        return (head + ("\n" + i.message if i.message else ""))[:MAX_ERROR_MESSAGE]
