"""rdzv-agent: join a round, start workers with torchrun's environment,
supervise them, rejoin when membership changes, exit when the job ends.

The loop (one asyncio task) waits on three sources: the server's messages,
the worker group's end, and signals. The agent's state is one :class:`Phase`;
each combination of phase and event is one small branch of :meth:`Agent.run`;
everything slow (stopping workers, reporting) is awaited there, so there is
never more than one attempt alive. What is said to the server (joins, resume,
eviction, reports) is the :class:`~rdzv_client.session.NodeSession`'s, shared
with the torchrun plugin; the flags are parsed once into an
:class:`~rdzv_client.config.AgentConfig`.

Exit status: 0 when this node's workers all succeeded; 1 when the job failed
or was closed; 2 for a usage or configuration error (or the server refused this
node); 3 when the server stayed unreachable for ``--server-timeout`` seconds;
128+N after signal N.

Everything that came from the server is validated (the protocol models, then
:meth:`NodeSession.check_assignment`) and printed through ``printable()``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import TYPE_CHECKING, TextIO, cast

# Not rdzv_server.protocol (pydantic) here: the agent sends its first join
# without it; the link imports the models right after, and the branches below
# that need them import them then (a dictionary look-up by that time).
from rdzv_server import logs
from rdzv_server.wire import DEFAULT_MAX_RESTARTS, heartbeat_every, printable

from .client import AgentLink
from .config import (  # noqa: F401 - build_parser, config_from_args, UsageError: the agent's public names
    DEFAULT_SERVER_TIMEOUT_S,
    AgentConfig,
    UsageError,
    build_parser,
    config_from_args,
)
from .endpoints import parse_endpoint, parse_endpoints
from .exits import entrypoint_name, failure_summary
from .health import wait_healthy
from .launch import WORKER_EXIT_RESTART, in_place_env_note
from .quiet import Quiet
from .reactions import (  # noqa: F401 - Phase and the exit codes: the agent's public names
    EXIT_FAILED,
    EXIT_GAVE_UP,
    EXIT_USAGE,
    FATAL_CODES,
    Phase,
    ServerReactions,
)
from .service import outage_word
from .session import NodeSession, OutageWatch, route_addr
from .status import FreshLineHandler, StatusLine
from .tmpdirs import open_agent_dir
from .watch import WorkerWatch
from .workers import ExitInfo, LaunchConfig, WorkerGroup, describe, error_file_path, worker_env

if TYPE_CHECKING:
    from rdzv_server.protocol import Assignment

log = logging.getLogger("rdzv_agent")

# What an in-place assignment sets in a kept worker's environment (rdzv_client.worker.ASSIGNED_VARS).
IN_PLACE_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
)


def in_place_assignment(a: Assignment, local_rank: int, job_id: str, virtual_local_rank: bool) -> str:
    """The variables a kept worker of ``local_rank`` takes for round ``a``
    (``NAME=VALUE ...``), as worker_env gives a started one."""
    env = worker_env({}, a, local_rank, job_id, "", virtual_local_rank=virtual_local_rank)
    return " ".join(f"{k}={env[k]}" for k in IN_PLACE_VARS)


# A worker that parks unasked saw a collective fail. Its agent says so at once
# (reason "collective": the server only loses a member whose connection already
# dropped, the usual cause, and otherwise waits for the cause's own report); if
# the round has not changed this much later, it reports a plain (charged) failure.
PLAIN_REPORT_AFTER_S = 1.0


@dataclass
class Reform:
    """An in-place re-formation under way: the kept workers left ``old_round``
    and must all reach their safe point (``parked``) by ``deadline``."""

    old_round: int
    new_round: int
    started: float
    deadline: float


# -------------------------------------------------------------------- agent


class Agent(ServerReactions):
    """One node of one job. ``run()`` returns the process exit status."""

    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.session = NodeSession(
            job_id=cfg.job_id,
            host=cfg.host,
            nproc=cfg.nproc,
            spec=cfg.spec_fields(),
            addr=cfg.local_addr,
            job_secret=cfg.job_secret,
            requested_rank=cfg.node_rank,
            new_run=cfg.new_run,
        )
        self.phase = Phase.JOINING
        self._link: AgentLink | None = None  # set once run() connects
        self.group: WorkerGroup | None = None
        self._stopping: set[WorkerGroup] = set()  # groups being stopped: a second Ctrl-C kills them
        self.signals: asyncio.Queue[int] = asyncio.Queue()
        self.sigint_count = 0
        self.status = StatusLine()
        # where workers' stderr is copied (None: sys.stderr); with --log-format json the
        # agent's original stderr, not its json stream: workers' output is left alone
        self.worker_stderr: TextIO | None = None
        # this agent's private directory: the worker channel, error files without --log-dir;
        # a SIGKILLed agent's is removed by the next agent on the node (tmpdirs.py)
        self._dir = open_agent_dir()
        self._err_dir = self._dir.path / "err" if cfg.log_dir is None else None
        # torchrun's layout: LOG_DIR/<job id>_<random>/attempt_N/..., one run directory per agent,
        # so a re-run with the same --log-dir never replaces the last run's logs and error files
        self.log_dir: Path | None = None
        if cfg.log_dir is not None:
            cfg.log_dir.mkdir(parents=True, exist_ok=True)
            self.log_dir = Path(tempfile.mkdtemp(prefix=f"{cfg.job_id}_", dir=cfg.log_dir))
        elif any(v for s in (cfg.redirects, cfg.tee) for v in (s.values() if isinstance(s, dict) else [s])):
            # --redirects/--tee without --log-dir: in this agent's directory, kept after it exits
            # until the next agent on the node starts (torchrun's /tmp/torchelastic_* stay for ever)
            self.log_dir = self._dir.path / "logs"
            self.log_dir.mkdir()
        self.outage = OutageWatch(cfg.server_timeout_s)
        self._quiet = Quiet()
        self.watch = WorkerWatch(cfg, self._say, self._dir.path)  # hangs, progress heartbeats, torch FileTimers
        self._held_for: str | None = None  # why the server holds this node as a spare (its host's block)
        self.failure_summary: tuple[int, str] | None = None  # (round, torchrun's block) of this node's last failure
        self._reform: Reform | None = None  # in-place mode: kept workers moving to the next round
        # the round a parked worker's failure was reported for, and whether as an echo
        self._broken_reported: tuple[int, bool] | None = None
        self.watch.channel.on_parked = self._on_parked

    @property
    def link(self) -> AgentLink:
        return self.session.link

    @property
    def node_id(self) -> str:
        return self.session.node_id

    @property
    def assignment(self) -> Assignment | None:
        return self.session.assignment

    @property
    def addr(self) -> str | None:
        return self.session.addr

    # -- messages

    def _say(self, text: str, *args: object) -> None:
        self.status.done()
        log.info("job %s node %s: " + text, self.cfg.job_id, self.node_id, *args)

    def _join(self) -> None:
        self.phase = Phase.JOINING
        self.session.join()

    async def _join_when_healthy(self, rejoining: bool) -> bool:
        """Run --health-check, then join. While the check fails this node stays
        out (a member of the last round leaves the job, so the round re-forms
        without it), says why, sends the check's last line to the server's
        record of this host, and tries again with backoff; once it passes a node
        that left joins as a new node. False: a signal came first (not joined)."""
        left = False

        def failed(line: str) -> None:
            nonlocal left
            if rejoining and not left and self.link is not None:
                self.session.leave(f"health check failed: {line}")
                left = True

        if not await wait_healthy(self.cfg, self._say, lambda: not self.signals.empty(), failed):
            return False
        if left:
            self._say("health check passed; joining as a new node")
            self.phase = Phase.JOINING
            self.session.evicted()  # a new node id: the old one left the job
        else:
            self._join()
        return True

    # -- signals

    def handle_signal(self, signum: int) -> None:
        """Only record it: the loop acts. A second SIGINT means now."""
        if signum == signal.SIGINT:
            self.sigint_count += 1
            if self.sigint_count >= 2:
                for group in [self.group, *self._stopping]:
                    if group is not None:
                        group.kill_now()
        self.signals.put_nowait(signum)

    # -- the loop

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        # SIGHUP: a closed terminal or ssh session; torchrun treats it as SIGTERM.
        # cfg.signals: those three and the rest of --signals-to-handle (torchrun's default adds SIGQUIT)
        for sig in self.cfg.signals:
            loop.add_signal_handler(sig, self.handle_signal, sig)
        server = None
        try:
            if self.cfg.standalone:
                from rdzv_server.embedded import start_embedded

                server = await start_embedded()
                self.cfg.endpoint = f"127.0.0.1:{server[1]}"
            # every server of the list (HA replicas): one whose name does not exist will not start to;
            # a usage error when none does (one of several may be a replica that is down)
            unknown: list[str] = []
            reach: tuple[str, int] | None = None  # the first that resolves: its route is our address
            for url in parse_endpoints(self.cfg.endpoint):
                _, host, port = parse_endpoint(url)
                try:
                    await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                except socket.gaierror as e:
                    if e.errno != socket.EAI_AGAIN:
                        unknown.append(f"server host {printable(host)!r} does not resolve: {e.strerror}")
                        continue
                reach = reach or (host, port)
            if reach is None:
                print(f"rdzv-agent: error: {unknown[0]}", file=sys.stderr, flush=True)
                return EXIT_USAGE
            for why in unknown:
                self._say("%s; trying the other servers of --endpoint", why)
            if not self.session.addr:
                self.session.addr = route_addr(*reach)
            self._link = AgentLink(
                self.cfg.endpoint, self.cfg.token, heartbeat_s=heartbeat_every(self.session.spec["heartbeat_timeout_s"])
            )
            self.session.link = self._link
            await self._link.start()
            await self.watch.start(self._worker_pids)
            self._say(
                "joining %s at %s (nnodes %d:%d, %d worker(s) here, address %s, max-restarts %d%s)",
                self.cfg.endpoint,
                time.strftime("%H:%M:%S"),
                self.cfg.min_nodes,
                self.cfg.max_nodes,
                self.cfg.nproc,
                self.addr,
                self.cfg.max_restarts,
                " (torchrun: 0)" if self.cfg.max_restarts == DEFAULT_MAX_RESTARTS else "",
            )
            if self.log_dir is not None:
                self._say("log directory set to: %s", self.log_dir)  # torchrun's words
            if self.cfg.restart_mode == "in-place":
                self._say("%s", in_place_env_note(os.environ))
            if not await self._join_when_healthy(rejoining=False):
                return await self._on_signal(self.signals.get_nowait())
            return await self._loop()
        finally:
            if self.group is not None:
                await self.group.stop(self.cfg.stop_timeout_s)
            if self._link is not None:
                await self._link.close()
            self.watch.close()
            if server is not None:
                await server[0].cleanup()
            # our private directory: the error files' messages were read when workers ended
            keep = self.log_dir is not None and self.log_dir.parent == self._dir.path
            self._dir.close(keep=("logs",) if keep else ())
            if keep:
                self._say("worker logs in %s kept until the next rdzv-agent starts on this node", self.log_dir)
            self.status.done()

    async def _loop(self) -> int:
        link = self.link
        recv = asyncio.ensure_future(link.recv())
        sig = asyncio.ensure_future(self.signals.get())
        workers: asyncio.Future[list[ExitInfo]] | None = None
        workers_for: WorkerGroup | None = None
        try:
            while True:
                if workers is not None and workers_for is not self.group:
                    workers.cancel()  # that attempt was stopped (an in-place escalation): its end is no news
                    workers = None
                if self.group is not None and workers is None and self.phase is Phase.RUNNING:
                    workers, workers_for = asyncio.ensure_future(self.group.wait()), self.group
                waits = [recv, sig] + ([workers] if workers else [])
                tick = self.watch.tick_s() if self._reform is None else 0.05
                done, _ = await asyncio.wait(waits, timeout=tick, return_when=asyncio.FIRST_COMPLETED)
                if sig not in done:
                    code = await self._check_server()
                    if code is not None:
                        return code
                    if self._reform is not None:
                        await self._check_reform()
                    if workers is not None and workers not in done and self.phase is Phase.RUNNING:
                        await self._watch_workers()
                if not done:
                    continue
                if sig in done:
                    signum = sig.result()
                    return await self._on_signal(signum)
                if workers is not None and workers in done:
                    infos = workers.result()
                    workers = None
                    code = await self._on_workers_ended(infos)
                    if code is not None:
                        return code
                if recv in done:
                    msg = recv.result()
                    recv = asyncio.ensure_future(link.recv())
                    result = await self._on_message(msg)
                    if isinstance(result, int):
                        return result
                if workers is not None and workers_for is not self.group:
                    workers.cancel()  # that attempt was stopped; its end is no news
                    workers = None
                if self.group is not None and workers is None and self.phase is Phase.RUNNING:
                    workers, workers_for = asyncio.ensure_future(self.group.wait()), self.group
        finally:
            for f in (recv, sig, workers):
                if f is not None:
                    f.cancel()

    def _worker_pids(self) -> list[int]:
        return list(self.group.pids) if self.group is not None else []

    async def _watch_workers(self) -> None:
        """While workers run: torch's timers, hangs, and progress for the server."""
        now = time.monotonic()
        hung = self.watch.check(self.group, self.link, now)
        if hung:
            await self._on_hang(hung, now)

    async def _on_hang(self, hung: list[int], now: float) -> None:
        """Dump every local worker's stack into the log, stop them, report ``hang``."""
        a, group = self.assignment, self.group
        if a is None or group is None:
            return
        records = await self.watch.dump_hung(a, group, hung, now)
        await self._stop_workers()
        self.watch.channel.new_round(None)
        self.phase = Phase.REPORTED
        self.session.report_failed(a.round, records)

    async def _check_server(self) -> int | None:
        """Say that the server is unreachable where a person sees it (a log line
        when it starts, every OUTAGE_LOG_EVERY_S and when it ends, a countdown on
        the status line), and give up after --server-timeout."""
        link, cfg = self.link, self.cfg
        out = self.outage.check(link.unserved_for(), link.service.stable())
        if out is None:
            return None
        if out.kind == "back":
            self._say("server %s reachable again", cfg.endpoint)
            return None
        why = printable(link.last_error or "no answer", limit=300)
        word = outage_word(link.last_error)  # unreachable, or not serving this node
        if out.kind == "give_up":
            self.status.done()
            print(
                f"[rdzv-agent] job {cfg.job_id}: giving up: server {cfg.endpoint} {word} for "
                f"{cfg.server_timeout_s:g}s (--server-timeout; {why})"
                + ("; stopping workers" if self.group is not None else ""),
                file=sys.stderr,
                flush=True,
            )
            await self._stop_workers()
            self.phase = Phase.DONE
            return EXIT_GAVE_UP
        notice = (
            f"server {word} for {out.down:.0f}s at {cfg.endpoint} ({why})"
            + ("; workers keep running" if self.group is not None else "")
            + f"; giving up in {out.left:.0f}s"
        )
        if out.kind == "notice":
            self._say("%s", notice)
        self.status.show(f"[rdzv-agent] {notice}")
        return None

    # -- in-place re-formation (design.md "In-place re-formation")

    def _keep_workers(self, new_round: int) -> bool:
        """In-place mode, on a round change: tell every worker to leave its step
        and keep them. False (stop them the process way) when a worker is gone
        or does not listen (it does not use rdzv_client.worker.rounds())."""
        a, group, cfg = self.assignment, self.group, self.cfg
        if cfg.restart_mode != "in-place" or a is None or group is None or self.phase is not Phase.RUNNING:
            return False
        if not all(group.running(lr) for lr in range(cfg.nproc)):
            return False
        if not all(self.watch.channel.tell(lr, f"stop {new_round}") for lr in range(cfg.nproc)):
            self._say("a worker does not take rounds in place (rdzv_client.worker.rounds()): restarting them")
            return False
        now = time.monotonic()
        self._reform = Reform(a.round, new_round, now, now + cfg.in_place_timeout_s)
        return True

    def _end_reform(self) -> None:
        """Kept workers are not moving to a next round any more (they are stopped)."""
        self._reform = None

    def _assign_in_place(self, a: Assignment) -> bool:
        """Hand kept workers round ``a``; False: they must be restarted."""
        group, cfg = self.group, self.cfg
        if self._reform is None or group is None:
            return False
        gone = [lr for lr in range(cfg.nproc) if not group.running(lr)]
        if gone:
            codes = group.returncode(gone[0])
            asked = codes == WORKER_EXIT_RESTART
            why = " (it asked for a process restart: NCCL or its GPU did not recover)" if asked else ""
            self._say(
                "round %d: kept local rank %d exited %s%s; restarting this node's workers", a.round, gone[0], codes, why
            )
            return False
        for lr in range(cfg.nproc):
            text = in_place_assignment(a, lr, cfg.job_id, cfg.virtual_local_rank)
            if not self.watch.channel.tell(lr, f"assign {a.round} {text}"):
                self._say("round %d: local rank %d no longer listens; restarting this node's workers", a.round, lr)
                return False
        self.session.assignment = a
        self._say(
            "round %d: group rank %d of %d, ranks %d-%d of world %d, master %s:%d: workers kept in place",
            a.round,
            a.group_rank,
            a.group_world_size,
            a.rank_offset,
            a.rank_offset + a.local_world_size - 1,
            a.world_size,
            a.master_addr,
            a.master_port,
        )
        self.watch.new_round(a.round)
        self.phase = Phase.RUNNING
        self.session.resume(a)
        return True

    async def _check_reform(self) -> None:
        """Every kept worker parked: done. Past --in-place-timeout: restart them."""
        r, group = self._reform, self.group
        if r is None:
            return
        if group is None:
            self._reform = None
            return
        late = [lr for lr in range(self.cfg.nproc) if self.watch.channel.parked.get(lr) != r.old_round]
        if not late:
            if self.phase is Phase.RUNNING:  # assigned in place too: done
                self._reform = None
                log.debug("round %d: in place %.3fs after the round change", r.new_round, time.monotonic() - r.started)
            return
        if time.monotonic() < r.deadline:
            return
        self._reform = None
        blocked = await self.watch.where(group, r.new_round, late)
        self._say(
            "local rank(s) %s did not reach a safe point within %gs (--in-place-timeout): %s; restarting this "
            "node's workers",
            ",".join(map(str, late)),
            self.cfg.in_place_timeout_s,
            blocked,
        )
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
        if self._reform is not None or a is None or group is None or self.phase is not Phase.RUNNING:
            return False  # the round changed meanwhile: the server knew
        if round_no != a.round or self._broken_reported == (a.round, echo):
            return False
        from rdzv_server.protocol import ExitRecord

        self._broken_reported = (a.round, echo)
        if echo:
            self._say(
                "round %d: local rank %d left its step (a collective failed); telling the server", a.round, local_rank
            )
        else:
            self._say("round %d: still no new round %gs later; reporting a failure", a.round, PLAIN_REPORT_AFTER_S)
        rec = ExitRecord(
            local_rank=local_rank,
            rank=a.rank_offset + local_rank,
            pid=group.pids[local_rank] if local_rank < len(group.pids) else 0,
            message="a collective failed; the worker waits in place for the next round",
            timestamp=time.time(),
            reason="collective" if echo else None,
        )
        self.session.report_failed(a.round, [rec])
        return True

    async def _start_workers(self, a: Assignment) -> None:
        if self.group is not None:  # kept in place through a round change
            if self._assign_in_place(a):
                return
            self._reform = None
            await self._stop_workers()
        cfg = self.cfg
        self.session.assignment = a
        self._say(
            "round %d: group rank %d of %d, ranks %d-%d of world %d, master %s:%d, restart %d/%d",
            a.round,
            a.group_rank,
            a.group_world_size,
            a.rank_offset,
            a.rank_offset + a.local_world_size - 1,
            a.world_size,
            a.master_addr,
            a.master_port,
            a.restarts,
            a.max_restarts,
        )
        if cfg.node_rank is not None and a.group_rank != cfg.node_rank:
            why = (
                f"this round has {a.group_world_size} node(s)"
                if cfg.node_rank >= a.group_world_size
                else f"rank {cfg.node_rank} is held by another node"
            )
            self._say("asked for node rank %d, got %d (%s)", cfg.node_rank, a.group_rank, why)
        base = dict(os.environ)
        err_root = self.log_dir or self._err_dir
        assert err_root is not None  # _err_dir is made when there is no log_dir
        envs = []
        for lr in range(cfg.nproc):
            ef = error_file_path(err_root, a.round, lr)
            ef.parent.mkdir(parents=True, exist_ok=True)
            if ef.exists():
                ef.unlink()
            env = worker_env(
                base,
                a,
                lr,
                cfg.job_id,
                str(ef),
                role=cfg.role,
                signals_to_handle=cfg.signals_to_handle,
                virtual_local_rank=cfg.virtual_local_rank,
                in_place=cfg.restart_mode == "in-place",
            )
            self.watch.add_env(env)
            envs.append(env)
        self.watch.new_round(a.round)
        launch = LaunchConfig(
            cmd=cfg.cmd,
            local_world_size=cfg.nproc,
            log_dir=self.log_dir,
            redirects=cfg.redirects,
            tee=cfg.tee,
            local_ranks_filter=cfg.local_ranks_filter,
            share_console=not cfg.line_prefix,
        )
        template = os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")

        def prefix(lr: int) -> str:  # torchrun's template for prefixed lines
            return Template(template or "").safe_substitute(
                role_name=envs[lr].get("ROLE_NAME", "default"), rank=a.rank_offset + lr, local_rank=lr
            )

        self.group = WorkerGroup(
            launch, envs, attempt=a.round, prefix_fn=prefix if template else None, stderr=self.worker_stderr
        )
        # workers that write to this terminal own it: no status line over their progress bars
        self.status.hold = launch.shares_console()
        try:
            await self.group.start()
        except OSError as e:
            from rdzv_server.protocol import ExitRecord

            self.group = None
            self._say("cannot start workers: %s", e)
            rec = ExitRecord(
                local_rank=0,
                rank=a.rank_offset,
                pid=0,
                exit_code=127,
                message=f"cannot start {cfg.cmd[0]}: {e}",
                timestamp=time.time(),
            )
            self.phase = Phase.REPORTED
            self.session.report_failed(a.round, [rec])
            return
        self.phase = Phase.RUNNING
        self.session.resume(a)

    async def _stop_workers(self, timeout: float | None = None, sig: int = signal.SIGTERM) -> None:
        group, self.group = self.group, None
        self.status.hold = False
        if self.phase is Phase.RUNNING:
            self.phase = Phase.STOPPING
        if group is not None:
            self._stopping.add(group)
            try:
                if self.sigint_count >= 2:
                    group.kill_now()
                await group.stop(self.cfg.stop_timeout_s if timeout is None else timeout, sig)
            finally:
                self._stopping.discard(group)

    async def _on_workers_ended(self, infos: list[ExitInfo]) -> int | None:
        a = self.assignment
        if self.phase is not Phase.RUNNING or a is None:
            return None
        if self._reform is not None and all(i.exit_code == WORKER_EXIT_RESTART for i in infos if not i.ok):
            # assigned in place, then a kept worker asked for a new process before it parked
            # (rdzv_client.inplace_nccl): an escalation, as past --in-place-timeout, not a failure
            self._reform = None
            for i in infos:
                self._say(
                    "round %d: kept local rank %d exited %d (it asked for a process restart: NCCL or its GPU did "
                    "not recover); restarting this node's workers",
                    a.round,
                    i.local_rank,
                    WORKER_EXIT_RESTART,
                )
            await self._stop_workers()
            await self._start_workers(a)
            return None
        if all(i.ok for i in infos):
            await self._stop_workers()
            self.phase = Phase.SUCCEEDED
            self._say("round %d: all %d worker(s) exited 0; reporting success", a.round, len(infos))
            self.session.report_succeeded(a.round)
            return None
        from rdzv_server.protocol import ExitRecord

        failed = [i for i in infos if not i.ok]
        try:  # torchrun's "host" (its fully qualified name); a slow resolver must not stall the loop
            host = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, socket.getfqdn), 2.0)
        except asyncio.TimeoutError:
            host = self.cfg.host
        self._note_failures(a, failed, host)
        await self._stop_workers()
        records = [
            ExitRecord(
                local_rank=i.local_rank,
                rank=a.rank_offset + i.local_rank,
                pid=i.pid,
                exit_code=i.exit_code,
                signal=i.signal,
                message=self.watch.exit_message(i),
                timestamp=i.timestamp,
                reason="timer" if self.watch.timer_killed(i.pid) else None,
            )
            for i in failed
        ]
        self.phase = Phase.REPORTED
        self.session.report_failed(a.round, records)
        return None

    def _note_failures(self, a: Assignment, failed: list[ExitInfo], host: str) -> None:
        """Say each failure (with its error file when --log-dir keeps it) and keep
        torchrun's summary block, printed if the job fails with this round; the
        error files are read now: without --log-dir they go when the agent exits."""
        err_root = self.log_dir or self._err_dir
        assert err_root is not None
        # the file each worker was given: one kept in place has the round it started in
        error_files = {
            i.local_rank: i.error_file or str(error_file_path(err_root, a.round, i.local_rank)) for i in failed
        }
        for i in failed:
            kept = self.log_dir is not None and os.path.isfile(error_files[i.local_rank])
            where = f"; error file {error_files[i.local_rank]}" if kept else ""
            self._say("round %d: %s%s", a.round, describe(i, a.rank_offset + i.local_rank), where)
        self.failure_summary = (
            a.round,
            failure_summary(
                entrypoint_name(self.cfg.cmd, sys.executable),
                [(a.rank_offset + i.local_rank, i, error_files[i.local_rank]) for i in failed],
                host,
                show_paths=self.log_dir is not None,
            ),
        )

    async def _on_signal(self, signum: int) -> int:
        name = signal.Signals(signum).name
        self._say("%s: stopping workers and leaving the job", name)
        self.phase = Phase.STOPPING
        if self._link is not None and self._link.connected.is_set():
            self.session.leave(f"agent got {name}")
        await self._stop_workers(sig=signum if signum in (signal.SIGTERM, signal.SIGINT) else signal.SIGTERM)
        await asyncio.sleep(0.05)  # let the leave frame go out before the socket closes
        return 128 + signum


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    agent: Agent | None = None

    def context() -> dict[str, object]:
        if agent is None:
            return {}
        a = agent.assignment
        return {"job": agent.cfg.job_id, "node": agent.node_id, "round": a.round if a is not None else None}

    stderr = sys.stderr
    if args.log_format == "json":
        # stderr is the agent's log: what it prints there directly becomes json too
        sys.stderr = cast(TextIO, logs.JsonStream(stderr, context))
    if args.log_format == "text":
        # on a terminal each line starts on a cleared line: never inside a worker's progress bar
        handler = FreshLineHandler(stderr)
        handler.setFormatter(logging.Formatter("[rdzv-agent %(asctime)s] %(message)s", datefmt="%H:%M:%S"))
        logging.basicConfig(level=os.environ.get("RDZV_LOG_LEVEL", "INFO"), handlers=[handler])
    else:
        logs.setup(
            args.log_format,
            os.environ.get("RDZV_LOG_LEVEL", "INFO"),
            "[rdzv-agent %(asctime)s] %(message)s",
            datefmt="%H:%M:%S",
            context=context,
            stream=stderr,
        )
    try:
        cfg = config_from_args(args)
    except UsageError as e:
        print(f"rdzv-agent: error: {e}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None
    for note in cfg.notes:  # torchrun's flags that rdzv does differently, one line each
        log.warning("note: %s", note)
    try:
        agent = Agent(cfg)
    except OSError as e:  # --log-dir or the temporary directory cannot be written
        print(f"rdzv-agent: error: cannot make the log or temporary directory: {e}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None
    if args.log_format == "json":
        agent.status = StatusLine(sys.stderr)
        agent.worker_stderr = stderr
    code = asyncio.run(agent.run())
    raise SystemExit(code)


if __name__ == "__main__":
    main()
