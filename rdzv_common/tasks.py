"""Stopping asyncio tasks for sure (server and client; standard library only).

One ``task.cancel()`` does not always stop a task before Python 3.12:
``asyncio.wait_for`` swallows a cancellation that arrives in the same loop
step as its awaitable finishes (it returns the result, or raises the
awaitable's own error, instead; CPython gh-86296). A task that loops over
``wait_for`` -- the agent's link connecting with a timeout, a dispatcher
reading with one -- then goes on as if nothing happened, and whoever awaits
it after the cancel waits forever (seen: the agent link's ``close()`` hung a
test for 120 s in CI). :func:`cancel_and_wait` gives a cancelled task
``grace`` seconds for its own cleanup (a WebSocket's close waits up to 1 s),
then cancels it again until it has ended.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)

GRACE_S = 2.0  # a cancelled task's own cleanup before it is cancelled again
RECANCEL_S = 0.1  # then: how long one more cancel gets
WARN_S = 10.0  # a task still running this long after its first cancel is named in the log


async def cancel_and_wait(*tasks: asyncio.Future[Any] | None, grace: float = GRACE_S) -> None:
    """Cancel ``tasks`` (``None`` ones are skipped) and return once each has
    ended. An error a task ended with is logged (never "exception was never
    retrieved", never lost). If the caller is cancelled meanwhile, the tasks
    are cancelled once more and the caller's cancellation goes on."""
    given = [t for t in tasks if t is not None]
    pending = {t for t in given if not t.done()}
    try:
        for t in pending:
            t.cancel()
        if pending:
            _, pending = await asyncio.wait(pending, timeout=grace)
        waited, warned = grace, False
        while pending:
            for t in pending:
                t.cancel()
            _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
            waited += RECANCEL_S
            if pending and not warned and waited >= WARN_S:
                warned = True
                log.warning("still running %.0fs after being cancelled: %s", waited, ", ".join(map(_name, pending)))
    except asyncio.CancelledError:
        for t in given:
            t.cancel()
        raise
    finally:
        for t in given:
            if t.done() and not t.cancelled() and t.exception() is not None:
                log.error("%s ended with an error", _name(t), exc_info=t.exception())


def _name(task: asyncio.Future[Any]) -> str:
    get_name = getattr(task, "get_name", None)
    return str(get_name()) if get_name is not None else repr(task)
