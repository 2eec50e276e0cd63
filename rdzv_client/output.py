"""Workers' output on its way to the console and to log files: whether two
streams are one file (:func:`same_file`), a pseudo-terminal like the agent's
(:func:`open_pty_like`), a copy of stderr as it comes that keeps the tail
explaining a failure (:func:`pass_through`), and a pipe copied to its file
and, whole lines prefixed, to the console (:func:`pump`). The worker group
(:mod:`rdzv_client.workers`) wires them up."""

from __future__ import annotations

import asyncio
import collections
import errno
import fcntl
import io
import logging
import os
import termios
from typing import BinaryIO, TextIO

from .exits import _STDERR_TAIL_LINES

log = logging.getLogger("rdzv_client.workers")  # the worker group's lines, under its name

_READ_CHUNK = 64 * 1024
# A "line" longer than this is printed in pieces rather than buffered forever
# (progress bars that only ever write "\r").
_MAX_LINE_BYTES = 64 * 1024


def same_file(a: TextIO, b: TextIO) -> bool:
    """Whether two streams write to one file (one terminal, one pipe, one log)."""
    try:
        sa, sb = os.fstat(a.fileno()), os.fstat(b.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):
        return a is b
    return (sa.st_dev, sa.st_ino, sa.st_rdev) == (sb.st_dev, sb.st_ino, sb.st_rdev)


def open_pty_like(stream: TextIO) -> tuple[int, int] | None:
    """(master, slave) of a new pseudo-terminal when ``stream`` is a terminal,
    with its window size and without output processing (bytes pass unchanged); else None."""
    try:
        fd = stream.fileno()
        if not os.isatty(fd):
            return None
        master, slave = os.openpty()
    except (OSError, ValueError, io.UnsupportedOperation):
        return None
    try:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, fcntl.ioctl(fd, termios.TIOCGWINSZ, b"\0" * 8))
    except OSError:
        pass  # no size: programs fall back to 80 columns
    try:
        attrs = termios.tcgetattr(slave)
        attrs[1] &= ~termios.OPOST  # no "\n" -> "\r\n": the agent's terminal does that
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
    except termios.error:
        pass
    return master, slave


async def pass_through(stream: asyncio.StreamReader, out: TextIO, tail: collections.deque[str]) -> None:
    """Copy a worker's stderr to ``out`` unchanged, as it comes (a progress bar's
    carriage returns included), keeping its last lines in ``tail``."""
    buffer = getattr(out, "buffer", None)
    pending = b""
    broken = False
    try:
        while True:
            try:
                chunk = await stream.read(_READ_CHUNK)
            except OSError as e:
                if e.errno != errno.EIO:  # EIO: a pseudo-terminal whose every worker end closed
                    raise
                break
            if not chunk:
                break
            try:
                if broken:
                    pass
                elif buffer is not None:
                    buffer.write(chunk)
                    buffer.flush()
                else:
                    out.write(chunk.decode("utf-8", errors="replace"))
                    out.flush()
            except (OSError, ValueError) as e:  # a closed pipe (`| head`): keep draining, or the worker blocks
                broken = True
                log.warning("cannot copy worker output any more: %s", e)
            data = pending + chunk
            cut = data.rfind(b"\n") + 1
            pending = data[cut:][-_MAX_LINE_BYTES:]
            for line in data[:cut].decode("utf-8", errors="replace").split("\n")[:-1][-_STDERR_TAIL_LINES:]:
                tail.append(last_frame(line))
    except Exception:
        log.exception("copying worker output failed")
    finally:
        if pending.strip():
            tail.append(last_frame(pending.decode("utf-8", errors="replace")))


def last_frame(line: str) -> str:
    """What a line shows on a terminal, roughly: the text after its last carriage return."""
    frames = [f for f in line.split("\r") if f.strip()]
    return frames[-1] if frames else ""


async def pump(
    stream: asyncio.StreamReader,
    sink: BinaryIO | None,
    console: TextIO | None,
    prefix: str,
    tail: collections.deque[str] | None,
) -> None:
    """Copy one pipe to its file (bytes as they come) and console (whole lines, prefixed)."""
    pending = b""

    def emit(lines: list[bytes]) -> None:
        text = [ln.decode("utf-8", errors="replace") for ln in lines]
        if tail is not None:
            tail.extend(t.rstrip("\r\n") for t in text[-_STDERR_TAIL_LINES:])
        if console is not None:
            # one write per batch of whole lines: writers never interleave mid-line
            console.write("".join(f"{prefix}{t}" if t.endswith("\n") else f"{prefix}{t}\n" for t in text))
            console.flush()

    try:
        while True:
            chunk = await stream.read(_READ_CHUNK)
            if not chunk:
                break
            if sink is not None:
                sink.write(chunk)
                sink.flush()
            if console is None and tail is None:
                continue
            data = pending + chunk
            cut = data.rfind(b"\n") + 1
            lines = data[:cut].splitlines(keepends=True) if cut else []
            pending = data[cut:]
            if len(pending) > _MAX_LINE_BYTES:
                lines.append(pending)
                pending = b""
            if lines:
                emit(lines)
    except Exception:
        log.exception("copying worker output failed")
    finally:
        try:
            if pending:
                emit([pending])
        finally:
            if sink is not None:
                sink.close()
