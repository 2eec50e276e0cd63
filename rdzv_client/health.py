"""Node health checks: ``python -m rdzv_client.health`` (the check shipped for
``rdzv-agent --health-check``), :func:`run_check`, how the agent runs any
check command, and :func:`wait_healthy`, the agent's loop around it.

The shipped check, one line out, exit 0 when all pass, else 1 with one line
naming what failed:

* GPUs, when torch is installed and CUDA available: every visible device
  multiplies two small matrices and the result is checked (a device that is
  listed but unusable fails here, not in the first collective);
* free disk in the log dir (``--log-dir``, default ``$RDZV_LOG_DIR`` or the
  current directory) of at least ``--min-free-disk``;
* clock skew against the server (``--endpoint``, default ``$RDZV_ENDPOINT``):
  the ``Date`` header of its ``/healthz``, to ``--max-clock-skew`` seconds
  (the header has one-second resolution).

Standard library only at import (torch is imported inside the GPU check), so
the check runs where torch is missing or broken.
"""

from __future__ import annotations

import argparse
import asyncio
import email.utils
import logging
import os
import shutil
import signal
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import AgentConfig

log = logging.getLogger("rdzv_agent")

MAX_OUTPUT = 64 * 1024  # of a check's output, only the last this many bytes are kept
MAX_LINE = 300  # what goes into the host record and the agent's output
DEFAULT_MIN_FREE_DISK = 1 << 30
DEFAULT_MAX_CLOCK_SKEW_S = 5.0


async def run_check(cmd: str, timeout: float, env: dict[str, str] | None = None) -> tuple[bool, str]:
    """Run ``cmd`` (a shell command line) in its own process group; (passed,
    the last line of its output, bounded). A timeout kills the group."""
    proc = await asyncio.create_subprocess_shell(
        cmd,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
        env=env,
    )
    tail = bytearray()

    async def read() -> None:
        assert proc.stdout is not None
        while chunk := await proc.stdout.read(65536):
            tail.extend(chunk)
            del tail[:-MAX_OUTPUT]
        await proc.wait()

    try:
        await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        await proc.wait()
        return False, _last_line(bytes(tail), f"timed out after {timeout:g}s")
    if proc.returncode == 0:
        return True, _last_line(bytes(tail), "ok")
    return False, _last_line(bytes(tail), f"exit status {proc.returncode}")


HEALTH_BACKOFF_S = 1.0  # a failed --health-check runs again after this, doubling up to the max
HEALTH_BACKOFF_MAX_S = 30.0


async def wait_healthy(
    cfg: AgentConfig, say: Callable[..., None], interrupted: Callable[[], bool], on_failure: Callable[[str], None]
) -> bool:
    """The agent's ``--health-check`` loop: run the check until it passes
    (True) or ``interrupted()`` (a signal came: False). Each failure is said,
    handed to ``on_failure`` (the agent leaves the job), sent to the server's
    record of this host, and the check runs again with backoff."""
    from rdzv_common.wire import printable  # not at import: this module is stdlib only

    delay = HEALTH_BACKOFF_S
    while cfg.health_check:
        env = {**os.environ, "RDZV_ENDPOINT": cfg.endpoint}
        if cfg.log_dir is not None:
            env["RDZV_LOG_DIR"] = str(cfg.log_dir)
        ok, line = await run_check(cfg.health_check, cfg.health_check_timeout_s, env=env)
        if ok:
            break
        line = printable(line, limit=300)
        say("health check failed: %s; not joining, checking again in %gs", line, delay)
        on_failure(line)
        await report_health(cfg, line)
        until = time.monotonic() + delay
        while time.monotonic() < until:
            if interrupted():
                return False
            await asyncio.sleep(0.05)
        delay = min(delay * 2, HEALTH_BACKOFF_MAX_S)
    return True


async def report_health(cfg: AgentConfig, line: str) -> None:
    """The failed check's last line into the server's host record (best effort)."""
    from rdzv_common.protocol import RdzvError, printable

    from .rest import RestClient
    from .session import host_label

    try:
        await RestClient(cfg.endpoint, cfg.token, timeout=5.0).report_health(
            host_label(cfg.host), line or "failed", cfg.job_id
        )
    except (RdzvError, ValueError) as e:
        log.warning("cannot send the health check's result to the server: %s", printable(getattr(e, "message", e)))


def _last_line(out: bytes, fallback: str) -> str:
    lines = [ln.strip() for ln in out.decode("utf-8", "replace").splitlines() if ln.strip()]
    text = lines[-1] if lines else fallback
    if lines and fallback.startswith(("timed out", "exit status")):
        text = f"{fallback}: {text}"
    return text if len(text) <= MAX_LINE else text[: MAX_LINE - 3] + "..."


# ----------------------------------------------------------- the shipped check


def check_gpus() -> str | None:
    """None when fine (or no torch/CUDA here), else what failed."""
    try:
        import torch
    except Exception:
        return None
    try:
        if not torch.cuda.is_available():
            return None
        n = torch.cuda.device_count()
    except Exception as e:
        return f"CUDA: cannot count devices: {e}"
    for i in range(n):
        try:
            a = torch.ones(64, 64, device=f"cuda:{i}")
            b = (a @ a).sum().item()
            torch.cuda.synchronize(i)
        except Exception as e:
            return f"GPU {i}: matmul failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        if b != 64.0 * 64 * 64:
            return f"GPU {i}: matmul gave {b}, expected {64**3}"
    return None


def check_disk(path: Path, min_free: int) -> str | None:
    try:
        free = shutil.disk_usage(path).free
    except OSError as e:
        return f"disk: cannot stat {path}: {e.strerror or e}"
    if free < min_free:
        return f"disk: {free} bytes free in {path}, need {min_free}"
    return None


def check_clock(endpoint: str | None, max_skew: float, timeout: float = 5.0) -> str | None:
    """The clock against the server's; ``endpoint`` may be a list (HA
    replicas, every one answers /healthz): the first that answers is asked."""
    if not endpoint:
        return None
    from .endpoints import parse_endpoints  # stdlib only, as this module at import

    try:
        urls = parse_endpoints(endpoint)
    except ValueError as e:
        return f"clock: {e}"
    for url in urls:
        try:
            before = time.time()
            with urllib.request.urlopen(url + "/healthz", timeout=timeout, context=ssl.create_default_context()) as r:
                date = r.headers.get("Date")
            after = time.time()
            break
        except (urllib.error.URLError, OSError, ValueError) as e:
            failed = f"clock: cannot reach the server at {url}: {getattr(e, 'reason', e)}"
    else:
        return failed
    if not date:
        return "clock: the server sent no Date header"
    try:
        server = email.utils.parsedate_to_datetime(date).timestamp()
    except (TypeError, ValueError):
        return f"clock: the server's Date header {date[:64]!r} is not a date"
    # the header is truncated to the second: the server's clock was in [server, server + 1)
    skew = max(before - (server + 1.0), server - after, 0.0)
    if skew > max_skew:
        return f"clock: {skew:.1f}s off the server's (--max-clock-skew {max_skew:g}s)"
    return None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m rdzv_client.health",
        description="Check this node: GPUs (when torch and CUDA are present), free disk "
        "in the log dir, clock skew against the rdzv server.",
    )
    p.add_argument(
        "--endpoint",
        default=os.environ.get("RDZV_ENDPOINT"),
        help="rdzv server HOST:PORT, or a list of HA replicas (the first that answers), for the clock check "
        "($RDZV_ENDPOINT; none: no clock check)",
    )
    p.add_argument("--log-dir", default=os.environ.get("RDZV_LOG_DIR") or ".", help="where free disk is checked")
    p.add_argument("--min-free-disk", type=int, default=DEFAULT_MIN_FREE_DISK, metavar="BYTES")
    p.add_argument("--max-clock-skew", type=float, default=DEFAULT_MAX_CLOCK_SKEW_S, metavar="SECONDS")
    p.add_argument("--no-gpu", action="store_true", help="skip the GPU check")
    args = p.parse_args(argv)
    checks: list[Callable[[], str | None]] = [
        lambda: None if args.no_gpu else check_gpus(),
        lambda: check_disk(Path(args.log_dir), args.min_free_disk),
        lambda: check_clock(args.endpoint, args.max_clock_skew),
    ]
    for check in checks:
        failed = check()
        if failed is not None:
            print(f"health check failed: {failed}", flush=True)
            raise SystemExit(1)
    print("health check passed", flush=True)


if __name__ == "__main__":
    main()
