"""What the agent shows a person on its terminal: its log lines
(:func:`setup_logging`), one status line that updates in place, and the first
line of a (possibly multi-line) reason."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from typing import TextIO, cast

from rdzv_common import logs


class StatusLine:
    """One line that updates in place on a terminal; elsewhere, a line when
    the text changes, not more than every few seconds. While ``hold`` is set
    (workers write to the same terminal: their progress bars own it) it shows
    nothing; what happens is said by the agent's log lines."""

    def __init__(self, stream: TextIO = sys.stderr) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.last = ""
        self.last_at = 0.0
        self.open = False
        self.hold = False

    def show(self, text: str, tty_only: bool = False) -> None:
        """``tty_only``: a countdown, shown on a terminal only (elsewhere the
        agent's own log lines say it at their cadence, not every few seconds)."""
        now = time.monotonic()
        if text == self.last or (self.hold and self.tty) or (tty_only and not self.tty):
            return
        if self.tty:
            self.stream.write("\r\x1b[2K" + text)
            self.open = True
        elif now - self.last_at >= 2.0 or not self.last:
            self.stream.write(text + "\n")
            self.last_at = now
        else:
            return
        self.stream.flush()
        self.last = text

    def done(self) -> None:
        if self.open:
            self.stream.write("\n")
            self.stream.flush()
            self.open = False
        self.last = ""


class FreshLineHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The agent's log lines: on a terminal each starts with a carriage return
    and erase-line, as tqdm's ``write`` does, so a line lands on a line of its
    own and never inside a worker's progress bar (which redraws on its next
    refresh)."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        isatty = getattr(self.stream, "isatty", None)
        return "\r\x1b[2K" + text if isatty is not None and isatty() else text


def setup_logging(log_format: str, context: Callable[[], dict[str, object]]) -> TextIO:
    """The agent's log lines as --log-format says (``context``: the job, node
    and round a json line names); returns the original stderr (with json,
    sys.stderr becomes a json stream: what the agent prints there directly
    becomes json too)."""
    stderr = sys.stderr
    if log_format == "json":
        sys.stderr = cast(TextIO, logs.JsonStream(stderr, context))
    if log_format == "text":
        # on a terminal each line starts on a cleared line: never inside a worker's progress bar
        handler = FreshLineHandler(stderr)
        handler.setFormatter(logging.Formatter("[rdzv-agent %(asctime)s] %(message)s", datefmt="%H:%M:%S"))
        logging.basicConfig(level=os.environ.get("RDZV_LOG_LEVEL", "INFO"), handlers=[handler])
    else:
        logs.setup(
            log_format,
            os.environ.get("RDZV_LOG_LEVEL", "INFO"),
            "[rdzv-agent %(asctime)s] %(message)s",
            datefmt="%H:%M:%S",
            context=context,
            stream=stderr,
        )
    return stderr


def first_line(text: str) -> str:
    """A reason's first line: failure reasons carry the worker's traceback."""
    lines = text.strip().splitlines() or [""]
    return lines[0] + (" [...]" if len(lines) > 1 else "")
