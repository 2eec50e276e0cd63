"""Where a thread is: its innermost Python frames in one line (standard
library only, imported by :mod:`rdzv_client.worker`).

The agent asks a worker that did not reach its safe point within
``--in-place-timeout`` (``"where <round>"`` on the worker channel); the
worker's channel thread answers with the main thread's frames, and the
agent's escalation line names the call the worker was blocked in (design.md
"In-place re-formation").
"""

from __future__ import annotations

import os
import sys
import threading
import traceback

MAX_WHERE = 400  # bytes of frames in one answer (a datagram)


def frames(ident: int | None = None, limit: int = MAX_WHERE) -> str:
    """``file.py:LINE in func <- file.py:LINE in caller <- ...`` for thread
    ``ident`` (default: the main thread), innermost first, ASCII, at most
    ``limit`` characters; "unknown" when the thread is gone."""
    frame = sys._current_frames().get(ident if ident is not None else threading.main_thread().ident or 0)
    if frame is None:
        return "unknown"
    parts: list[str] = []
    size = 0
    for fs in reversed(traceback.extract_stack(frame)):
        part = f"{os.path.basename(fs.filename)}:{fs.lineno} in {fs.name}".encode("ascii", "replace").decode()
        if size + len(part) + 4 > limit:
            break
        parts.append(part)
        size += len(part) + 4
    return " <- ".join(parts) or "unknown"
