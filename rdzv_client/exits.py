"""How a worker ended, as a value (:class:`ExitInfo`), and the words for it:
:func:`describe`, the error file torch's ``@record`` writes
(:func:`read_error_file`), the root-cause line of a traceback
(:func:`root_cause_line`), and torchrun's failure summary block
(:func:`failure_summary`).
"""

from __future__ import annotations

import json
import os
import re
import signal
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from rdzv_common.errors import MAX_ERROR_MESSAGE
from rdzv_common.wire import MAX_STDERR_LINES

MAX_MESSAGE_CHARS = MAX_ERROR_MESSAGE  # an exit record's message: the wire's limit
_STDERR_TAIL_LINES = 20

# ----------------------------------------------------------------- exit records


@dataclass(frozen=True)
class ExitInfo:
    """How one worker ended: an exit code, or the signal that killed it."""

    local_rank: int
    pid: int
    exit_code: int | None
    signal: str | None
    message: str
    timestamp: float
    # where ``message`` came from: "error_file", "stderr" (its last lines), or ""
    source: str = ""
    # the worker's TORCHELASTIC_ERROR_FILE (a worker kept in place has its first round's), or ""
    error_file: str = ""
    # its last stderr lines as they came (a failed worker's; the report's ExitRecord.stderr, bounded there)
    stderr: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.signal is None


def _decode_returncode(returncode: int) -> tuple[int | None, str | None]:
    if returncode >= 0:
        return returncode, None
    try:
        return None, signal.Signals(-returncode).name
    except ValueError:
        return None, f"signal {-returncode}"


def describe(info: ExitInfo, rank: int | None = None, timer: bool = False) -> str:
    """One line for people: who ended, how, and the first words of why.
    ``timer``: the agent killed it, its torch FileTimer expired (not a guess of OOM)."""
    who = f"local rank {info.local_rank}" + (f" (rank {rank})" if rank is not None else "")
    who += f" pid {info.pid}"
    if info.signal is not None:
        how = f"was killed by {info.signal}"
        if timer:
            how += " (torch elastic timer expired)"
        elif info.signal == "SIGKILL":
            how += " (out of memory?)"
    elif info.exit_code == 0:
        how = "exited successfully"
    else:
        how = f"exited with code {info.exit_code}"
    lines = info.message.strip().splitlines()
    # an error file starts with "Type: text"; a stderr message with its error line
    why = lines[0].strip() if lines else ""
    return f"{who} {how}" + (f": {why}" if why else "")


_CSI_RE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # colours and cursor moves: escaped they read as noise


def report_tail(lines: tuple[str, ...] | list[str]) -> list[str] | None:
    """A failed worker's last stderr lines as its failure report carries them
    (``ExitRecord.stderr``): colours dropped, control characters escaped, the last
    that fit the wire's bounds (rdzv_common.sizes.tail_lines: the server's rule
    too); None without any."""
    from rdzv_common.sizes import tail_lines

    kept = tail_lines([_CSI_RE.sub("", ln) for ln in lines[-MAX_STDERR_LINES:]])
    return kept or None


def _trim_message(head: str, tail_lines: list[str], limit: int = MAX_MESSAGE_CHARS) -> str:
    """``head`` then as many of the last ``tail_lines`` as fit in ``limit`` chars."""
    head = head.strip()
    if len(head) >= limit:
        return head[: limit - 3] + "..."
    kept: list[str] = []
    size = len(head)
    for line in reversed(tail_lines):
        if size + len(line) + 1 > limit:
            break
        kept.append(line)
        size += len(line) + 1
    kept.reverse()
    return "\n".join([head, *kept]) if head else "\n".join(kept)


def read_error_file(path: str | os.PathLike[str]) -> str | None:
    """Return the message of a torch elastic error file, or None if there is none.

    torch's ``ErrorHandler.record_exception`` writes
    ``{"message": {"message": "Type: text", "extraInfo": {"py_callstack": ...,
    "timestamp": ...}}}``; older or hand-written files have ``{"message": str}``.
    The result is the first line plus the end of the traceback, at most
    ``MAX_MESSAGE_CHARS`` characters.
    """
    try:
        with open(path, encoding="utf-8", errors="replace") as fp:
            data = json.load(fp)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        return f"unreadable error file {os.fspath(path)}: {e}"
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, str):
        return _trim_message(message, [])
    if not isinstance(message, dict):
        return None
    head = str(message.get("message", ""))
    extra = message.get("extraInfo")
    stack = extra.get("py_callstack", "") if isinstance(extra, dict) else ""
    lines = [ln for ln in str(stack or "").splitlines() if ln.strip()]
    # the traceback's last line repeats the head; keep the frames before it
    if lines and lines[-1].strip() == head.strip():
        lines = lines[:-1]
    return _trim_message(head, lines)


_TRACEBACK_HEAD = "Traceback (most recent call last):"


def root_cause_line(lines: list[str]) -> str:
    """The line of a stderr tail that names the error, as torchrun's summary does.

    That is the first unindented line after the last traceback (the last
    ``Traceback (most recent call last):``, or, when a deep traceback's head
    scrolled out of the tail, its last ``File "..."`` frame): for chained
    exceptions the final one, never a warning printed before it nor the
    interpreter's noise after it. Without a traceback, the last line.
    """
    start = -1
    for i, line in enumerate(lines):
        if line.startswith(_TRACEBACK_HEAD) or line.startswith('  File "'):
            start = i
    if start >= 0:
        for line in lines[start + 1 :]:
            if line.strip() and not line[:1].isspace():
                return line.strip()
    for line in reversed(lines):
        if line.strip():
            return line.strip()
    return ""


def _file_tail_lines(path: Path, n: int = _STDERR_TAIL_LINES, max_bytes: int = 8192) -> list[str]:
    try:
        with open(path, "rb") as fp:
            fp.seek(0, os.SEEK_END)
            size = fp.tell()
            fp.seek(max(0, size - max_bytes))
            data = fp.read()
    except OSError:
        return []
    lines = data.decode("utf-8", errors="replace").splitlines()
    if size > max_bytes and lines:
        lines = lines[1:]  # the first one is probably cut
    return [ln for ln in lines if ln.strip()][-n:]


# ------------------------------------------------------- torchrun's summary block

_NOT_AVAILABLE = "<N/A>"
_FAILURE_TEMPLATE = """[{idx}]:
  time      : {time}
  host      : {host}
  rank      : {rank} (local_rank: {local_rank})
  exitcode  : {exitcode} (pid: {pid}) {signal_name}
  error_file: {error_file}
  traceback : {message}"""
_SUMMARY_TEMPLATE = """{border}
{title}
{section}
Failures:
{others}
{section}
Root Cause (first observed failure):
{root}
{border}"""


def entrypoint_name(cmd: list[str], python: str) -> str:
    """What torchrun calls the workers' program: the script (or module) when
    run with ``python``, else the executable."""
    if cmd and cmd[0] == python:
        return next((arg for arg in cmd[1:] if not arg.startswith("-")), "")
    return cmd[0] if cmd else ""


def _error_file_data(path: str | None) -> tuple[str, int | None]:
    """(the traceback torchrun prints, the error's timestamp) from torch's error file."""
    if not path or not os.path.isfile(path):
        return "", None
    try:
        with open(path, encoding="utf-8", errors="replace") as fp:
            data = json.load(fp)
        message = data["message"]
        if isinstance(message, str):
            return message, int(data.get("timestamp", 0))
        stack = message.get("extraInfo", {}).get("py_callstack", message.get("message", _NOT_AVAILABLE))
        return str(stack).replace("\n", "\n  "), int(message["extraInfo"]["timestamp"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"unreadable error file {path}: {e}", None


def failure_summary(
    name: str, failures: list[tuple[int, ExitInfo, str | None]], host: str, show_paths: bool = True
) -> str:
    """torchrun's block (``ChildFailedError.format_msg``, titled "NAME FAILED") for this node's failed
    workers, given as (global rank, record, error file). The traceback comes
    from the error file, as torchrun's does; without one, from the record's
    message (the end of its stderr). ``show_paths`` False: the error files are
    not kept, the block says ``<N/A>`` for them."""
    if not failures:
        raise ValueError("failure_summary needs at least one failure")
    title = f"{name} FAILED"
    formatted: list[tuple[int, str]] = []
    for idx, (rank, info, error_file) in enumerate(failures):
        message, ts = _error_file_data(error_file)
        if info.signal is not None:
            num = getattr(signal.Signals, info.signal, None)
            exitcode = -int(num) if num is not None else _NOT_AVAILABLE
            signal_name = f" ({info.signal})"
            message = message or f"Signal {str(exitcode).lstrip('-')} ({info.signal}) received by PID {info.pid}"
        else:
            exitcode, signal_name = str(info.exit_code), ""
            message = message or info.message.replace("\n", "\n  ").strip()
            message = message or "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
        stamp = ts if ts is not None else int(info.timestamp)
        formatted.append(
            (
                stamp,
                _FAILURE_TEMPLATE.format(
                    idx=idx,
                    time=datetime.fromtimestamp(stamp).isoformat(sep="_"),
                    host=host,
                    rank=rank,
                    local_rank=info.local_rank,
                    exitcode=exitcode,
                    pid=info.pid,
                    signal_name=signal_name,
                    error_file=error_file
                    if show_paths and error_file and os.path.isfile(error_file)
                    else _NOT_AVAILABLE,
                    message=message,
                ),
            )
        )
    root = min(range(len(formatted)), key=lambda i: formatted[i][0])
    width = min(max(len(title), *(len(ln) for _, f in formatted for ln in f.split("\n"))), 60)
    others = [f for i, (_, f) in enumerate(formatted) if i != root]
    return _SUMMARY_TEMPLATE.format(
        border="=" * width,
        title=title,
        section="-" * width,
        others="\n".join(others or ["  <NO_OTHER_FAILURES>"]),
        root=formatted[root][1],
    )
