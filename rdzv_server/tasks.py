"""Stopping asyncio tasks for sure (server and client; standard library only).

One ``task.cancel()`` does not always stop a task before Python 3.12:
``asyncio.wait_for`` swallows a cancellation that arrives in the same loop
step as its awaitable finishes (it returns the result, or raises the
awaitable's own error, instead; CPython gh-86296). A task that loops over
``wait_for`` -- the agent's link connecting with a timeout, a dispatcher
reading with one -- then goes on as if nothing happened, and whoever awaits
it after the cancel waits forever (seen: the agent link's ``close()`` hung a
test for 120 s in CI). :func:`cancel_and_wait` cancels again until every task
has ended.
"""

from __future__ import annotations

import asyncio
from typing import Any

RECANCEL_S = 0.1  # how long one cancel gets before the next


async def cancel_and_wait(*tasks: asyncio.Future[Any] | None) -> None:
    """Cancel ``tasks`` (``None`` ones are skipped) and return once each has
    ended; their errors are taken (never "exception was never retrieved")."""
    given = [t for t in tasks if t is not None]
    pending = {t for t in given if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
    for t in given:
        if not t.cancelled():
            t.exception()
