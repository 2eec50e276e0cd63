"""rdzv-agent's flags -> one :class:`AgentConfig` (the job's :class:`JobSpec` and
this node's launch settings), built once by :func:`config_from_args`.

Every torchrun spelling of a flag is accepted (``--rdzv-endpoint`` and
``--rdzv_endpoint``, ``--nproc_per_node``, ...), and torchrun's ``PET_*``
variables (as Kubernetes operators set them) give the defaults; see
tests/unit/test_config.py for the full list.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rdzv_common import __version__, logs
from rdzv_common.help_format import HelpFormatter as _HelpFormatter
from rdzv_common.spec_table import FIELDS
from rdzv_common.wire import HOST_PATTERN, is_valid_id, job_secret_problem

from . import help_groups, secret_source
from .endpoints import parse_endpoints
from .launch import Std, parse_std
from .service import DEFAULT_SERVER_TIMEOUT_S as DEFAULT_SERVER_TIMEOUT_S  # re-exported: the agent's name
from .service import never_reached_s
from .session import new_run_default
from .spec_flags import add_spec_flags, conf_spec, spec_from_args
from .torchrun_flags import SPEC_CONF_KEYS, add_torchrun_flags, pet, pet_flag, torchrun_notes

if TYPE_CHECKING:
    from rdzv_common.protocol import JobSpec

DEFAULT_STOP_TIMEOUT_S = 10.0
# torchrun's --signals-to-handle default; the agent always handles SIGINT, SIGTERM and SIGHUP
DEFAULT_SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
ALWAYS_HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class UsageError(Exception):
    """Bad flags or environment: print one line, exit 2."""


# ------------------------------------------------------------------ settings


@dataclass
class AgentConfig:
    endpoint: str
    job_id: str
    nproc: int
    cmd: list[str]
    # the job spec, checked once (spec_flags.spec_from_args): the plain JSON object of a join, every field of
    # the table (rdzv_common.spec_table); read as attributes too: cfg.min_nodes, cfg.hang_timeout_s, ...
    spec_values: dict[str, Any]
    node_rank: int | None = None
    local_addr: str | None = None
    token: str | None = None
    job_secret: str | None = field(default=None, repr=False)
    log_dir: Path | None = None
    redirects: dict[int, Std] | Std = Std.NONE
    tee: dict[int, Std] | Std = Std.NONE
    local_ranks_filter: set[int] | None = None
    line_prefix: bool = False  # worker output through the agent, "[RANK]: " on each line
    stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S
    server_timeout_s: float = DEFAULT_SERVER_TIMEOUT_S
    standalone: bool = False
    host: str = field(default_factory=socket.gethostname)
    health_check: str | None = None  # shell command run before every join; non-zero: this round is skipped
    health_check_timeout_s: float = 60.0
    role: str = "default"  # the workers' ROLE_NAME (torchrun's --role)
    signals_to_handle: str = DEFAULT_SIGNALS_TO_HANDLE  # as given; the workers' TORCHELASTIC_SIGNALS_TO_HANDLE
    signals: tuple[int, ...] = ALWAYS_HANDLED  # what the agent handles: stop workers, leave, exit 128+N
    virtual_local_rank: bool = False  # LOCAL_RANK=0, CUDA_VISIBLE_DEVICES one GPU (torchrun's --virtual-local-rank)
    notes: list[str] = field(default_factory=list)  # one line each: a torchrun flag that rdzv does differently
    new_run: bool = True  # False (--no-new-run): never start the next run of a finished job id

    def __getattr__(self, name: str) -> Any:
        """A spec field by name (``cfg.hang_timeout_s``), from ``spec_values``: the table names them once."""
        values = self.__dict__.get("spec_values")
        if values is not None and name in FIELDS:
            return values[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def spec_fields(self) -> dict[str, Any]:
        """The job spec as the plain JSON object of a join (no pydantic: the agent's start-up path)."""
        return dict(self.spec_values)

    def spec(self) -> JobSpec:
        from rdzv_common.protocol import JobSpec

        return JobSpec(**self.spec_values)


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
    a(
        "--endpoint",
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        dest="endpoint",
        default=os.environ.get("RDZV_ENDPOINT") or pet("rdzv_endpoint"),
        help="rdzv-server HOST:PORT, or a comma-separated list of them: the replicas of an HA server ($RDZV_ENDPOINT)",
    )
    a(
        "--job-id",
        "--rdzv-id",
        "--rdzv_id",
        "--run-id",
        dest="job_id",
        default=pet("rdzv_id") or os.environ.get("SLURM_JOB_ID"),
        help="job id (default: $SLURM_JOB_ID under SLURM)",
    )
    a("--nnodes", default=pet("nnodes", "1"), help="N or MIN:MAX nodes")
    a(
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc_per_node",
        default=pet("nproc_per_node", "1"),
        help="workers on this node: N, gpu (one per GPU), xpu (one per XPU), cpu (one per core), "
        "auto (gpu if any, else cpu)",
    )
    a(
        "--node-rank",
        "--node_rank",
        dest="node_rank",
        type=int,
        default=pet("node_rank"),
        help="ask for this group rank (honoured when free and smaller than the number of nodes)",
    )
    a(
        "--local-addr",
        "--local_addr",
        dest="local_addr",
        default=pet("local_addr"),
        help="address other nodes reach this one at (default: the one that reaches the server)",
    )
    a("--token", default=None, help="bearer token for the server (default: $RDZV_TOKEN)")
    a(
        "--job-secret",
        dest="job_secret",
        default=None,
        help="the job's secret (16-256 printable ASCII characters): the first node sets it, every other node "
        "and the job id's next run must bring the same "
        "(default: $RDZV_JOB_SECRET; every user sees the flag in ps: prefer --job-secret-file)",
    )
    a(
        "--job-secret-file",
        dest="job_secret_file",
        default=None,
        metavar="PATH",
        help="read the job secret from this file's first line (default: $RDZV_JOB_SECRET_FILE)",
    )
    a(
        "--no-new-run",
        dest="new_run",
        action="store_false",
        default=None,  # neither flag: --rdzv-conf new_run=, else session.new_run_default()
        help="if the job id's run has ended, exit 2 (job finished) instead of starting its next run: "
        "for agents a scheduler may restart (default: $RDZV_NO_NEW_RUN, else on under Kubernetes)",
    )
    a(
        "--new-run",
        dest="new_run",
        action="store_true",
        help="start the next run of an ended job id (default: off Kubernetes; see --no-new-run)",
    )
    a(
        "--log-dir",
        "--log_dir",
        dest="log_dir",
        default=pet("log_dir"),
        help="keep worker error files, and the logs --redirects/--tee ask for, as torchrun: DIR/JOB_RANDOM/"
        "attempt_ROUND/LOCAL_RANK/{error.json,stdout.log,stderr.log} (one run directory per agent)",
    )
    a(
        "--redirects",
        "-r",
        default=pet("redirects", "0"),
        help="send worker output to log files only: 0 none, 1 stdout, 2 stderr, 3 both; or 0:3,1:0 per rank",
    )
    a("--tee", "-t", default=pet("tee", "0"), help="copy worker output to log files too (values as --redirects)")
    a(
        "--local-ranks-filter",
        "--local_ranks_filter",
        dest="local_ranks_filter",
        default=pet("local_ranks_filter", ""),
        help="show only these local ranks on the console, e.g. 0 or 0,2",
    )
    a(
        "--line-prefix",
        dest="line_prefix",
        action="store_true",
        help="copy worker output through the agent with '[RANK]: ' before each line (as --tee does); "
        "default: workers write to the agent's stdout and stderr, a terminal stays a terminal, as under "
        "torchrun",
    )
    a(
        "--standalone",
        action="store_true",
        default=pet_flag("standalone"),
        help="single node: run an embedded server on a free localhost port",
    )
    a(
        "-m",
        "--module",
        action="store_true",
        default=pet_flag("module"),
        help="run the script as a python module (python -m)",
    )
    a(
        "--no-python",
        "--no_python",
        dest="no_python",
        action="store_true",
        default=pet_flag("no_python"),
        help="run the script as an executable, not with python",
    )
    a(
        "--stop-timeout",
        "--shutdown-timeout",
        "--shutdown_timeout",
        dest="stop_timeout",
        type=float,
        default=pet("shutdown_timeout", os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", DEFAULT_STOP_TIMEOUT_S)),
        help="seconds workers get between SIGTERM and SIGKILL, as torchrun's --shutdown-timeout (30 there) "
        f"(default: {DEFAULT_STOP_TIMEOUT_S:g}, or $TORCH_ELASTIC_SHUTDOWN_TIMEOUT)",
    )
    a(
        "--server-timeout",
        type=float,
        default=os.environ.get("RDZV_SERVER_TIMEOUT", DEFAULT_SERVER_TIMEOUT_S),
        help="give up (stop workers, exit 3) when the server has been unreachable this many seconds "
        f"(default: {DEFAULT_SERVER_TIMEOUT_S:g}, or $RDZV_SERVER_TIMEOUT)",
    )
    a(
        "--host-name",
        dest="host_name",
        default=os.environ.get("RDZV_HOST_NAME") or None,
        help="the name the server keeps this host's record under: failures, cool-downs, cordons "
        "(default: $RDZV_HOST_NAME or the host name)",
    )
    a(
        "--health-check",
        dest="health_check",
        default=os.environ.get("RDZV_HEALTH_CHECK") or None,
        metavar="CMD",
        help="shell command run before every join (e.g. 'python -m rdzv_client.health'); a non-zero exit or a "
        "timeout keeps this node out of the round, its last line goes to the server's host record, and the "
        "check is retried with backoff ($RDZV_HEALTH_CHECK)",
    )
    a(
        "--health-check-timeout",
        dest="health_check_timeout",
        type=float,
        default=60.0,
        help="seconds the health check may run",
    )
    a(
        "--log-format",
        dest="log_format",
        default=logs.default_format(),
        choices=logs.FORMATS,
        help="text: for people; json: every line the agent writes to stderr is one object (time, level, job, "
        "round, node, event, message); workers' output is not touched (default: $RDZV_LOG_FORMAT or text)",
    )
    a(
        "--rdzv-conf",
        "--rdzv_conf",
        default=pet("rdzv_conf", ""),
        help=f"torchrun's key=value,... ({', '.join(SPEC_CONF_KEYS)}; other keys are named in a note)",
    )
    a("--role", default=pet("role", "default"), help="the workers' ROLE_NAME, as torchrun's --role")
    a(
        "--signals-to-handle",
        "--signals_to_handle",
        dest="signals_to_handle",
        default=pet("signals_to_handle", DEFAULT_SIGNALS_TO_HANDLE),
        help="signals that stop the workers and leave the job, exit 128+N (SIGINT, SIGTERM, SIGHUP always); "
        "the workers see the list in TORCHELASTIC_SIGNALS_TO_HANDLE, as under torchrun",
    )
    a(
        "--virtual-local-rank",
        "--virtual_local_rank",
        dest="virtual_local_rank",
        action="store_true",
        default=pet_flag("virtual_local_rank"),
        help="every worker gets LOCAL_RANK=0 and CUDA_VISIBLE_DEVICES set to its own GPU, as torchrun's",
    )
    a(
        "--run-path",
        "--run_path",
        dest="run_path",
        action="store_true",
        default=pet_flag("run_path"),
        help="run the script with python, as torchrun's runpy.run_path (overrides --no-python)",
    )
    add_spec_flags(p)  # the job spec's flags, from the table
    add_torchrun_flags(p)
    a("script", help="training script (or module with -m, or executable with --no-python)")
    a("script_args", nargs=argparse.REMAINDER, help="its arguments")
    help_groups.arrange(p)  # essentials first, then one group per concern
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
    if value == "xpu":
        try:
            import torch

            xpus = torch.xpu.device_count() if torch.xpu.is_available() else 0
        except (ImportError, AttributeError):
            xpus = 0
        if not xpus:
            raise UsageError("--nproc-per-node xpu: no XPU found on this node")
        return int(xpus)
    if value in ("gpu", "auto"):
        try:
            import torch

            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        except ImportError:
            gpus = 0
        if gpus:
            return gpus
        if value == "gpu":
            raise UsageError("--nproc-per-node gpu: no CUDA GPU found on this node")
        return os.cpu_count() or 1
    raise UsageError(f"--nproc-per-node {value!r}: expected N, gpu, xpu, cpu or auto")


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
            "run it with srun --ntasks-per-node=1"
        )


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
        spec_conf = conf_spec(lambda key: conf.pop(key, None), plugin=False)  # over the flags
    except ValueError as e:
        raise UsageError(f"--rdzv-conf: {e}") from None
    # as the torchrun plugin reads them: job_id= over --job-id, server= over --endpoint, new_run=0 as --no-new-run
    conf_job_id = conf.pop("job_id", "")
    conf_server = conf.pop("server", "")
    try:
        never_reached_s()  # $RDZV_NEVER_REACHED_TIMEOUT, checked now, not when the link first fails
    except ValueError as e:
        raise UsageError(str(e)) from None
    new_run = new_run_default() if args.new_run is None else bool(args.new_run)
    if "new_run" in conf:
        flag = conf.pop("new_run")
        if flag.lower() not in ("0", "1", "false", "true", "no", "yes"):
            raise UsageError(f"--rdzv-conf new_run={flag[:40]!r}: use 0 or 1")
        # a flag's "no" stays no; otherwise the key says
        new_run = args.new_run is not False and flag.lower() in ("1", "true", "yes")
    if args.rdzv_backend not in (None, "rdzv", "c10d", "static"):
        raise UsageError(f"--rdzv-backend {args.rdzv_backend!r}: rdzv-agent always uses an rdzv server")
    notes = torchrun_notes(args, conf)
    signals = parse_signals(str(args.signals_to_handle))
    standalone = args.standalone
    endpoint = conf_server or args.endpoint
    if standalone:
        min_nodes = max_nodes = 1
        endpoint = "127.0.0.1:29400"  # replaced by the embedded server's free port
    elif not endpoint:
        raise UsageError("no server: pass --endpoint HOST:PORT (or set RDZV_ENDPOINT), or use --standalone")
    try:
        parse_endpoints(endpoint)  # HOST:PORT, or a list of them (HA replicas)
    except ValueError as e:
        raise UsageError(str(e)) from None
    job_id = conf_job_id or args.job_id or ("standalone" if standalone else None)
    if not job_id:
        raise UsageError("no job id: pass --job-id (torchrun: --rdzv-id), or run under SLURM")
    if not is_valid_id(job_id):
        raise UsageError(f"--job-id {job_id!r}: use 1-128 characters of letters, digits and ._:@+-")
    nproc = count_procs(str(args.nproc_per_node))
    if args.module and args.no_python and not args.run_path:
        raise UsageError("-m and --no-python do not go together")
    if args.run_path:  # torchrun: runpy.run_path in its worker process, before --no-python and -m
        cmd = [sys.executable, "-u", args.script, *args.script_args]
    elif args.no_python:
        cmd = [args.script, *args.script_args]
    elif args.module:
        cmd = [sys.executable, "-u", "-m", args.script, *args.script_args]
    else:
        cmd = [sys.executable, "-u", args.script, *args.script_args]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if args.virtual_local_rank and visible is not None and len(visible.split(",")) < nproc:
        raise UsageError(
            f"--virtual-local-rank with {nproc} workers: CUDA_VISIBLE_DEVICES={visible!r} names fewer GPUs"
        )
    log_dir = Path(args.log_dir) if args.log_dir else None
    try:
        redirects = parse_std(str(args.redirects), nproc)
        tee = parse_std(str(args.tee), nproc)
        ranks_filter = {int(x) for x in str(args.local_ranks_filter).split(",") if x.strip()} or None
    except ValueError as e:
        raise UsageError(str(e)) from None
    node_rank = int(args.node_rank) if args.node_rank is not None else None
    try:
        flags = ("--job-secret", "--job-secret-file")
        job_secret = secret_source.job_secret(args.job_secret, args.job_secret_file, *flags)
    except secret_source.SecretSourceError as e:
        raise UsageError(str(e)) from None
    if job_secret is not None and (why := job_secret_problem(job_secret)):
        raise UsageError(f"the job secret (--job-secret, --job-secret-file or RDZV_JOB_SECRET) {why}")
    try:
        spec = spec_from_args(args, spec_conf, min_nodes=min_nodes, max_nodes=max_nodes)
    except ValueError as e:
        raise UsageError(f"bad job settings: {e}") from None
    try:
        server_timeout = float(args.server_timeout)
    except ValueError:
        raise UsageError(f"--server-timeout {args.server_timeout!r}: expected seconds") from None
    if not 0 < server_timeout < float("inf"):
        raise UsageError(f"--server-timeout {args.server_timeout!r}: must be a positive number of seconds")
    return AgentConfig(
        endpoint=endpoint,
        job_id=job_id,
        nproc=nproc,
        cmd=cmd,
        spec_values=spec,
        node_rank=node_rank,
        local_addr=args.local_addr,
        token=args.token or os.environ.get("RDZV_TOKEN") or None,
        job_secret=job_secret,
        log_dir=log_dir,
        redirects=redirects,
        tee=tee,
        local_ranks_filter=ranks_filter,
        line_prefix=args.line_prefix,
        stop_timeout_s=args.stop_timeout,
        server_timeout_s=server_timeout,
        standalone=standalone,
        role=_role(str(args.role)),
        signals_to_handle=str(args.signals_to_handle),
        signals=signals,
        virtual_local_rank=bool(args.virtual_local_rank),
        notes=notes,
        new_run=new_run,
        **_host_options(args),
    )


def _role(role: str) -> str:
    if not 1 <= len(role) <= 128 or not role.isprintable():
        raise UsageError(f"--role {role!r}: use 1-128 printable characters")
    return role


def parse_signals(text: str) -> tuple[int, ...]:
    """--signals-to-handle: torchrun's comma-separated signal names (SIGUSR1 or
    USR1); the agent handles those and, always, SIGINT, SIGTERM and SIGHUP."""
    out = list(ALWAYS_HANDLED)
    for item in filter(None, (x.strip() for x in text.split(","))):
        name = item.upper() if item.upper().startswith("SIG") else "SIG" + item.upper()
        try:
            sig = signal.Signals[name]
        except KeyError:
            raise UsageError(f"--signals-to-handle: {item!r} is not a signal name (e.g. SIGTERM,SIGUSR1)") from None
        if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            raise UsageError(f"--signals-to-handle: {name} cannot be handled")
        if sig not in out:
            out.append(sig)
    return tuple(int(x) for x in out)


def _host_options(args: argparse.Namespace) -> dict[str, Any]:
    """--host-name, --health-check, --health-check-timeout, checked."""
    out: dict[str, Any] = {}
    name = getattr(args, "host_name", None)
    if name is not None:
        if not re.fullmatch(HOST_PATTERN, name) or len(name) > 255:
            raise UsageError(f"--host-name {name!r}: use 1-255 characters of letters, digits and ._:[]%-")
        out["host"] = name
    if getattr(args, "health_check", None):
        out["health_check"] = args.health_check
    timeout = float(getattr(args, "health_check_timeout", 60.0))
    if not 0 < timeout <= 3600:
        raise UsageError(f"--health-check-timeout {timeout!r}: must be in (0, 3600] seconds")
    out["health_check_timeout_s"] = timeout
    return out
