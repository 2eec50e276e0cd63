"""Log output: ``text`` for people (the format as it always was) or ``json``
for machines (``--log-format json`` on rdzv-server and rdzv-agent).

json: one object per line, ASCII only (``json.dumps`` escapes control
characters and everything else, so nothing a client sent can break a line or
forge one), with the keys ``time`` (ISO 8601, UTC, milliseconds), ``level``,
``logger``, ``job``, ``round``, ``node``, ``event`` and ``message`` always
present (``null`` when a line is not about a job, round or node, or is no
event), then the line's own fields, and ``exc`` with a traceback when there is
one. ``event`` is one of :data:`EVENTS` (the names of the event stream).

Where a line says which job, round and node it is about: a :class:`Line` (the
round machine's log lines: a ``str`` that carries them), ``extra={"rdzv":
{...}}`` on a logging call, or a context function given to :func:`setup`
(the agent: its job, node id and round; only for a line that carries no
fields of its own). Rate limits (``conns.LogLimiter``,
``audit.Audit``) sit in front of the logger and are the same in both formats.

Standard library only: the agent imports this before its first join.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TextIO

from .wire import printable

FORMATS = ("text", "json")
DEFAULT_FORMAT = "text"
ENV_FORMAT = "RDZV_LOG_FORMAT"

# The event names, shared with the event stream (GET /v1/events).
EVENTS = frozenset(
    {
        "round_opened",
        "round_completed",
        "node_joined",
        "node_lost",
        "node_evicted",
        "node_succeeded",
        "node_failed",
        "restart_charged",
        "job_state",
        "host_cordoned",
        "host_uncordoned",
        "straggler_flagged",
    }
)
CORE_KEYS = ("time", "level", "logger", "job", "round", "node", "event", "message")
MAX_MESSAGE = 8000  # characters of one message (a worker's traceback in a failure reason is longer)

Context = Callable[[], Mapping[str, Any]]


def default_format() -> str:
    """``$RDZV_LOG_FORMAT`` when it names a format, else ``text``."""
    value = os.environ.get(ENV_FORMAT, "").strip().lower()
    return value if value in FORMATS else DEFAULT_FORMAT


class Line(str):
    """A log line (the text, unchanged) that also knows what it is about: its
    job, round, node, event and fields, for the json format."""

    fields: dict[str, Any]

    def __new__(
        cls,
        text: str,
        event: str | None = None,
        *,
        job: str | None = None,
        round: int | None = None,
        node: str | None = None,
        **fields: Any,
    ) -> Line:
        if event is not None and event not in EVENTS:
            raise ValueError(f"unknown log event {event!r}")
        self = super().__new__(cls, text)
        self.fields = {"job": job, "round": round, "node": node, "event": event, **fields}
        return self


class _JobLike(Protocol):
    @property
    def job_id(self) -> str: ...
    @property
    def round(self) -> int: ...


def event_line(job: _JobLike, event: str | None, text: str, node: str | None = None, **fields: Any) -> Line:
    """``text`` about ``job`` in its current round (and ``node``) as a :class:`Line`."""
    return Line(text, event, job=job.job_id, round=job.round, node=node, **fields)


def extra(line: str) -> dict[str, Any] | None:
    """The ``extra`` of a logging call that logs ``line`` (None: a plain str)."""
    return {"rdzv": line.fields} if isinstance(line, Line) else None


def _iso(created: float) -> str:
    t = time.gmtime(created)
    return time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(created % 1 * 1000):03d}Z"


def _plain(value: Any) -> Any:
    """A field value json can write: numbers, strings (at most MAX_MESSAGE
    characters), bools, None, lists and dicts of them; anything else as its
    (escaped) str."""
    if isinstance(value, str):
        return value if len(value) <= MAX_MESSAGE else value[: MAX_MESSAGE - 3] + "..."
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return printable(value, limit=MAX_MESSAGE)


class JsonFormatter(logging.Formatter):
    """One json object per record (see the module docstring)."""

    def __init__(self, context: Context | None = None) -> None:
        super().__init__()
        self.context = context

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = dict.fromkeys(CORE_KEYS)
        out["time"] = _iso(record.created)
        out["level"] = record.levelname
        out["logger"] = record.name
        fields = getattr(record, "rdzv", None)
        if isinstance(fields, Mapping):
            # a record that says what it is about is about that, not about the
            # context (the embedded server's lines in --standalone: no agent node id)
            for key, value in fields.items():
                if key in ("time", "level", "logger", "message"):
                    continue  # a field never overrides what the record says
                out[str(key)] = _plain(value)
        elif self.context is not None:
            try:
                out.update({k: v for k, v in self.context().items() if k in CORE_KEYS})
            except Exception:  # a log line never fails for its context
                pass
        out["message"] = printable(record.getMessage(), limit=MAX_MESSAGE)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=True, separators=(",", ":"))


class JsonStream:
    """A text stream that writes every line written to it as a json log line
    (logger ``stderr``; at ``level``, or else INFO, ERROR for ``... error: ...``
    lines): ``sys.stderr`` with ``--log-format json``, so that what a program
    prints directly (the agent's status line, a job's end, a usage error, a
    refusal to start) is json too."""

    def __init__(
        self, target: TextIO, context: Context | None = None, name: str = "stderr", level: int | None = None
    ) -> None:
        self.target = target
        self.formatter = JsonFormatter(context)
        self.name = name
        self.level = level
        self._pending = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            data = self._pending + text
            *lines, self._pending = data.split("\n")
            if len(self._pending) > MAX_MESSAGE:
                lines.append(self._pending)
                self._pending = ""
            for ln in lines:
                self._emit(ln)
        return len(text)

    def _emit(self, text: str) -> None:
        text = text.rstrip("\r")
        if not text.strip():
            return
        level = self.level or (logging.ERROR if "error: " in text[:80] else logging.INFO)
        record = logging.LogRecord(self.name, level, "", 0, "%s", (text,), None)
        self.target.write(self.formatter.format(record) + "\n")

    def flush(self) -> None:
        with self._lock:
            if self._pending:
                self._emit(self._pending)
                self._pending = ""
        self.target.flush()

    def isatty(self) -> bool:
        return False  # never a terminal: no cursor movement inside json

    def fileno(self) -> int:
        return self.target.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self.target, "encoding", "utf-8")


def setup(
    log_format: str,
    level: str | int,
    text_format: str,
    datefmt: str | None = None,
    context: Context | None = None,
    stream: TextIO | None = None,
) -> None:
    """Configure the root logger: ``text`` exactly as ``logging.basicConfig``
    with ``text_format`` always did, or ``json``."""
    stream = stream if stream is not None else sys.stderr
    if log_format == "json":
        handler = logging.StreamHandler(stream)
        handler.setFormatter(JsonFormatter(context))
        logging.basicConfig(level=level, handlers=[handler])
    elif log_format == "text":
        logging.basicConfig(level=level, format=text_format, datefmt=datefmt, stream=stream)
    else:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, not {log_format!r}")
