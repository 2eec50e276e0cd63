"""How a worker ended, as a value (:class:`ExitInfo`), and the words for it:
:func:`describe`, the error file torch's ``@record`` writes
(:func:`read_error_file`), and the root-cause line of a traceback
(:func:`root_cause_line`).
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from rdzv_server.errors import MAX_ERROR_MESSAGE

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


def describe(info: ExitInfo, rank: int | None = None) -> str:
    """One line for people: who ended, how, and the first words of why."""
    who = f"local rank {info.local_rank}" + (f" (rank {rank})" if rank is not None else "")
    who += f" pid {info.pid}"
    if info.signal is not None:
        how = f"was killed by {info.signal}"
        if info.signal == "SIGKILL":
            how += " (out of memory?)"
    elif info.exit_code == 0:
        how = "exited successfully"
    else:
        how = f"exited with code {info.exit_code}"
    lines = info.message.strip().splitlines()
    # an error file starts with "Type: text"; a stderr message with its error line
    why = lines[0].strip() if lines else ""
    return f"{who} {how}" + (f": {why}" if why else "")


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
