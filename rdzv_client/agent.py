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
import time
from typing import TYPE_CHECKING, TextIO

# Not rdzv_common.protocol (pydantic) here: the first join goes without it; the link
# imports the models right after, and the branches that need them then (a dict look-up).
from rdzv_common.wire import DEFAULT_MAX_RESTARTS, heartbeat_every, printable

from . import attempt, peer_probe
from .attempt import (
    announce,
    cannot_start,
    exit_records,
    note_failures,
    run_log_dir,
    store_port_taken,
    worker_envs,
    worker_group,
)
from .client import AgentLink
from .config import (  # noqa: F401 - build_parser, config_from_args, UsageError: the agent's public names
    DEFAULT_SERVER_TIMEOUT_S,
    AgentConfig,
    UsageError,
    build_parser,
    config_from_args,
)
from .endpoints import resolve
from .health import wait_healthy
from .inplace_steps import InPlaceSteps
from .launch import WORKER_EXIT_RESTART, in_place_env_note
from .preflight import command_problem
from .quiet import Quiet
from .reactions import (  # noqa: F401 - Phase and the exit codes: the agent's public names
    EXIT_FAILED,
    EXIT_GAVE_UP,
    EXIT_USAGE,
    FATAL_CODES,
    Phase,
    ServerReactions,
)
from .reform import InPlace
from .service import never_reached_text, outage_word
from .session import NodeSession, OutageWatch, port_taken, route_addr
from .status import StatusLine, setup_logging
from .tmpdirs import open_agent_dir
from .watch import WorkerWatch
from .workers import ExitInfo, WorkerGroup

if TYPE_CHECKING:
    from rdzv_common.protocol import Assignment

log = logging.getLogger("rdzv_agent")


class Agent(InPlaceSteps, ServerReactions):
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
            direct=cfg.health_check is None,  # a health check runs between rounds: it joins again after each
        )
        self.phase = Phase.JOINING
        self._link: AgentLink | None = None  # set once run() connects
        self.peers: peer_probe.PeerProbe | None = None  # probes of its peers, suspicions to the server (issue 23)
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
        self.log_dir = run_log_dir(cfg, self._dir.path)  # --log-dir's run directory, or logs kept for --tee
        self.outage = OutageWatch(cfg.server_timeout_s)
        self._quiet = Quiet()
        self.watch = WorkerWatch(cfg, self._say, self._dir.path)  # hangs, progress heartbeats, torch FileTimers
        self._held_for: str | None = None  # why the server holds this node as a spare (its host's block)
        self.failure_summary: tuple[int, str] | None = None  # (round, torchrun's block) of this node's last failure
        self.in_place = InPlace(cfg, self.watch, self._say)  # in-place mode: kept workers between rounds
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
            reach, unknown = await resolve(self.cfg.endpoint)
            if reach is None:
                print(f"rdzv-agent: error: {unknown[0]}", file=sys.stderr, flush=True)
                return EXIT_USAGE
            # before joining: a missing script is one line, not a job whose workers fail at every restart
            if problem := command_problem(self.cfg.cmd):
                print(f"rdzv-agent: error: {problem}", file=sys.stderr, flush=True)
                return EXIT_USAGE
            for why in unknown:
                self._say("%s; trying the other servers of --endpoint", why)
            if not self.session.addr:
                self.session.addr = route_addr(*reach)
            self._link = AgentLink(
                self.cfg.endpoint, self.cfg.token, heartbeat_s=heartbeat_every(self.session.spec["heartbeat_timeout_s"])
            )
            self.session.link = self._link
            self.peers = peer_probe.attach(self.session, self._link)
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
                self._say("%s", attempt.log_dir_line(self.cfg, self.log_dir))  # torchrun's words, and what goes there
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
            if self.peers is not None:
                self.peers.close()
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
                tick = self.watch.tick_s() if self.in_place.reform is None else 0.05
                done, _ = await asyncio.wait(waits, timeout=tick, return_when=asyncio.FIRST_COMPLETED)
                if sig not in done:
                    code = await self._check_server()
                    if code is not None:
                        return code
                    if self.in_place.reform is not None:
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
        tried = link.first_contact.never_reached()
        out = self.outage.check(link.unserved_for(), link.service.stable(), tried is not None)
        if out is None:
            return None
        if out.kind == "never_reached":
            self.status.done()
            print(
                f"[rdzv-agent] job {cfg.job_id}: giving up: {never_reached_text(out.down, tried)}",
                file=sys.stderr,
                flush=True,
            )
            self.phase = Phase.DONE
            return EXIT_GAVE_UP
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
        self.status.show(f"[rdzv-agent] {notice}", tty_only=True)  # off a terminal: the notice, every 30 s
        return None

    async def _start_workers(self, a: Assignment) -> None:
        if self.group is not None:  # kept in place through a round change
            if await self._assign_in_place(a):
                return
            self.in_place.end()
            await self._stop_workers()
        if a.group_rank == 0 and port_taken(a.master_port):
            # offered at its join and taken since by another process: a new round, charged to no one
            # (its workers' store could not listen: a worker failure, counted against the budget)
            self._say("round %d: its store port %d is taken; reporting it (not charged)", a.round, a.master_port)
            self.session.resume(a)
            self.phase = Phase.REPORTED
            self.session.report_failed(a.round, [store_port_taken(a)])
            return
        cfg = self.cfg
        self.session.assignment = a
        announce(cfg, a, self._say)
        err_root = self.log_dir or self._err_dir
        assert err_root is not None  # _err_dir is made when there is no log_dir
        envs = worker_envs(cfg, a, err_root, self.watch)
        self.watch.new_round(a.round)
        self.group = worker_group(cfg, a, envs, self.log_dir, self.worker_stderr)
        # workers that write to this terminal own it: no status line over their progress bars
        self.status.hold = self.group.config.shares_console()
        try:
            await self.group.start()
        except OSError as e:
            self.group = None
            self._say("cannot start workers: %s", e)
            rec = cannot_start(cfg, a, e)
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
        if self.in_place.reform is not None and all(i.exit_code == WORKER_EXIT_RESTART for i in infos if not i.ok):
            # assigned in place, then a kept worker asked for a new process before it parked
            # (rdzv_client.inplace_nccl): an escalation, as past --in-place-timeout, not a failure
            self.in_place.end()
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
        failed = [i for i in infos if not i.ok]
        try:  # torchrun's "host" (its fully qualified name); a slow resolver must not stall the loop
            host = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, socket.getfqdn), 2.0)
        except asyncio.TimeoutError:
            host = self.cfg.host
        err_root = self.log_dir or self._err_dir
        assert err_root is not None
        self.failure_summary = note_failures(
            self.cfg, a, failed, host, err_root, self.log_dir, self._say, self.watch.timer_killed
        )
        await self._stop_workers()
        records = exit_records(a, failed, self.watch, self.cfg.restart_mode == "in-place")
        self.phase = Phase.REPORTED
        self.session.report_failed(a.round, records)
        return None

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

    stderr = setup_logging(args.log_format, context)
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
