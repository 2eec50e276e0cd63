"""What the torchrun plugin reads from torchrun: the server and the job id
from its rendezvous parameters (:func:`server_and_job`), the node range
(:func:`node_range`), the number of local
workers from torch's WorkerSpec (:func:`spec_nproc`) or its command line
(:func:`torchrun_nproc`), and its failures (ChildFailedError) as the exit
records of a give-up (:func:`exit_records`)."""

from __future__ import annotations

import logging
import os
import sys
import time
from types import FrameType
from typing import TYPE_CHECKING

from rdzv_common.protocol import MAX_ERROR_MESSAGE, MAX_FAILURES_PER_REPORT, ExitRecord, is_valid_id, printable

from .config import UsageError, parse_nnodes
from .exits import read_error_file

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

    from rdzv_common.protocol import Assignment

log = logging.getLogger("rdzv_client.torch_plugin")  # the plugin's lines, under its name


def server_and_job(params: RendezvousParameters) -> tuple[str, str]:
    """The server's HOST:PORT and the job id. ``--rdzv-conf server=HOST:PORT``
    overrides torchrun's --rdzv-endpoint (accelerate builds that from
    --main_process_ip/--main_process_port, or leaves it empty under
    --same_network), then $RDZV_ENDPOINT fills an empty one.
    ``--rdzv-conf job_id=NAME`` overrides --rdzv-id (accelerate has no such
    flag), and torchrun's default ``none`` becomes $SLURM_JOB_ID under SLURM
    (as rdzv-agent's default), else stays ``none`` with a warning."""
    endpoint = str(params.get("server") or params.endpoint or os.environ.get("RDZV_ENDPOINT") or "")
    if not endpoint:
        raise ValueError(
            "rdzv: no server: torchrun got an empty --rdzv-endpoint (accelerate's --same_network passes none); "
            "pass --rdzv-conf server=HOST:PORT (accelerate: --rdzv_conf server=HOST:PORT) or set RDZV_ENDPOINT"
        )
    job_id = str(params.get("job_id") or params.run_id)
    if job_id == "none" and not params.get("job_id"):
        slurm = os.environ.get("SLURM_JOB_ID")
        if slurm:
            job_id = slurm
        else:
            log.warning(
                "rdzv: job id is torchrun's default 'none', shared by every job on %s that gives none: "
                "pass --rdzv-id NAME (accelerate: --rdzv_conf job_id=NAME, or PET_RDZV_ID=NAME)",
                printable(endpoint),
            )
    if not is_valid_id(job_id):
        raise ValueError(f"rdzv: job id {printable(job_id)!r}: use 1-128 characters of letters, digits and ._:@+-")
    return endpoint, job_id


def node_range(params: RendezvousParameters) -> tuple[int, int]:
    """(min_nodes, max_nodes): torchrun's --nnodes, or ``--rdzv-conf
    nnodes=MIN:MAX`` over it (rdzv-agent's --nnodes syntax). accelerate's
    --num_machines is one number, which torchrun takes as MIN = MAX: the
    survivors of a node loss would wait for the lost node to come back;
    ``--rdzv_conf nnodes=2:3`` lets them go on at 2. (torch refuses a
    ``min_nodes`` key: it is a parameter of its own.) ValueError: a bad range."""
    text = params.get("nnodes")
    if text is None:
        return params.min_nodes, params.max_nodes
    try:
        return parse_nnodes(str(text))
    except UsageError as e:
        raise ValueError(f"rdzv: --rdzv-conf {e}".replace("--nnodes ", "nnodes=", 1)) from None


def spec_nproc(handler: RendezvousHandler) -> int | None:
    """The local world size of the torch WorkerSpec whose rdzv_handler is
    ``handler``. torch creates the handler before the spec and never tells it
    the number of local workers (--nproc-per-node: accelerate derives it from
    --num_processes / --num_machines); its agent calls next_rendezvous from
    ``_rendezvous(worker_group)``, so the spec is in a caller's frame."""
    from torch.distributed.elastic.agent.server.api import WorkerGroup, WorkerSpec

    frame: FrameType | None = sys._getframe(1)
    for _ in range(FRAMES_SEARCHED):
        if frame is None:
            break
        for value in list(frame.f_locals.values()):
            spec = value.spec if isinstance(value, WorkerGroup) else value
            if isinstance(spec, WorkerSpec) and spec.rdzv_handler is handler and spec.local_world_size > 0:
                return int(spec.local_world_size)
        frame = frame.f_back
    return None


FRAMES_SEARCHED = 20


def exit_records(exc: ChildFailedError, a: Assignment) -> list[ExitRecord]:
    """torchrun's failures (global rank -> ProcessFailure) as exit records, the
    message from each worker's error file (torch's ``@record``) when it wrote one."""
    records = []
    for rank, f in sorted(exc.failures.items())[:MAX_FAILURES_PER_REPORT]:
        try:
            message = read_error_file(f.error_file) if os.path.isfile(f.error_file) else None
            code = int(f.exitcode)
            records.append(
                ExitRecord(
                    local_rank=int(f.local_rank),
                    rank=int(rank),
                    pid=int(f.pid),
                    exit_code=code if code >= 0 else None,
                    signal=f.signal_name()[:32] if code < 0 else None,
                    message=(message or "")[:MAX_ERROR_MESSAGE],
                    timestamp=float(f.timestamp),
                )
            )
        except (ValueError, TypeError, OSError) as e:  # torch's record is not what we expect: say less
            log.warning("rdzv: cannot read torchrun's failure of rank %s: %s", rank, e)
    return records or [
        ExitRecord(
            local_rank=0,
            rank=a.rank_offset,
            pid=os.getpid(),
            exit_code=1,
            timestamp=time.time(),
            message="torchrun gave up after a worker failure (see its log for the worker error)",
        )
    ]


def torchrun_nproc() -> int:
    """--nproc-per-node from torchrun's command line: only where no torch
    agent calls the handler (see spec_nproc)."""
    argv = sys.argv
    value = os.environ.get("PET_NPROC_PER_NODE", "1")
    for i, arg in enumerate(argv):
        for flag in ("--nproc-per-node", "--nproc_per_node"):
            if arg == flag and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith(flag + "="):
                value = arg.split("=", 1)[1]
    return int(value) if value.isdigit() and int(value) > 0 else 1
