"""torchrun's side of rdzv-agent's command line: its ``PET_*`` variables (as
Kubernetes operators set them), and its flags that rdzv does differently,
accepted so that a command line copied from torchrun runs, each one given
named in a one-line note at start that says what rdzv does instead."""

from __future__ import annotations

import argparse
import os
from typing import TypeVar, overload

from rdzv_common.spec_table import SPEC_FIELDS

# --rdzv-conf keys rdzv-agent reads: the spec's that the table marks (torchrun's own), and its own;
# every other key is named in a note
SPEC_CONF_KEYS = tuple(sorted(f.conf for f in SPEC_FIELDS if f.agent_conf and f.conf))
RDZV_CONF_KEYS = (*SPEC_CONF_KEYS, "new_run", "job_id", "server")

_T = TypeVar("_T")


@overload
def pet(name: str) -> str | None: ...
@overload
def pet(name: str, default: _T) -> str | _T: ...
def pet(name: str, default: object = None) -> object:
    """torchrun's PET_* variables (as Kubernetes operators set them), then ours."""
    return os.environ.get("PET_" + name.upper().replace("-", "_"), default)


def pet_flag(name: str) -> bool:
    """A torchrun switch's PET_* variable (its check_env): set and not 0."""
    return (pet(name) or "0").strip() not in ("", "0")


def add_torchrun_flags(p: argparse.ArgumentParser) -> None:
    """torchrun's flags that rdzv does differently, in a group of their own."""
    t = p.add_argument_group("torchrun's flags that rdzv does differently (accepted; each prints a one-line note)")
    t.add_argument(
        "--rdzv-backend",
        "--rdzv_backend",
        default=pet("rdzv_backend"),
        help="rdzv; c10d or static: the rdzv server is used all the same",
    )
    t.add_argument(
        "--monitor-interval",
        "--monitor_interval",
        default=pet("monitor_interval"),
        help="not used: worker exits are seen at once",
    )
    t.add_argument(
        "--start-method",
        "--start_method",
        default=pet("start_method"),
        choices=("spawn", "fork", "forkserver"),
        help="not used: workers are processes started with exec, as torchrun starts a script",
    )
    t.add_argument(
        "--event-log-handler",
        "--event_log_handler",
        default=pet("event_log_handler"),
        help="not used: see rdzv status JOB",
    )
    t.add_argument("--master-addr", "--master_addr", default=pet("master_addr"), help="not used: rank 0 each round")
    t.add_argument(
        "--master-port", "--master_port", default=pet("master_port"), help="not used: a free port each round"
    )
    t.add_argument("--logs-specs", "--logs_specs", default=None, help="not used: torchrun's default layout")
    t.add_argument(
        "--numa-binding",
        "--numa_binding",
        default=None,
        choices=("node", "socket", "exclusive", "core-complex"),
        help="not applied: workers run without NUMA binding",
    )
    for stream in ("stdout", "stderr"):
        t.add_argument(
            f"--duplicate-{stream}-filters",
            f"--duplicate_{stream}_filters",
            default=pet(f"duplicate_{stream}_filters"),
            help="not used: --log-dir DIR --tee 3 keeps the whole output",
        )


def torchrun_notes(args: argparse.Namespace, conf: dict[str, str]) -> list[str]:
    """One line for each torchrun flag given (or PET_* variable set) that rdzv
    does differently: what rdzv does instead."""
    notes = []
    if args.rdzv_backend in ("c10d", "static"):
        notes.append(f"--rdzv-backend {args.rdzv_backend}: rdzv-agent always uses the rdzv server at --rdzv-endpoint")
    if args.monitor_interval is not None:
        notes.append("--monitor-interval: not used; rdzv-agent does not poll, it learns of a worker's exit at once")
    if args.start_method is not None:
        notes.append(
            f"--start-method {args.start_method}: not used; each worker is a process of its own started with exec "
            "(as torchrun starts a script: start methods apply to Python function entry points)"
        )
    if args.event_log_handler not in (None, "null"):
        notes.append(
            f"--event-log-handler {args.event_log_handler}: not used; the job's events are kept by the server "
            "(rdzv status JOB, GET /v1/jobs/JOB)"
        )
    if args.master_addr is not None or args.master_port is not None:
        notes.append(
            "--master-addr/--master-port: not used; each round's rank 0 gives MASTER_ADDR (its address) "
            "and a free MASTER_PORT to every node"
        )
    if args.logs_specs is not None:
        notes.append(
            f"--logs-specs {args.logs_specs}: not used; logs are laid out as torchrun's default "
            "(--log-dir DIR/attempt_N/LOCAL_RANK/{stdout,stderr}.log)"
        )
    if args.numa_binding is not None:
        notes.append(
            f"--numa-binding {args.numa_binding}: not applied; workers run without NUMA binding "
            "(wrap the script: --no-python numactl ... python train.py)"
        )
    for stream in ("stdout", "stderr"):
        if getattr(args, f"duplicate_{stream}_filters", None):
            notes.append(
                f"--duplicate-{stream}-filters: not used; --log-dir DIR with --tee 3 keeps every worker's "
                "whole output in DIR (grep it)"
            )
    if conf:
        notes.append(
            f"--rdzv-conf {','.join(sorted(conf))}: not used; rdzv-agent reads {', '.join(RDZV_CONF_KEYS)} "
            "there, the other settings are flags (see --help)"
        )
    return notes
