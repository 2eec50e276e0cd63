"""rdzv-server's command line: the flags, their parsing and checks, and the
:class:`~rdzv_server.app.Settings` they make (``rdzv_server.__main__`` runs
the server with them). A command line the server refuses is a
:class:`UsageError` (exit 2, one line)."""

from __future__ import annotations

import argparse
import asyncio
import os
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import cast

from rdzv_common import __version__, help_format, logs
from rdzv_common.durations import parse_duration

from .app import DEFAULT_IDLE_TIMEOUT_S, DEFAULT_JOIN_DEADLINE_S, MIN_IDLE_TIMEOUT_S, Settings
from .auth import is_loopback, token_problem
from .conns import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS_PER_ADDRESS,
)
from .ha import DEFAULT_LEASE_TTL_S, DEFAULT_PREFIX, HASettings
from .hosts import DEFAULT_HOST_FAILURES, HostRules
from .quotas import DEFAULT_WAITING_JOBS_PER_ADDRESS
from .store_settings import DEFAULT_DISCONNECT_GRACE_S, DEFAULT_MAX_WAITING_JOBS


def default_data_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "rdzv"


_UNITS_B = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
}


def parse_size(text: str) -> int:
    """``0``, ``65536``, ``64MiB``, ``1G`` -> bytes."""
    t = text.strip().lower()
    num = t.rstrip("kmgib")
    unit = t[len(num) :]
    try:
        value = float(num) * _UNITS_B[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 0, 65536, 64MiB, 1G)") from None
    if not 0 <= value <= 2**60:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range")
    return int(value)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 10_000_000:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from 1 to 10000000")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 1000:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from 0 to 1000")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rdzv-server",
        description="Rendezvous server for elastic PyTorch training (see rdzv-agent).",
        formatter_class=help_format.HelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"rdzv-server {__version__}")
    p.add_argument(
        "--host",
        default=argparse.SUPPRESS,
        help="address to listen on (default: 0.0.0.0 with a token, 127.0.0.1 without; "
        "a non-loopback address without a token needs --insecure)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback --host without a token: anyone who can reach the port "
        "can join, close or take over any job",
    )
    p.add_argument("--port", type=int, default=29400, help="port to listen on (0: any free port)")
    p.add_argument(
        "--data-dir",
        default=None,
        help="where job state is kept (SQLite); 'none' keeps state in memory only "
        f"(default: $XDG_STATE_HOME/rdzv, here {default_data_dir()})",
    )
    p.add_argument(
        "--token",
        default=None,
        help="bearer token required on every request but /healthz, at least 16 characters (default: $RDZV_TOKEN)",
    )
    p.add_argument(
        "--operator-token",
        default=None,
        help="a second token that alone may close, delete, cordon and uncordon (the --token then only joins, "
        "reads and reports health); without it the token is every role (default: $RDZV_OPERATOR_TOKEN)",
    )
    p.add_argument("--tls-cert", default=None, help="PEM certificate: serve HTTPS")
    p.add_argument("--tls-key", default=None, help="PEM private key for --tls-cert")
    p.add_argument(
        "--disconnect-grace",
        type=float,
        default=DEFAULT_DISCONNECT_GRACE_S,
        help="seconds a node whose connection dropped has to reconnect before it is lost",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        help="seconds a client has to send a request line and headers (after connecting, or "
        "after the previous response); then the connection is closed",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT_S,
        help="seconds a client has to send a request's whole body; then it gets 408 and the connection is closed",
    )
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=DEFAULT_IDLE_TIMEOUT_S,
        help="seconds a joined agent WebSocket may send nothing (agents send a heartbeat every 2 s at most; "
        f"at least {MIN_IDLE_TIMEOUT_S:g}); then it is closed, whatever its job's heartbeat timeout",
    )
    p.add_argument(
        "--join-deadline",
        type=float,
        default=DEFAULT_JOIN_DEADLINE_S,
        help="seconds a new agent WebSocket has to send its join; then it is closed",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="open connections at most (lowered to fit the file-descriptor limit); "
        "new ones beyond it are closed at once",
    )
    p.add_argument(
        "--max-connections-per-address",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS_PER_ADDRESS,
        metavar="N",
        help="open connections one client address may hold, at most half of --max-connections "
        "(0: no limit of its own, e.g. for agents behind one NAT address)",
    )
    p.add_argument(
        "--retain-finished",
        type=parse_duration,
        default="7d",
        metavar="DURATION",
        help="finished jobs (succeeded, failed, closed) older than this are removed from memory, "
        "disk and /metrics (e.g. 90s, 30m, 12h, 7d)",
    )
    p.add_argument(
        "--max-waiting-jobs",
        type=_positive_int,
        default=DEFAULT_MAX_WAITING_JOBS,
        metavar="N",
        help="at most this many jobs wait for nodes; beyond it a waiting job no connected node holds "
        "is closed to make room, and if every one is held a new job is refused (its agents retry)",
    )
    p.add_argument(
        "--max-waiting-jobs-per-address",
        type=int,
        default=DEFAULT_WAITING_JOBS_PER_ADDRESS,
        metavar="N",
        help="waiting jobs (held by a connected node) one client address may create; beyond it its new "
        "jobs are refused (0: no limit of its own)",
    )
    p.add_argument(
        "--min-free-disk",
        type=parse_size,
        default="64MiB",
        metavar="SIZE",
        help="refuse new jobs while the data dir's file system has less free space than this "
        "(running jobs carry on); 0 disables the check",
    )
    p.add_argument(
        "--host-failures",
        type=_count,
        default=DEFAULT_HOST_FAILURES,
        metavar="K",
        help="a host with K failures (worker failures of the root-cause node on it, evictions for "
        "silence, failed health checks) within --host-failure-window is cooled down: its joins "
        "wait as spares, told why (0: never)",
    )
    p.add_argument(
        "--host-failure-window",
        type=parse_duration,
        default="10m",
        metavar="DURATION",
        help="how far back a host's failures count towards --host-failures",
    )
    p.add_argument(
        "--host-cooldown",
        type=parse_duration,
        default="1m",
        metavar="DURATION",
        help="the first cool-down; each next one of the same host doubles, up to --host-cooldown-max",
    )
    p.add_argument(
        "--host-cooldown-max",
        type=parse_duration,
        default="30m",
        metavar="DURATION",
        help="the longest cool-down (the doubling stops there)",
    )
    ha = p.add_argument_group(
        "high availability (etcd v3)",
        "several rdzv-server replicas against one etcd cluster; one leads, the others answer not_leader "
        "naming it (agents, the plugin and the CLI take a comma-separated list of the replicas)",
    )
    ha.add_argument(
        "--etcd",
        default=None,
        metavar="URL[,URL...]",
        help="keep job and host state in etcd (v3, its JSON gateway) instead of SQLite, and run as an HA "
        "replica; e.g. http://etcd-0:2379,http://etcd-1:2379,http://etcd-2:2379 (not with --data-dir)",
    )
    ha.add_argument("--etcd-prefix", default=DEFAULT_PREFIX, help="the keys' prefix in etcd (one per rdzv deployment)")
    ha.add_argument(
        "--advertise-url",
        default=None,
        metavar="URL",
        help="how agents reach this replica itself (not a load balancer), e.g. http://rdzv-0.rdzv:29400; "
        "followers name the leader by it and probe it to replace a dead leader at once "
        "(default: http(s)://HOST:PORT when --host is a concrete address)",
    )
    ha.add_argument(
        "--etcd-lease-ttl",
        type=int,
        default=DEFAULT_LEASE_TTL_S,
        metavar="SECONDS",
        help="the leader's lease: a dead leader is replaced about this long after it died; a leader that "
        "cannot renew it stops serving before it expires (2..60)",
    )
    ha.add_argument("--etcd-cacert", default=None, metavar="FILE", help="PEM CA bundle to verify etcd's certificate")
    ha.add_argument("--etcd-cert", default=None, metavar="FILE", help="PEM client certificate for etcd")
    ha.add_argument("--etcd-key", default=None, metavar="FILE", help="PEM private key for --etcd-cert")
    ha.add_argument(
        "--etcd-user",
        default=None,
        help="etcd user (auth enabled); the password comes from $RDZV_ETCD_PASSWORD or --etcd-password-file",
    )
    ha.add_argument("--etcd-password-file", default=None, metavar="FILE", help="a file holding the etcd password")
    p.add_argument(
        "--log-level",
        default=os.environ.get("RDZV_LOG_LEVEL", "INFO"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="the least severe lines logged (default: $RDZV_LOG_LEVEL or INFO)",
    )
    p.add_argument(
        "--log-format",
        default=logs.default_format(),
        choices=logs.FORMATS,
        help="text: for people; json: one object per line (time, level, job, round, node, event, message) "
        "for log pipelines (default: $RDZV_LOG_FORMAT or text)",
    )
    p.add_argument(
        "--event-loop",
        default="auto",
        choices=LOOPS,
        help="the event loop the server runs on: uvloop (libuv; about a quarter less CPU per agent message "
        "at 16,384 nodes), asyncio (the standard library's), or auto: uvloop where it is installed (it is a "
        "dependency on Linux and macOS)",
    )
    help_format.arrange(p, help_format.GROUPS)  # essentials first, then one group per concern
    return p


LOOPS = ("auto", "uvloop", "asyncio")


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The ``--event-loop``'s factory (None: asyncio's own); uvloop asked for and
    not installed is a UsageError."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise UsageError("--event-loop uvloop: uvloop is not installed (pip install uvloop)") from None
        return None
    return cast("Callable[[], asyncio.AbstractEventLoop]", uvloop.new_event_loop)


def _etcd_url(text: str) -> str:
    url = text.strip().rstrip("/")
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("http", "https") or not rest or "/" in rest:
        raise UsageError(f"--etcd: {text.strip()!r} is not an etcd client URL (http(s)://host:port)")
    return url


def ha_settings(args: argparse.Namespace, host: str, port: int, tls: bool) -> HASettings | None:
    """--etcd and its options, checked (UsageError), or None without --etcd."""
    if args.etcd is None:
        for flag in ("advertise_url", "etcd_cacert", "etcd_cert", "etcd_key", "etcd_user", "etcd_password_file"):
            if getattr(args, flag) is not None:
                raise UsageError(f"--{flag.replace('_', '-')} needs --etcd")
        return None
    if args.data_dir is not None:
        raise UsageError("--data-dir and --etcd exclude each other: with --etcd the state lives in etcd")
    endpoints = list(dict.fromkeys(_etcd_url(u) for u in args.etcd.split(",") if u.strip()))
    if not endpoints or len(endpoints) > 16:
        raise UsageError("--etcd takes 1 to 16 comma-separated etcd client URLs")
    if not 2 <= args.etcd_lease_ttl <= 60:
        raise UsageError("--etcd-lease-ttl must be 2..60 seconds (etcd raises a shorter one to its minimum)")
    prefix = args.etcd_prefix
    if not prefix or not prefix.isprintable() or len(prefix) > 200:
        raise UsageError("--etcd-prefix must be 1-200 printable characters")
    prefix = prefix if prefix.endswith("/") else prefix + "/"
    advertise = args.advertise_url
    if advertise is None:
        if host in ("0.0.0.0", "::", "") or port == 0:
            raise UsageError("--etcd needs --advertise-url (how agents reach this replica) with this --host/--port")
        advertise = f"{'https' if tls else 'http'}://{'[' + host + ']' if ':' in host else host}:{port}"
    advertise = advertise.strip().rstrip("/")
    a_scheme, sep, a_rest = advertise.partition("://")
    if not sep or a_scheme not in ("http", "https") or not a_rest or "/" in a_rest or len(advertise) > 512:
        raise UsageError(f"--advertise-url {advertise!r} is not http(s)://host:port")
    ctx = None
    if any(u.startswith("https://") for u in endpoints) or args.etcd_cacert or args.etcd_cert:
        try:
            ctx = ssl.create_default_context(cafile=args.etcd_cacert)
            if args.etcd_cert or args.etcd_key:
                if not (args.etcd_cert and args.etcd_key):
                    raise UsageError("--etcd-cert and --etcd-key go together")
                ctx.load_cert_chain(args.etcd_cert, args.etcd_key)
        except (OSError, ssl.SSLError) as e:
            raise UsageError(f"cannot load etcd TLS files: {e}") from None
    password = None
    if args.etcd_user is not None:
        if args.etcd_password_file is not None:
            try:
                password = Path(args.etcd_password_file).read_text().rstrip("\r\n")
            except OSError as e:
                raise UsageError(f"--etcd-password-file: {e.strerror or e}") from None
        else:
            password = os.environ.get("RDZV_ETCD_PASSWORD")
        if not password:
            raise UsageError("--etcd-user needs a password: $RDZV_ETCD_PASSWORD or --etcd-password-file")
    elif args.etcd_password_file is not None:
        raise UsageError("--etcd-password-file needs --etcd-user")
    return HASettings(
        endpoints=endpoints,
        advertise_url=advertise,
        prefix=prefix,
        lease_ttl_s=args.etcd_lease_ttl,
        ssl_ctx=ctx,
        user=args.etcd_user,
        password=password,
    )


def settings_from_args(args: argparse.Namespace) -> Settings:
    if getattr(args, "etcd", None) is not None:
        data_dir: Path | None = None
    elif args.data_dir is None:
        data_dir = default_data_dir()
    elif args.data_dir.lower() in ("none", ":memory:"):
        data_dir = None
    else:
        data_dir = Path(args.data_dir)
    token = args.token if args.token is not None else os.environ.get("RDZV_TOKEN") or None
    operator = args.operator_token if args.operator_token is not None else os.environ.get("RDZV_OPERATOR_TOKEN") or None
    for flag, value in (("--token", token), ("--operator-token", operator)):
        if problem := token_problem(flag, value):
            raise UsageError(problem)
    if operator is not None and (token is None or operator == token):
        raise UsageError("--operator-token needs a --token (for agents and readers) that differs from it")
    if not 0 < args.disconnect_grace <= 60:
        raise SystemExit("rdzv-server: --disconnect-grace must be in (0, 60] seconds")
    if not 0 < args.join_deadline <= 3600:
        raise SystemExit("rdzv-server: --join-deadline must be in (0, 3600] seconds")
    if not MIN_IDLE_TIMEOUT_S <= args.idle_timeout <= 86400:  # agents heartbeat every 2 s at most
        raise SystemExit(f"rdzv-server: --idle-timeout must be in [{MIN_IDLE_TIMEOUT_S:g}, 86400] seconds")
    if not 0 < args.body_timeout <= 3600:
        raise SystemExit("rdzv-server: --body-timeout must be in (0, 3600] seconds")
    if args.max_waiting_jobs_per_address < 0:
        raise SystemExit("rdzv-server: --max-waiting-jobs-per-address must be 0 (no limit) or more")
    return Settings(
        data_dir=data_dir,
        token=token,
        operator_token=operator,
        disconnect_grace_s=args.disconnect_grace,
        join_deadline_s=args.join_deadline,
        retain_finished_s=args.retain_finished,
        max_waiting_jobs=args.max_waiting_jobs,
        waiting_jobs_per_address=args.max_waiting_jobs_per_address,
        idle_timeout_s=args.idle_timeout,
        body_timeout_s=args.body_timeout,
        min_free_disk=args.min_free_disk,
        host_rules=HostRules(
            failures=args.host_failures,
            window_s=args.host_failure_window,
            cooldown_s=args.host_cooldown,
            cooldown_max_s=max(args.host_cooldown, args.host_cooldown_max),
        ),
    )


class UsageError(Exception):
    """A command line the server refuses to run (exit 2)."""


def bind_host(host: str | None, token: str | None, insecure: bool) -> str:
    """Where to listen. Without a token: loopback by default, and a
    non-loopback address only with ``insecure``."""
    if host is None:
        return "0.0.0.0" if token else "127.0.0.1"
    if token or insecure or is_loopback(host):
        return host
    raise UsageError(
        f"refusing to listen on {host or '(all addresses)'} without a token: anyone who can reach it "
        "could join, close or take over any job; set --token (or $RDZV_TOKEN), or pass --insecure "
        "to accept that risk"
    )
