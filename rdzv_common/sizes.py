"""Sizes in bytes of text that clients send, measured as it is stored and
sent: JSON with ASCII escapes (``json.dumps``' default), where a character
outside the BMP costs 12 bytes (a surrogate pair of ``\\uXXXX``) and a
control character 6. ``len(str)`` is not a size: 500 such characters are
6,000 bytes on disk and on the event stream.

Pure (no I/O, no clock): the round machine clips with it too.

The caps on what a job keeps of failures are here, written once (docs/design.md
"Bounds"); the event stream's caps are in :mod:`rdzv_server.events`.
"""

from __future__ import annotations

import json

from rdzv_common.wire import MAX_STDERR_LINE, MAX_STDERR_LINES, printable

TRUNCATED = "...[truncated]"  # the marker a clipped text ends with

# What a job keeps of the reasons that carry client text (failure messages, leave reasons):
MAX_REASON_BYTES = 1024  # a round's reason, the job's root cause and end reason, as JSON
MAX_CAUSE_BYTES = 768  # a failure's description within a reason (the rest: what it cost, e.g. "restart 3/5")
MAX_OLD_REASON_BYTES = 96  # a round's reason once it is older than the newest RECENT_REASONS rounds
RECENT_REASONS = 20  # the newest rounds, whose reasons are kept at MAX_REASON_BYTES
MAX_TAIL_BYTES = 4096  # the failing rank's last stderr lines a job keeps (rounds/culprit.py), as JSON


def json_len(text: str) -> int:
    """Bytes of ``text`` as a JSON string, without its quotes."""
    return len(json.dumps(text)) - 2


def clip(text: str, max_bytes: int) -> str:
    """``text`` cut so that as JSON it takes at most ``max_bytes`` (its quotes
    aside), ending with :data:`TRUNCATED` when cut. Work is bounded by
    ``max_bytes``, not by the length of ``text``."""
    if len(text) * 12 <= max_bytes or json_len(text) <= max_bytes:
        return text
    if max_bytes <= len(TRUNCATED):
        return TRUNCATED[: max(0, max_bytes)]
    budget = max_bytes - len(TRUNCATED)
    head = text[:budget]  # a character takes at least one byte
    lo, hi = 0, len(head)  # the longest prefix that fits: binary search, O(log n) encodings of <= budget chars
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if json_len(head[:mid]) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return head[:lo] + TRUNCATED


def tail_lines(lines: list[str] | None, max_bytes: int = MAX_TAIL_BYTES) -> list[str]:
    """The last of ``lines`` that fit in ``max_bytes`` (as JSON strings), each
    one made printable and clipped to MAX_STDERR_LINE characters. Work is bounded
    by MAX_STDERR_LINES lines, whatever the input."""
    kept: list[str] = []
    size = 0
    for line in reversed((lines or [])[-MAX_STDERR_LINES:]):
        text = clip(printable(line[: MAX_STDERR_LINE * 2]), MAX_STDERR_LINE)
        cost = json_len(text) + 3  # its quotes and a comma
        if size + cost > max_bytes:
            break
        kept.append(text)
        size += cost
    kept.reverse()
    return kept
