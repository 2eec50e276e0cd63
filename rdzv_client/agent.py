"""rdzv-agent: join a round, start workers with torchrun's environment,
supervise them, rejoin when membership changes, exit when the job ends.

The loop (one asyncio task) waits on three sources: the server's messages,
the worker group's end, and signals. Each combination of state and event is
one small branch of :meth:`Agent.run`; everything slow (stopping workers,
reporting) is awaited there, so there is never more than one attempt alive.

Exit status: 0 when this node's workers all succeeded; 1 when the job failed
or was closed; 2 for a usage or configuration error (or the server refused this
node); 3 when the server stayed unreachable for ``--server-timeout`` seconds;
128+N after signal N.

Everything that came from the server is validated (the protocol models, then
:meth:`Agent._check_assignment`) and printed through ``printable()``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from rdzv_server import __version__
from rdzv_server.protocol import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_JOIN_TIMEOUT_S,
    DEFAULT_LAST_CALL_S,
    DEFAULT_MAX_RESTARTS,
    DEFAULT_SCALE_UP_WINDOW_S,
    MAX_SECRET_LEN,
    SECRET_PATTERN,
    AckMsg,
    AssignedMsg,
    Assignment,
    DoneMsg,
    ErrorCode,
    ErrorMsg,
    EvictedMsg,
    ExitRecord,
    FailedMsg,
    heartbeat_interval,
    JobSpec,
    JoinedMsg,
    JoinMsg,
    LeaveMsg,
    RdzvError,
    RestartMsg,
    SpareMsg,
    StatusMsg,
    SucceededMsg,
    is_valid_id,
    printable,
)

from .client import AgentLink, parse_endpoint
from .workers import ExitInfo, LaunchConfig, Std, WorkerGroup, describe, error_file_path, parse_std, worker_env

log = logging.getLogger("rdzv_agent")

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_GAVE_UP = 3
DEFAULT_SERVER_TIMEOUT_S = 300.0
# An outage shorter than this is a reconnect, not news; a longer one is logged
# when it starts, every OUTAGE_LOG_EVERY_S while it lasts, and when it ends.
OUTAGE_NOTICE_AFTER_S = 2.0
OUTAGE_LOG_EVERY_S = 30.0
# Reports whose outcome we wait for; a server that is down is waited for this long.
REPORT_TIMEOUT_S = 60.0
FATAL_CODES = {ErrorCode.SPEC_MISMATCH, ErrorCode.JOB_FINISHED, ErrorCode.VALIDATION_ERROR,
               ErrorCode.UNAUTHORIZED, ErrorCode.BAD_REQUEST, ErrorCode.JOB_SECRET_MISMATCH}


class UsageError(Exception):
    """Bad flags or environment: print one line, exit 2."""


# ------------------------------------------------------------------ settings


@dataclass
class AgentConfig:
    endpoint: str
    job_id: str
    min_nodes: int
    max_nodes: int
    nproc: int
    cmd: list[str]
    max_restarts: int = DEFAULT_MAX_RESTARTS
    node_rank: int | None = None
    local_addr: str | None = None
    token: str | None = None
    job_secret: str | None = field(default=None, repr=False)
    log_dir: Path | None = None
    redirects: dict[int, Std] | Std = Std.NONE
    tee: dict[int, Std] | Std = Std.NONE
    local_ranks_filter: set[int] | None = None
    last_call_s: float = DEFAULT_LAST_CALL_S
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S
    scale_up_window_s: float = DEFAULT_SCALE_UP_WINDOW_S
    stop_timeout_s: float = 10.0
    server_timeout_s: float = DEFAULT_SERVER_TIMEOUT_S
    standalone: bool = False
    host: str = field(default_factory=socket.gethostname)

    def spec(self) -> JobSpec:
        return JobSpec(min_nodes=self.min_nodes, max_nodes=self.max_nodes, max_restarts=self.max_restarts,
                       last_call_s=self.last_call_s, heartbeat_timeout_s=self.heartbeat_timeout_s,
                       join_timeout_s=self.join_timeout_s, scale_up_window_s=self.scale_up_window_s)


def _env(name: str, default=None):
    """torchrun's PET_* variables (as Kubernetes operators set them), then ours."""
    return os.environ.get("PET_" + name.upper().replace("-", "_"), default)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show a default only where there is one and the help does not say it."""

    def _get_help_string(self, action):
        if action.default in (None, False, "") or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rdzv-agent",
        allow_abbrev=False,  # the script's own --node or --log must not match our flags
        description="Launch and supervise one node's workers of an elastic PyTorch job "
                    "(a drop-in for torchrun; see rdzv-server).",
        formatter_class=_HelpFormatter,
    )
    a = p.add_argument
    a("--version", action="version", version=f"rdzv-agent {__version__}")
    a("--endpoint", "--rdzv-endpoint", "--rdzv_endpoint", dest="endpoint",
      default=os.environ.get("RDZV_ENDPOINT") or _env("rdzv_endpoint"), help="rdzv-server HOST:PORT ($RDZV_ENDPOINT)")
    a("--job-id", "--rdzv-id", "--rdzv_id", "--run-id", dest="job_id",
      default=_env("rdzv_id") or os.environ.get("SLURM_JOB_ID"), help="job id; under SLURM defaults to $SLURM_JOB_ID")
    a("--nnodes", default=_env("nnodes", "1"), help="N or MIN:MAX nodes")
    a("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", default=_env("nproc_per_node", "1"),
      help="workers on this node: N, gpu (one per GPU), cpu (one per core), auto (gpu if any, else cpu)")
    a("--max-restarts", "--max_restarts", dest="max_restarts", type=int,
      default=int(_env("max_restarts", DEFAULT_MAX_RESTARTS)), help="restarts after worker failures before the job fails")
    a("--node-rank", "--node_rank", dest="node_rank", type=int, default=_env("node_rank"),
      help="ask for this group rank (honoured when free and smaller than the number of nodes)")
    a("--local-addr", "--local_addr", dest="local_addr", default=_env("local_addr"),
      help="address other nodes reach this one at (default: the one that reaches the server)")
    a("--token", default=None, help="bearer token for the server (default: $RDZV_TOKEN)")
    a("--job-secret", dest="job_secret", default=None,
      help="the job's secret: the first node sets it, every other node must bring the same "
           "(default: $RDZV_JOB_SECRET, better than the flag, which other users see in ps)")
    a("--log-dir", "--log_dir", dest="log_dir", default=_env("log_dir"),
      help="per-attempt worker logs: DIR/attempt_ROUND/LOCAL_RANK/{stdout,stderr}.log")
    a("--redirects", "-r", default=_env("redirects", "0"),
      help="send worker output to log files only: 0 none, 1 stdout, 2 stderr, 3 both; or 0:3,1:0 per rank")
    a("--tee", "-t", default=_env("tee", "0"), help="copy worker output to log files too (values as --redirects)")
    a("--local-ranks-filter", "--local_ranks_filter", dest="local_ranks_filter", default=_env("local_ranks_filter", ""),
      help="show only these local ranks on the console, e.g. 0 or 0,2")
    a("--standalone", action="store_true", default=bool(_env("standalone")),
      help="single node: run an embedded server on a free localhost port")
    a("-m", "--module", action="store_true", help="run the script as a python module (python -m)")
    a("--no-python", "--no_python", dest="no_python", action="store_true",
      help="run the script as an executable, not with python")
    a("--last-call", type=float, default=DEFAULT_LAST_CALL_S,
      help="seconds the first round waits for more nodes once min is reached")
    a("--heartbeat-timeout", type=float, default=DEFAULT_HEARTBEAT_TIMEOUT_S,
      help="seconds of silence after which the server evicts a node")
    a("--join-timeout", type=float, default=DEFAULT_JOIN_TIMEOUT_S,
      help="seconds a job below min nodes waits for more before it fails")
    a("--scale-up-window", type=float, default=DEFAULT_SCALE_UP_WINDOW_S,
      help="seconds new nodes are batched before one scale-up round")
    a("--stop-timeout", type=float, default=10.0, help="seconds workers get between SIGTERM and SIGKILL")
    a("--server-timeout", type=float,
      default=os.environ.get("RDZV_SERVER_TIMEOUT", DEFAULT_SERVER_TIMEOUT_S),
      help="give up (stop workers, exit 3) when the server has been unreachable this many seconds "
           "($RDZV_SERVER_TIMEOUT, default 300)")
    # torchrun flags that mean nothing here: accepted so command lines carry over.
    a("--rdzv-backend", "--rdzv_backend", default=None, help=argparse.SUPPRESS)
    a("--rdzv-conf", "--rdzv_conf", default="", help="torchrun's key=value,... (join_timeout, last_call_timeout)")
    a("--monitor-interval", "--monitor_interval", default=None, help=argparse.SUPPRESS)
    a("--start-method", "--start_method", default=None, help=argparse.SUPPRESS)
    a("--role", default=None, help=argparse.SUPPRESS)
    a("script", help="training script (or module with -m, or executable with --no-python)")
    a("script_args", nargs=argparse.REMAINDER, help="its arguments")
    return p


def parse_nnodes(text: str) -> tuple[int, int]:
    try:
        if ":" in text:
            lo, hi = (int(x) for x in text.split(":", 1))
        else:
            lo = hi = int(text)
    except ValueError:
        raise UsageError(f"--nnodes {text!r}: expected N or MIN:MAX") from None
    if not 1 <= lo <= hi:
        raise UsageError(f"--nnodes {text!r}: need 1 <= MIN <= MAX")
    return lo, hi


def count_procs(value: str) -> int:
    """torchrun's --nproc-per-node: a number, or gpu/cpu/auto. Imports torch
    only to count GPUs."""
    if value.isdigit():
        n = int(value)
        if n < 1:
            raise UsageError("--nproc-per-node must be at least 1")
        return n
    if value == "cpu":
        return os.cpu_count() or 1
    if value in ("gpu", "auto"):
        try:
            import torch  # noqa: PLC0415 - only here, on purpose
            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        except ImportError:
            gpus = 0
        if gpus:
            return gpus
        if value == "gpu":
            raise UsageError("--nproc-per-node gpu: no CUDA GPU found on this node")
        return os.cpu_count() or 1
    raise UsageError(f"--nproc-per-node {value!r}: expected N, gpu, cpu or auto")


def check_slurm() -> None:
    """One agent per node: a second SLURM task on the same node would start a
    second set of workers on the same GPUs."""
    ntasks = os.environ.get("SLURM_NTASKS_PER_NODE", "")
    localid = os.environ.get("SLURM_LOCALID", "")
    first = ntasks.split("(")[0].split(",")[0]
    if (first.isdigit() and int(first) > 1) or (localid.isdigit() and int(localid) > 0):
        raise UsageError(
            f"SLURM started more than one task on this node (SLURM_NTASKS_PER_NODE={ntasks or '?'}, "
            f"SLURM_LOCALID={localid or '?'}); rdzv-agent starts all of a node's workers itself: "
            "run it with srun --ntasks-per-node=1")


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    check_slurm()
    min_nodes, max_nodes = parse_nnodes(str(args.nnodes))
    conf = {}
    for item in filter(None, (args.rdzv_conf or "").split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--rdzv-conf item {item!r}: expected key=value")
        conf[key.strip()] = value.strip()
    try:
        join_timeout = float(conf.pop("join_timeout", args.join_timeout))
        last_call = float(conf.pop("last_call_timeout", args.last_call))
    except ValueError as e:
        raise UsageError(f"--rdzv-conf: {e}") from None
    if args.rdzv_backend not in (None, "rdzv", "c10d", "static"):
        raise UsageError(f"--rdzv-backend {args.rdzv_backend!r}: rdzv-agent always uses an rdzv server")
    standalone = args.standalone
    endpoint = args.endpoint
    if standalone:
        min_nodes = max_nodes = 1
        endpoint = "127.0.0.1:29400"  # replaced by the embedded server's free port
    elif not endpoint:
        raise UsageError("no server: pass --endpoint HOST:PORT (or set RDZV_ENDPOINT), or use --standalone")
    try:
        parse_endpoint(endpoint)
    except ValueError as e:
        raise UsageError(str(e)) from None
    job_id = args.job_id or ("standalone" if standalone else None)
    if not job_id:
        raise UsageError("no job id: pass --job-id (torchrun: --rdzv-id), or run under SLURM")
    if not is_valid_id(job_id):
        raise UsageError(f"--job-id {job_id!r}: use 1-128 characters of letters, digits and ._:@+-")
    nproc = count_procs(str(args.nproc_per_node))
    if args.module and args.no_python:
        raise UsageError("-m and --no-python do not go together")
    if args.no_python:
        cmd = [args.script, *args.script_args]
    elif args.module:
        cmd = [sys.executable, "-u", "-m", args.script, *args.script_args]
    else:
        cmd = [sys.executable, "-u", args.script, *args.script_args]
    log_dir = Path(args.log_dir) if args.log_dir else None
    try:
        redirects = parse_std(str(args.redirects), nproc)
        tee = parse_std(str(args.tee), nproc)
        ranks_filter = {int(x) for x in str(args.local_ranks_filter).split(",") if x.strip()} or None
    except ValueError as e:
        raise UsageError(str(e)) from None
    if (any(redirects.values()) or any(tee.values())) and log_dir is None:
        log_dir = Path(tempfile.mkdtemp(prefix=f"rdzv-{job_id}-"))
    node_rank = int(args.node_rank) if args.node_rank is not None else None
    job_secret = args.job_secret if args.job_secret is not None else os.environ.get("RDZV_JOB_SECRET") or None
    if job_secret is not None and not re.fullmatch(SECRET_PATTERN, job_secret):
        raise UsageError(f"the job secret (--job-secret or RDZV_JOB_SECRET) must be 1-{MAX_SECRET_LEN} "
                         "printable ASCII characters")
    try:
        spec_check = JobSpec(min_nodes=min_nodes, max_nodes=max_nodes, max_restarts=args.max_restarts,
                             last_call_s=last_call, heartbeat_timeout_s=args.heartbeat_timeout,
                             join_timeout_s=join_timeout, scale_up_window_s=args.scale_up_window)
    except ValueError as e:
        raise UsageError(f"bad job settings: {e}") from None
    try:
        server_timeout = float(args.server_timeout)
    except ValueError:
        raise UsageError(f"--server-timeout {args.server_timeout!r}: expected seconds") from None
    if not 0 < server_timeout < float("inf"):
        raise UsageError(f"--server-timeout {args.server_timeout!r}: must be a positive number of seconds")
    return AgentConfig(
        endpoint=endpoint, job_id=job_id, min_nodes=min_nodes, max_nodes=max_nodes, nproc=nproc, cmd=cmd,
        max_restarts=args.max_restarts, node_rank=node_rank, local_addr=args.local_addr,
        token=args.token or os.environ.get("RDZV_TOKEN") or None, job_secret=job_secret, log_dir=log_dir,
        redirects=redirects, tee=tee, local_ranks_filter=ranks_filter,
        last_call_s=spec_check.last_call_s, heartbeat_timeout_s=spec_check.heartbeat_timeout_s,
        join_timeout_s=spec_check.join_timeout_s, scale_up_window_s=spec_check.scale_up_window_s,
        stop_timeout_s=args.stop_timeout, server_timeout_s=server_timeout, standalone=standalone,
    )


# ------------------------------------------------------------------ helpers


def new_node_id(host: str) -> str:
    """host, pid and a random suffix: IP addresses make poor ids (reused)."""
    clean = "".join(c if c.isalnum() or c in "._-" else "-" for c in host)[:80].lstrip("-._") or "node"
    return f"{clean}-{os.getpid()}-{secrets.token_hex(3)}"


def free_port(addr: str) -> int:
    """A port free on this node now: MASTER_PORT, fresh for every round."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr, 0))
        except OSError:
            s.bind(("", 0))
        return s.getsockname()[1]


def route_addr(host: str, port: int) -> str:
    """The local address that reaches ``host``: what peers can reach us at."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(info[0], socket.SOCK_DGRAM) as s:
            s.connect(info[4])
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


class StatusLine:
    """One line that updates in place on a terminal; elsewhere, a line when
    the text changes, not more than every few seconds."""

    def __init__(self, stream=sys.stderr) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.last = ""
        self.last_at = 0.0
        self.open = False

    def show(self, text: str) -> None:
        now = time.monotonic()
        if text == self.last:
            return
        if self.tty:
            self.stream.write("\r\x1b[2K" + text)
            self.open = True
        elif now - self.last_at >= 2.0 or not self.last:
            self.stream.write(text + "\n")
            self.last_at = now
        else:
            return
        self.stream.flush()
        self.last = text

    def done(self) -> None:
        if self.open:
            self.stream.write("\n")
            self.stream.flush()
            self.open = False
        self.last = ""


# -------------------------------------------------------------------- agent


class Agent:
    """One node of one job. ``run()`` returns the process exit status."""

    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.node_id = new_node_id(cfg.host)
        self.link: AgentLink | None = None
        self.group: WorkerGroup | None = None
        self._stopping: set[WorkerGroup] = set()  # groups being stopped: a second Ctrl-C kills them
        self.assignment: Assignment | None = None
        self.signals: asyncio.Queue[int] = asyncio.Queue()
        self.sigint_count = 0
        self.status = StatusLine()
        self.addr = cfg.local_addr
        self._err_dir = Path(tempfile.mkdtemp(prefix="rdzv-err-")) if cfg.log_dir is None else None
        self._group_running = False  # a worker group of the current round is up
        self._succeeded = False  # this node's workers all exited 0 and it reported so
        self._outage_logged_at: float | None = None  # when the outage notice was last logged

    # -- messages

    def _say(self, text: str, *args) -> None:
        self.status.done()
        log.info("job %s node %s: " + text, self.cfg.job_id, self.node_id, *args)

    def _join_msg(self, resume_round: int | None = None) -> JoinMsg:
        return JoinMsg(job_id=self.cfg.job_id, node_id=self.node_id, host=_host_label(self.cfg.host),
                       addr=self.addr, local_world_size=self.cfg.nproc,
                       master_port=self.assignment.master_port if resume_round is not None and self.assignment
                       else free_port(self.addr),
                       spec=self.cfg.spec(), requested_rank=self.cfg.node_rank, resume_round=resume_round,
                       job_secret=self.cfg.job_secret)

    def _join(self) -> None:
        self.assignment = None
        self.link.set_intent(self._join_msg())

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
        # SIGHUP: a closed terminal or ssh session; torchrun treats it as SIGTERM
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, self.handle_signal, sig)
        server = None
        try:
            if self.cfg.standalone:
                server = await _start_embedded_server()
                self.cfg.endpoint = f"127.0.0.1:{server[1]}"
            _, host, port = parse_endpoint(self.cfg.endpoint)
            try:
                await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except socket.gaierror as e:
                if e.errno != socket.EAI_AGAIN:  # a name that does not exist will not start to
                    print(f"rdzv-agent: error: server host {printable(host)!r} does not resolve: {e.strerror}",
                          file=sys.stderr, flush=True)
                    return EXIT_USAGE
            if not self.addr:
                self.addr = route_addr(host, port)
            self.link = AgentLink(self.cfg.endpoint, self.cfg.token, heartbeat_s=heartbeat_interval(self.cfg.spec()))
            await self.link.start()
            self._say("joining %s at %s (nnodes %d:%d, %d worker(s) here, address %s)", self.cfg.endpoint,
                      time.strftime("%H:%M:%S"), self.cfg.min_nodes, self.cfg.max_nodes, self.cfg.nproc, self.addr)
            self._join()
            return await self._loop()
        finally:
            if self.group is not None:
                await self.group.stop(self.cfg.stop_timeout_s)
            if self.link is not None:
                await self.link.close()
            if server is not None:
                await server[0].cleanup()
            if self._err_dir is not None:
                # our private error-file directory: its messages were read when workers ended
                shutil.rmtree(self._err_dir, ignore_errors=True)
            self.status.done()

    async def _loop(self) -> int:
        link = self.link
        recv = asyncio.ensure_future(link.recv())
        sig = asyncio.ensure_future(self.signals.get())
        workers: asyncio.Future | None = None
        workers_for: WorkerGroup | None = None
        try:
            while True:
                waits = [recv, sig] + ([workers] if workers else [])
                done, _ = await asyncio.wait(waits, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                if sig not in done:
                    code = await self._check_server()
                    if code is not None:
                        return code
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
                if self.group is not None and workers is None and self._group_running:
                    workers, workers_for = asyncio.ensure_future(self.group.wait()), self.group
        finally:
            for f in (recv, sig, workers):
                if f is not None:
                    f.cancel()


    async def _check_server(self) -> int | None:
        """Say that the server is unreachable where a person sees it (a log line
        when it starts, every OUTAGE_LOG_EVERY_S and when it ends, a countdown on
        the status line), and give up after --server-timeout."""
        link, cfg = self.link, self.cfg
        down = link.down_for()
        now = time.monotonic()
        if down < OUTAGE_NOTICE_AFTER_S:
            if down == 0 and self._outage_logged_at is not None:
                self._outage_logged_at = None
                self._say("server %s reachable again", cfg.endpoint)
            return None
        left = cfg.server_timeout_s - down
        why = printable(link.last_error or "no answer", limit=300)
        if left <= 0:
            self.status.done()
            print(f"[rdzv-agent] job {cfg.job_id}: giving up: server {cfg.endpoint} unreachable for "
                  f"{cfg.server_timeout_s:g}s (--server-timeout; {why})"
                  + ("; stopping workers" if self.group is not None else ""), file=sys.stderr, flush=True)
            await self._stop_workers()
            return EXIT_GAVE_UP
        notice = (f"server unreachable for {down:.0f}s at {cfg.endpoint} ({why})"
                  + ("; workers keep running" if self.group is not None else "")
                  + f"; giving up in {left:.0f}s")
        if self._outage_logged_at is None or now - self._outage_logged_at >= OUTAGE_LOG_EVERY_S:
            self._outage_logged_at = now
            self._say("%s", notice)
        self.status.show(f"[rdzv-agent] {notice}")
        return None

    def _check_assignment(self, a: Assignment) -> str | None:
        """What makes an assignment unusable by this node (the model checked
        the rest), or None."""
        if a.job_id != self.cfg.job_id:
            return f"assignment for job {a.job_id!r}, this node runs job {self.cfg.job_id!r}"
        if a.local_world_size != self.cfg.nproc:
            return f"assignment for {a.local_world_size} local worker(s), this node runs {self.cfg.nproc}"
        return None

    async def _on_message(self, msg) -> int | None:
        cfg = self.cfg
        if isinstance(msg, JoinedMsg):
            if msg.waiting_for:
                self._show_waiting(msg.round, msg.waiting_for)
        elif isinstance(msg, StatusMsg):
            self._show_waiting(msg.round, msg.waiting_for)
        elif isinstance(msg, SpareMsg):
            self.status.show(f"[rdzv-agent] job {cfg.job_id}: spare (the job is at max {cfg.max_nodes} nodes); "
                             "waiting to replace a node")
        elif isinstance(msg, AssignedMsg):
            a = msg.assignment
            problem = self._check_assignment(a)
            if problem is not None:
                self.link.protocol_error(f"round {a.round}: {problem}")
                return None
            if self.assignment is not None and self.assignment.round == a.round:
                # A reconnect re-sent this round's assignment: the workers run it, or
                # ran it and their outcome is reported (the report follows the resume).
                return None
            await self._start_workers(a)
        elif isinstance(msg, RestartMsg):
            self.link.clear_reports()
            if self.assignment is not None and msg.round <= self.assignment.round:
                return None
            self._say("round %d: %s; stopping workers and rejoining", msg.round, printable(_first_line(msg.reason)))
            await self._stop_workers()
            self._join()
        elif isinstance(msg, EvictedMsg):
            # Fencing: workers die before anything else, then this is a new node.
            if self.group is not None:
                self.group.kill_now()
                await self._stop_workers(timeout=1.0)
            self.link.clear_reports()  # they name the old node; the server forgot it
            self._say("evicted (%s); rejoining as a new node", printable(msg.reason))
            self.node_id = new_node_id(cfg.host)
            self._join()
        elif isinstance(msg, DoneMsg):
            self.link.clear_reports()
            await self._stop_workers()
            if msg.state == "succeeded":
                self._say("job succeeded")
                return 0
            self.status.done()
            text = f"[rdzv-agent] job {cfg.job_id} {msg.state}: {printable(msg.reason)}"
            if msg.root_cause and msg.root_cause not in msg.reason:
                text += f"\n[rdzv-agent] root cause: {printable(msg.root_cause)}"
            print(text, file=sys.stderr, flush=True)
            return EXIT_FAILED
        elif isinstance(msg, AckMsg):
            self.link.clear_reports()
            if msg.of == "succeeded":
                self._say("workers succeeded; done")
                return 0
        elif isinstance(msg, ErrorMsg):
            return await self._on_error(msg)
        elif isinstance(msg, RdzvError):  # from the link: e.g. the token was refused
            print(f"[rdzv-agent] error: {printable(msg.message)}", file=sys.stderr, flush=True)
            await self._stop_workers()
            return EXIT_USAGE
        return None

    async def _on_error(self, msg: ErrorMsg) -> int | None:
        if msg.code == ErrorCode.UNAVAILABLE:
            # the server could not save state: it drops us, we reconnect and re-send
            log.warning("server unavailable: %s", printable(msg.message))
            return None
        self.link.clear_reports()
        if msg.code in (ErrorCode.EVICTED, ErrorCode.NODE_SECRET_MISMATCH):
            # node_secret_mismatch: the server's node of this id is not ours (we never
            # got its secret, or it was lost and re-created): fence, then join as new
            return await self._on_message(EvictedMsg(reason=msg.message))
        if msg.code == ErrorCode.STALE_ROUND:
            if self._succeeded:
                return 0  # our success was recorded before the connection dropped
            if self.group is not None and self._group_running:
                # we resumed a round that is over: stop and join the next one
                self._say("%s; stopping workers and rejoining", printable(msg.message))
                await self._stop_workers()
                self._join()
            else:
                log.info("server: %s", printable(msg.message))
            return None
        if msg.code in FATAL_CODES:
            print(f"[rdzv-agent] error: the server refused this node: {printable(msg.message)}", file=sys.stderr,
                  flush=True)
            await self._stop_workers()
            return EXIT_USAGE
        log.warning("server error %s: %s", msg.code.value, printable(msg.message))
        return None


    def _show_waiting(self, round_no: int, info) -> None:
        self.status.show(f"[rdzv-agent] job {self.cfg.job_id} round {round_no}: {info.joined} joined "
                         f"(min {info.min_nodes}, max {info.max_nodes}, spares {info.spares}); "
                         f"{printable(info.text, limit=500)}")

    async def _start_workers(self, a: Assignment) -> None:
        cfg = self.cfg
        self.assignment = a
        self._say("round %d: group rank %d of %d, ranks %d-%d of world %d, master %s:%d, restart %d/%d",
                  a.round, a.group_rank, a.group_world_size, a.rank_offset, a.rank_offset + a.local_world_size - 1,
                  a.world_size, a.master_addr, a.master_port, a.restarts, a.max_restarts)
        if cfg.node_rank is not None and a.group_rank != cfg.node_rank:
            why = (f"this round has {a.group_world_size} node(s)" if cfg.node_rank >= a.group_world_size
                   else f"rank {cfg.node_rank} is held by another node")
            self._say("asked for node rank %d, got %d (%s)", cfg.node_rank, a.group_rank, why)
        base = dict(os.environ)
        err_root = cfg.log_dir or self._err_dir
        envs = []
        for lr in range(cfg.nproc):
            ef = error_file_path(err_root, a.round, lr)
            ef.parent.mkdir(parents=True, exist_ok=True)
            if ef.exists():
                ef.unlink()
            envs.append(worker_env(base, a, lr, cfg.job_id, str(ef)))
        launch = LaunchConfig(cmd=cfg.cmd, local_world_size=cfg.nproc, log_dir=cfg.log_dir, redirects=cfg.redirects,
                              tee=cfg.tee, local_ranks_filter=cfg.local_ranks_filter)
        self.group = WorkerGroup(launch, envs, attempt=a.round)
        try:
            await self.group.start()
        except OSError as e:
            self.group = None
            self._say("cannot start workers: %s", e)
            rec = ExitRecord(local_rank=0, rank=a.rank_offset, pid=0, exit_code=127,
                             message=f"cannot start {cfg.cmd[0]}: {e}", timestamp=time.time())
            self.link.report(FailedMsg(round=a.round, failures=[rec]))
            return
        self._group_running = True
        self.link.set_intent(self._join_msg(resume_round=a.round), send=False)

    async def _stop_workers(self, timeout: float | None = None, sig: int = signal.SIGTERM) -> None:
        group, self.group = self.group, None
        self._group_running = False
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
        if not self._group_running or a is None:
            return None
        self._group_running = False
        if all(i.ok for i in infos):
            await self._stop_workers()
            self._succeeded = True
            self._say("round %d: all %d worker(s) exited 0; reporting success", a.round, len(infos))
            self.link.report(SucceededMsg(round=a.round))
            return None
        failed = [i for i in infos if not i.ok]
        for i in failed:
            self._say("round %d: %s", a.round, describe(i, a.rank_offset + i.local_rank))
        await self._stop_workers()
        records = [ExitRecord(local_rank=i.local_rank, rank=a.rank_offset + i.local_rank, pid=i.pid,
                              exit_code=i.exit_code, signal=i.signal, message=i.message[:4000],
                              timestamp=i.timestamp) for i in failed]
        self.link.report(FailedMsg(round=a.round, failures=records))
        return None

    async def _on_signal(self, signum: int) -> int:
        name = signal.Signals(signum).name
        self._say("%s: stopping workers and leaving the job", name)
        if self.link is not None and self.link.connected.is_set():
            self.link.set_intent(None, send=False)
            self.link.report(LeaveMsg(reason=f"agent got {name}"))
        await self._stop_workers(sig=signum if signum in (signal.SIGTERM, signal.SIGINT) else signal.SIGTERM)
        await asyncio.sleep(0.05)  # let the leave frame go out before the socket closes
        return 128 + signum


def _first_line(text: str) -> str:
    """A reason's first line: failure reasons carry the worker's traceback."""
    lines = text.strip().splitlines() or [""]
    return lines[0] + (" [...]" if len(lines) > 1 else "")


def _host_label(host: str) -> str:
    clean = "".join(c if c.isalnum() or c in "._-" else "-" for c in host)[:255]
    return clean or "node"


async def _start_embedded_server():
    """--standalone: a memory-only server on a free localhost port, in-process."""
    from aiohttp import web

    from rdzv_server.app import Settings, create_app

    runner = web.AppRunner(create_app(Settings(data_dir=None)), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, port


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=os.environ.get("RDZV_LOG_LEVEL", "INFO"),
                        format="[rdzv-agent %(asctime)s] %(message)s", datefmt="%H:%M:%S", stream=sys.stderr)
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
    except UsageError as e:
        print(f"rdzv-agent: error: {e}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)
    code = asyncio.run(Agent(cfg).run())
    raise SystemExit(code)


if __name__ == "__main__":
    main()
