"""One attempt of this node's workers, as rdzv-agent makes and ends it: for a
round, the agent's line (:func:`announce`), the workers' environments (error
files, the worker channel) and launch settings (:func:`worker_group`) under
the run's log directory (:func:`run_log_dir`); when they cannot start, the
failure to report (:func:`cannot_start`); when some failed, the lines the
agent says, torchrun's summary block (:func:`note_failures`) and the exit
records it reports (:func:`exit_records`). The agent's loop decides when."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from string import Template
from typing import TYPE_CHECKING, Literal, TextIO

from .exits import entrypoint_name, failure_summary, report_tail
from .inplace_store import STORE_PORT_EXIT
from .workers import ExitInfo, LaunchConfig, WorkerGroup, describe, error_file_path, worker_env

if TYPE_CHECKING:
    from rdzv_common.protocol import Assignment, ExitRecord

    from .config import AgentConfig
    from .watch import WorkerWatch


def run_log_dir(cfg: AgentConfig, agent_dir: Path) -> Path | None:
    """Where this agent's attempts write their logs and error files, if anywhere
    kept: torchrun's layout, LOG_DIR/<job id>_<random>/attempt_N/..., one run
    directory per agent, so a re-run with the same --log-dir never replaces the
    last run's logs and error files; --redirects/--tee without --log-dir: in this
    agent's directory, kept after it exits until the next agent on the node
    starts (torchrun's /tmp/torchelastic_* stay for ever)."""
    if cfg.log_dir is not None:
        cfg.log_dir.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"{cfg.job_id}_", dir=cfg.log_dir))
    if _streams_to_files(cfg):
        logs = agent_dir / "logs"
        logs.mkdir()
        return logs
    return None


def log_dir_line(cfg: AgentConfig, log_dir: Path) -> str:
    """The agent's line naming its run's log directory (torchrun's words), and,
    with --log-dir but neither --redirects nor --tee, what does not go there: as
    torchrun, only the error files (and the directories) are written."""
    line = f"log directory set to: {log_dir}"
    if cfg.log_dir is not None and not _streams_to_files(cfg):
        line += (
            " (error files only: worker output goes there with --redirects or --tee, as torchrun; "
            "--tee 3 keeps it and still prints it)"
        )
    return line


def _streams_to_files(cfg: AgentConfig) -> bool:
    """Whether --redirects or --tee sends any stream of any local rank to a file."""
    return any(v for s in (cfg.redirects, cfg.tee) for v in (s.values() if isinstance(s, dict) else [s]))


def place_text(a: Assignment) -> str:
    """A node's place in round ``a``, as the agent's lines say it."""
    last = a.rank_offset + a.local_world_size - 1
    return (
        f"group rank {a.group_rank} of {a.group_world_size}, ranks {a.rank_offset}-{last} of world "
        f"{a.world_size}, master {a.master_addr}:{a.master_port}"
    )


def announce(cfg: AgentConfig, a: Assignment, say: Callable[..., None]) -> None:
    """The agent's line for a round its workers start (and why the node rank
    asked for is not the one given)."""
    say("round %d: %s, restart %d/%d", a.round, place_text(a), a.restarts, a.max_restarts)
    if cfg.node_rank is not None and a.group_rank != cfg.node_rank:
        why = (
            f"this round has {a.group_world_size} node(s)"
            if cfg.node_rank >= a.group_world_size
            else f"rank {cfg.node_rank} is held by another node"
        )
        say("asked for node rank %d, got %d (%s)", cfg.node_rank, a.group_rank, why)


def worker_envs(cfg: AgentConfig, a: Assignment, err_root: Path, watch: WorkerWatch) -> list[dict[str, str]]:
    """Each local worker's environment for round ``a`` (its error file made
    empty under ``err_root``, the channel's variables added)."""
    base = dict(os.environ)
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
        watch.add_env(env)
        envs.append(env)
    return envs


def worker_group(
    cfg: AgentConfig, a: Assignment, envs: list[dict[str, str]], log_dir: Path | None, stderr: TextIO | None
) -> WorkerGroup:
    """The worker group of round ``a`` (not started), its output as --redirects,
    --tee, --local-ranks-filter and torchrun's line prefix template say."""
    launch = LaunchConfig(
        cmd=cfg.cmd,
        local_world_size=cfg.nproc,
        log_dir=log_dir,
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

    return WorkerGroup(launch, envs, attempt=a.round, prefix_fn=prefix if template else None, stderr=stderr)


def cannot_start(cfg: AgentConfig, a: Assignment, e: OSError) -> ExitRecord:
    """The failure to report when the workers of round ``a`` cannot be started."""
    from rdzv_common.protocol import ExitRecord

    return ExitRecord(
        local_rank=0,
        rank=a.rank_offset,
        pid=0,
        exit_code=127,
        message=f"cannot start {cfg.cmd[0]}: {e}",
        timestamp=time.time(),
    )


def store_port_taken(a: Assignment) -> ExitRecord:
    """The failure to report when rank 0's store port of round ``a`` is taken
    before its workers start (``reason`` "store_port": not charged)."""
    from rdzv_common.protocol import ExitRecord

    return ExitRecord(
        local_rank=0,
        rank=a.rank_offset,
        pid=0,
        exit_code=STORE_PORT_EXIT,
        message=f"the store port {a.master_port} of round {a.round} is taken by another process",
        timestamp=time.time(),
        reason="store_port",
    )


def note_failures(
    cfg: AgentConfig,
    a: Assignment,
    failed: list[ExitInfo],
    host: str,
    err_root: Path,
    log_dir: Path | None,
    say: Callable[..., None],
    timer_killed: Callable[[int], bool] = lambda pid: False,
) -> tuple[int, str]:
    """Say each failure (with its error file when --log-dir keeps it; ``timer_killed``:
    which pids the agent killed for an expired FileTimer) and
    return torchrun's summary block (with its round), printed if the job fails
    with this round; the error files are read now: without --log-dir they go
    when the agent exits."""
    # the file each worker was given: one kept in place has the round it started in
    error_files = {i.local_rank: i.error_file or str(error_file_path(err_root, a.round, i.local_rank)) for i in failed}
    for i in failed:
        kept = log_dir is not None and os.path.isfile(error_files[i.local_rank])
        where = f"; error file {error_files[i.local_rank]}" if kept else ""
        say("round %d: %s%s", a.round, describe(i, a.rank_offset + i.local_rank, timer_killed(i.pid)), where)
    return (
        a.round,
        failure_summary(
            entrypoint_name(cfg.cmd, sys.executable),
            [(a.rank_offset + i.local_rank, i, error_files[i.local_rank]) for i in failed],
            host,
            show_paths=log_dir is not None,
        ),
    )


def exit_records(a: Assignment, failed: list[ExitInfo], watch: WorkerWatch, in_place: bool) -> list[ExitRecord]:
    """The failed workers of round ``a`` as the exit records of a failure report.
    The first failure (the server's rule: earliest, then lowest rank) carries its
    last stderr lines; an in-place worker that exited STORE_PORT_EXIT has reason
    "store_port" (its round's store port was taken: the server charges nothing)."""
    from rdzv_common.protocol import ExitRecord

    first = min(failed, key=lambda i: (i.timestamp or float("inf"), i.local_rank)) if failed else None

    def reason(i: ExitInfo) -> Literal["timer", "store_port"] | None:
        if watch.timer_killed(i.pid):
            return "timer"
        return "store_port" if in_place and i.exit_code == STORE_PORT_EXIT else None

    return [
        ExitRecord(
            local_rank=i.local_rank,
            rank=a.rank_offset + i.local_rank,
            pid=i.pid,
            exit_code=i.exit_code,
            signal=i.signal,
            message=watch.exit_message(i),
            timestamp=i.timestamp,
            reason=reason(i),
            stderr=report_tail(i.stderr) if i is first else None,
        )
        for i in failed
    ]
