"""In-place mode's round store, hosted by rank 0's worker at the port its
agent picked when it joined (rdzv_client.inplace.process_group).

The agent picks a free port at join time and the worker binds it seconds
later, once the round formed: another process may take it meanwhile (seen once
in 9 runs on a busy machine, issue 25). Retrying that bind until the group's
timeout (60 s) only stalled the round; :func:`port_taken` tells it apart from
the failures worth retrying, and :class:`StorePortTaken` fails the worker at
once with a line that says what happened. Uncaught, it ends the worker with
:data:`STORE_PORT_EXIT` (rdzv_client.inplace's excepthook); its agent reports
that as reason ``store_port`` and the server re-forms without charging a
restart (not the training's fault); the next round's join picks a fresh port."""

from __future__ import annotations

import errno

# The exit code of an in-place worker whose round store port was taken (distinct from
# rdzv_client.launch.WORKER_EXIT_RESTART, 75): its agent reports it uncharged.
STORE_PORT_EXIT = 76


class StorePortTaken(RuntimeError):
    """The round's store port is held by another process: this rank cannot host the store."""

    def __init__(self, addr: str, port: int) -> None:
        super().__init__(
            f"rdzv in-place: the round's store port {addr}:{port} (picked by this node's agent when it joined) "
            "is taken by another process; failing now instead of retrying: the next round gets a fresh port"
        )


def port_taken(e: BaseException) -> bool:
    """A bind that failed because the port is in use (torch's DistNetworkError
    names EADDRINUSE; a plain OSError carries its errno)."""
    if isinstance(e, OSError) and e.errno == errno.EADDRINUSE:
        return True
    text = str(e)
    return "EADDRINUSE" in text or "ddress already in use" in text
