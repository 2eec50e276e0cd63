"""Opaque paging cursors of the REST listings (GET /v1/jobs, GET /v1/hosts).

A cursor is a ``next_cursor`` this server gave out, passed back unchanged; anything
else is a validation error that changes nothing.
"""

from __future__ import annotations

import base64
import bisect
import json
from collections.abc import Callable, Mapping
from typing import TypeVar

from rdzv_common.protocol import ErrorCode, RequestError, is_valid_host, is_valid_id

MAX_CURSOR_LEN = 512

_T = TypeVar("_T")


def paged(
    order: list[tuple[float, str]],
    cursor: str | None,
    limit: int,
    pick: Callable[[tuple[float, str]], _T | None],
    newest: bool = False,
) -> tuple[list[_T], str | None]:
    """One page of what ``pick`` gives for the keys of ``order`` (sorted
    (created_at, id) keys) after ``cursor``, skipping None: (items,
    next_cursor), ``next_cursor`` None on the last page. ``newest``: from the
    newest key down (?order=newest; a cursor is a key either way)."""
    out: list[_T] = []
    if newest:
        j = (bisect.bisect_left(order, decode_cursor(cursor)) if cursor is not None else len(order)) - 1
        while j >= 0 and len(out) < limit:
            item = pick(order[j])
            if item is not None:
                out.append(item)
            j -= 1
        return out, (encode_cursor(order[j + 1]) if j >= 0 and len(out) == limit else None)
    i = bisect.bisect_right(order, decode_cursor(cursor)) if cursor is not None else 0
    while i < len(order) and len(out) < limit:
        item = pick(order[i])
        if item is not None:
            out.append(item)
        i += 1
    more = i < len(order) and len(out) == limit
    return out, (encode_cursor(order[i - 1]) if more else None)


def encode_cursor(key: tuple[float, str]) -> str:
    raw = json.dumps([key[0], key[1]], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[float, str]:
    """A cursor this server made, or a validation error (changes nothing)."""
    try:
        if len(cursor) > MAX_CURSOR_LEN:
            raise ValueError("too long")
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created_at, job_id = json.loads(raw)
        if (
            not isinstance(created_at, (int, float))
            or isinstance(created_at, bool)
            or not isinstance(job_id, str)
            or not is_valid_id(job_id)
        ):
            raise ValueError("not a cursor")
        created_at = float(created_at)  # OverflowError for a huge integer
        if created_at != created_at:
            raise ValueError("NaN")
    except (ValueError, TypeError, OverflowError, RecursionError):
        raise RequestError(
            "cursor is not one this server gave out: pass next_cursor back unchanged", ErrorCode.VALIDATION_ERROR
        ) from None
    return created_at, job_id


def encode_host_cursor(host: str) -> str:
    return base64.urlsafe_b64encode(host.encode()).decode().rstrip("=")


def decode_host_cursor(cursor: str) -> str:
    try:
        if len(cursor) > MAX_CURSOR_LEN:
            raise ValueError("too long")
        host = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        if not is_valid_host(host):
            raise ValueError("not a host")
    except (ValueError, TypeError, UnicodeDecodeError):
        raise RequestError(
            "cursor is not one this server gave out: pass next_cursor back unchanged", ErrorCode.VALIDATION_ERROR
        ) from None
    return host


def encode_offset(offset: int) -> str:
    """A cursor into a job view's node listing (GET /v1/jobs/{id}?cursor=)."""
    return base64.urlsafe_b64encode(f"n{offset}".encode()).decode().rstrip("=")


def decode_offset(cursor: str) -> int:
    try:
        if len(cursor) > MAX_CURSOR_LEN:
            raise ValueError("too long")
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        if not (text[:1] == "n" and text[1:].isascii() and text[1:].isdigit() and len(text) <= 12):
            raise ValueError("not a node cursor")
        return int(text[1:])
    except (ValueError, TypeError, UnicodeDecodeError):
        raise RequestError(
            "cursor is not one this server gave out: pass next_cursor back unchanged", ErrorCode.VALIDATION_ERROR
        ) from None


def node_page(query: Mapping[str, str], most: int) -> tuple[int, int]:
    """``?limit=&cursor=`` of a job view: (nodes to list, 1..``most``; offset), or a
    validation error (changes nothing)."""
    limit = most
    if "limit" in query:
        text = query["limit"]
        if not (text.isascii() and text.isdigit() and len(text) <= 6 and 1 <= int(text) <= most):
            raise RequestError(
                f"limit {text[:64]!r} is not a whole number from 1 to {most}", ErrorCode.VALIDATION_ERROR
            )
        limit = int(text)
    cursor = query.get("cursor") or None
    return limit, decode_offset(cursor) if cursor is not None else 0
