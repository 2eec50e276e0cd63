"""The worker channel's grammar, written once: the datagrams between an agent
and its workers. Standard library only and nothing done on import: the worker
side (:mod:`rdzv_client.worker`, which training scripts import) and the
agent's (:mod:`rdzv_client.channel`, :mod:`rdzv_client.reform`,
:mod:`rdzv_client.watch`) both read it. design.md "The worker channel".

Worker -> agent, on the agent's socket (``RDZV_AGENT_SOCKET``), each datagram
``<round> <local_rank> BODY`` (:func:`prefix`), BODY being:

* a step number - ``progress()``;
* ``end`` (:data:`END`) - ``finished()``: stop watching this worker for hangs;
* ``parked`` (:data:`PARKED`) - in place: at its safe point, out of ``<round>``
  (unasked: a collective of that round failed);
* ``where FRAMES`` (:data:`WHERE`) - the answer to the agent's ``where``.

Agent -> worker (in place), on the worker's own socket next to the agent's
(:func:`worker_socket`), each with the round it is about; a worker takes only
those about a round after the one it runs:

* ``stop <round>`` (:func:`stop`) - that round replaces the one running: leave
  the step (``MembershipChanged``) and park;
* ``assign <round> NAME=VALUE ...`` (:func:`assign`) - this worker's place in
  that round, the names from :data:`ASSIGNED_VARS` only;
* ``where <round>`` (:func:`ask_where`) - say which call the main thread is in.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple

END = b"end"
PARKED = b"parked"
WHERE = b"where"

STOP = "stop"
ASSIGN = "assign"
ASK_WHERE = "where"

# What an assignment sets in a kept worker's environment (the rest of it stays), in order.
ASSIGNED_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
)


def prefix(round_no: int | str, local_rank: int | str) -> bytes:
    """The head of every datagram a worker sends."""
    return f"{round_no} {local_rank} ".encode()


def worker_socket(agent_dir: str | os.PathLike[str], local_rank: int | str) -> str:
    """Where a worker of ``local_rank`` listens for its agent (in place)."""
    return os.path.join(agent_dir, f"w{local_rank}")


def stop(round_no: int) -> str:
    return f"{STOP} {round_no}"


def assign(round_no: int, env: Mapping[str, str]) -> str:
    return f"{ASSIGN} {round_no} " + " ".join(f"{k}={v}" for k, v in env.items())


def ask_where(round_no: int) -> str:
    return f"{ASK_WHERE} {round_no}"


class Order(NamedTuple):
    """An agent's datagram to a worker, read: ``kind`` (``stop``, ``assign``,
    ``where`` or a word this worker does not know), the round it is about, and
    an assignment's variables (any names: the worker takes only ASSIGNED_VARS)."""

    kind: str
    round: int
    env: dict[str, str]


def parse_order(data: bytes) -> Order | None:
    """``data`` as an :class:`Order`; None when it names no round."""
    parts = data.decode("ascii", "replace").split()
    try:
        round_no = int(parts[1]) if len(parts) >= 2 else None
    except ValueError:
        return None
    if round_no is None:
        return None
    env = dict(p.split("=", 1) for p in parts[2:] if "=" in p) if parts[0] == ASSIGN else {}
    return Order(parts[0], round_no, env)
