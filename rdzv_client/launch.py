"""How a node's workers are launched, before any is: torchrun's
``--redirects``/``--tee`` syntax (:class:`Std`, :func:`parse_std`), the launch
settings (:class:`LaunchConfig`), the log layout (:func:`error_file_path`) and
the environment a worker gets (:func:`worker_env`).

Light on purpose (no asyncio, no pydantic): the agent's flag parsing imports it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntFlag
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rdzv_common.protocol import Assignment

# ------------------------------------------------------------------ std flags


class Std(IntFlag):
    """Which standard streams a setting applies to (torchrun's values)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


_VALUE_RE = re.compile(r"^[0-3]$")
_MAPPING_RE = re.compile(r"^\d+:[0-3](,\d+:[0-3])*$")


def parse_std(value: str, local_world_size: int) -> dict[int, Std]:
    """Parse torchrun's ``--redirects``/``--tee`` syntax into a per-local-rank map.

    ``"3"`` applies to every local rank; ``"0:3,1:0"`` names local ranks, the
    others get ``Std.NONE``. Ranks beyond ``local_world_size`` are ignored, as
    torchrun does, because every node gets the same flag whatever its nproc.
    Unlike torchrun, ranks may have more than one digit.
    """
    if local_world_size < 0:
        raise ValueError(f"local_world_size must be >= 0, got {local_world_size}")
    text = value.strip().replace(" ", "")
    if _VALUE_RE.match(text):
        return dict.fromkeys(range(local_world_size), Std(int(text)))
    if not _MAPPING_RE.match(text):
        raise ValueError(
            f"invalid stream setting {value!r}: expected one of 0,1,2,3 (0 none, 1 stdout, "
            "2 stderr, 3 both) for all local ranks, or local_rank:value pairs such as '0:3,1:2'"
        )
    out = dict.fromkeys(range(local_world_size), Std.NONE)
    seen: set[int] = set()
    for pair in text.split(","):
        rank_s, std_s = pair.split(":")
        rank = int(rank_s)
        if rank in seen:
            raise ValueError(f"invalid stream setting {value!r}: local rank {rank} given twice")
        seen.add(rank)
        if rank < local_world_size:
            out[rank] = Std(int(std_s))
    return out


def _to_map(setting: Mapping[int, Std] | Std, n: int) -> dict[int, Std]:
    if isinstance(setting, Std):
        return dict.fromkeys(range(n), setting)
    return {i: Std(setting.get(i, Std.NONE)) for i in range(n)}


# --------------------------------------------------------------- launch config


@dataclass(frozen=True)
class LaunchConfig:
    """How to start one node's workers; the same for every attempt.

    ``cmd`` is the full argv (``[python, "-u", script, *args]``); ``${local_rank}``
    in it is replaced per worker, as torchrun does. ``redirects`` sends a stream
    to its log file only, ``tee`` to the file and the console;
    ``local_ranks_filter`` limits what reaches the console, never the files.
    Files need ``log_dir``. ``share_console``: when nothing is redirected,
    tee'd or filtered, workers write to the agent's own stdout and stderr, as
    under torchrun (a terminal stays a terminal, no ``[RANK]: `` prefix);
    otherwise, and without it, output is copied through the agent line by line
    with the prefix.
    """

    cmd: list[str]
    local_world_size: int
    log_dir: Path | None = None
    redirects: dict[int, Std] | Std = Std.NONE
    tee: dict[int, Std] | Std = Std.NONE
    local_ranks_filter: set[int] | None = None
    share_console: bool = False

    def __post_init__(self) -> None:
        if not self.cmd:
            raise ValueError("LaunchConfig.cmd must not be empty")
        if self.local_world_size < 1:
            raise ValueError(f"local_world_size must be >= 1, got {self.local_world_size}")
        if self.log_dir is None and any(
            _to_map(s, self.local_world_size)[r]
            for s in (self.redirects, self.tee)
            for r in range(self.local_world_size)
        ):
            raise ValueError("redirects and tee write log files: they need a log_dir")

    def streams(self, local_rank: int) -> tuple[Std, Std, bool]:
        """Return (to file, to console, shown) for one local rank.

        torchrun's rules: tee implies a file; a redirected stream that is not
        tee'd leaves the console; a filtered-out rank shows nothing.
        """
        redirect = _to_map(self.redirects, self.local_world_size)[local_rank]
        tee = _to_map(self.tee, self.local_world_size)[local_rank]
        to_file = redirect | tee
        to_console = (Std.ALL & ~to_file) | tee
        shown = self.local_ranks_filter is None or local_rank in self.local_ranks_filter
        return Std(to_file), Std(to_console if shown else Std.NONE), shown

    def shares_console(self) -> bool:
        """Whether workers write to the agent's own stdout and stderr (see ``share_console``)."""
        return (
            self.share_console
            and self.local_ranks_filter is None
            and not any(
                _to_map(s, self.local_world_size)[r]
                for s in (self.redirects, self.tee)
                for r in range(self.local_world_size)
            )
        )

    def attempt_dir(self, attempt: int) -> Path | None:
        return None if self.log_dir is None else Path(self.log_dir) / f"attempt_{attempt}"


def error_file_path(log_dir: Path | str, attempt: int, local_rank: int) -> Path:
    """Where a worker's ``TORCHELASTIC_ERROR_FILE`` goes in torchrun's layout."""
    return Path(log_dir) / f"attempt_{attempt}" / str(local_rank) / "error.json"


# ------------------------------------------------------------------ worker env


# What in-place mode needs of torch's NCCL, in every worker's environment unless
# the agent's own environment sets it (the user's value wins); design.md "NCCL".
# 2: on an error or a timeout the watchdog aborts the communicator and leaves the
# process alive (torch 2.13's CleanUpOnly; 1, torchrun's default, ends the process).
# 0: a CUDA error the watchdog sees is not rethrown (which would end the process):
# the worker's own check after the abort decides whether the process must restart.
IN_PLACE_WORKER_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0"}


# the exit code of an in-place worker that asks its agent for a process restart
# (rdzv_client.inplace_nccl: its NCCL communicator or its GPU did not recover); EX_TEMPFAIL
WORKER_EXIT_RESTART = 75


def in_place_env(base_env: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """What an in-place worker's environment gets from :data:`IN_PLACE_WORKER_ENV`:
    (the defaults applied, the user's values kept instead)."""
    applied = {k: v for k, v in IN_PLACE_WORKER_ENV.items() if k not in base_env}
    kept = {k: base_env[k] for k in IN_PLACE_WORKER_ENV if k in base_env}
    return applied, kept


def in_place_env_note(base_env: Mapping[str, str]) -> str:
    """The agent's log line on what :func:`in_place_env` does with ``base_env``."""
    applied, kept = in_place_env(base_env)
    parts = []
    if applied:
        parts.append("workers get " + " ".join(f"{k}={v}" for k, v in applied.items()))
    if kept:
        parts.append("kept as set here: " + " ".join(f"{k}={v}" for k, v in kept.items()))
    return "in-place mode: " + "; ".join(parts) + " (NCCL aborts the communicator, the process stays)"


# What an agent may hold in its environment that its workers must not inherit.
WITHHELD_FROM_WORKERS = ("RDZV_TOKEN", "RDZV_JOB_SECRET", "RDZV_JOB_SECRET_FILE")


def worker_env(
    base_env: Mapping[str, str],
    a: Assignment,
    local_rank: int,
    job_id: str,
    error_file: str,
    role: str = "default",
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
    virtual_local_rank: bool = False,
    in_place: bool = False,
) -> dict[str, str]:
    """Return ``base_env`` plus exactly the variables torchrun gives a worker,
    less the agent's credentials (``RDZV_TOKEN``, ``RDZV_JOB_SECRET``).

    See docs/design.md "The worker environment". ``TORCHELASTIC_RESTART_COUNT``
    is the round number, the same on every node. ``role`` is torchrun's
    --role, ``signals_to_handle`` its --signals-to-handle (as given), and
    ``virtual_local_rank`` its --virtual-local-rank: LOCAL_RANK 0 for every
    worker and CUDA_VISIBLE_DEVICES its own GPU (an entry of the agent's
    CUDA_VISIBLE_DEVICES, or the local rank). ``RDZV_LOCAL_RANK`` (rdzv's own)
    is always the real local rank. ``in_place`` (``--restart-mode in-place``):
    ``RDZV_RESTART_MODE=in-place`` and :data:`IN_PLACE_WORKER_ENV`'s defaults.
    """
    if not 0 <= local_rank < a.local_world_size:
        raise ValueError(f"local_rank {local_rank} outside 0..{a.local_world_size - 1}")
    rank = a.rank_offset + local_rank
    env = dict(base_env)
    env.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(a.world_size),
            "LOCAL_WORLD_SIZE": str(a.local_world_size),
            "GROUP_RANK": str(a.group_rank),
            "GROUP_WORLD_SIZE": str(a.group_world_size),
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(a.world_size),
            "ROLE_NAME": role,
            "MASTER_ADDR": a.master_addr,
            "MASTER_PORT": str(a.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(a.round),
            "TORCHELASTIC_MAX_RESTARTS": str(a.max_restarts),
            "TORCHELASTIC_RUN_ID": job_id,
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCHELASTIC_ERROR_FILE": error_file,
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": base_env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            "TORCHELASTIC_SIGNALS_TO_HANDLE": signals_to_handle,
            # rdzv only: the real local rank, by which rdzv_client.worker names itself on the agent's
            # channel (LOCAL_RANK is 0 for every worker with --virtual-local-rank)
            "RDZV_LOCAL_RANK": str(local_rank),
        }
    )
    if in_place:
        env["RDZV_RESTART_MODE"] = "in-place"
        env.update(in_place_env(base_env)[0])
    if virtual_local_rank:
        env["LOCAL_RANK"] = "0"
        visible = base_env.get("CUDA_VISIBLE_DEVICES")
        gpus = [g.strip() for g in visible.split(",")] if visible is not None else None
        if gpus is not None and local_rank >= len(gpus):
            raise ValueError(f"local_rank {local_rank} exceeds the GPUs in CUDA_VISIBLE_DEVICES={visible}")
        env["CUDA_VISIBLE_DEVICES"] = gpus[local_rank] if gpus is not None else str(local_rank)
    if "OMP_NUM_THREADS" not in base_env and a.local_world_size > 1:
        env["OMP_NUM_THREADS"] = "1"
    for name in WITHHELD_FROM_WORKERS:  # the agent's credentials are not the training script's
        env.pop(name, None)
    return env
