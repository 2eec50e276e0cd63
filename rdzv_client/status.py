"""What the agent shows a person on its terminal: one status line that updates
in place, and the first line of a (possibly multi-line) reason."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class StatusLine:
    """One line that updates in place on a terminal; elsewhere, a line when
    the text changes, not more than every few seconds."""

    def __init__(self, stream: TextIO = sys.stderr) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.last = ""
        self.last_at = 0.0
        self.open = False

    def show(self, text: str) -> None:
        now = time.monotonic()
        if text == self.last:
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


def first_line(text: str) -> str:
    """A reason's first line: failure reasons carry the worker's traceback."""
    lines = text.strip().splitlines() or [""]
    return lines[0] + (" [...]" if len(lines) > 1 else "")
