"""Host blocks meet a job's nodes: pure, no I/O, no clock.

When the blocks change (a cordon, a cool-down, their end; the host table is
:mod:`rdzv_server.hosts`, behind the job's ``gate``), :func:`hosts_changed`
turns waiting nodes on blocked hosts into spares, admits spares whose host is
free again, and replaces running members on a drained host. A join meets the
same blocks in :mod:`.joins`.
"""

from __future__ import annotations

from rdzv_common.protocol import SpareMsg

from .events import note
from .forming import _check_complete
from .machine import _open_round
from .model import RUNNING, SPARE, WAITING, Effects, Job, Node, blocked, count, move


def hosts_changed(job: Job, now: float, drain: set[str]) -> Effects:
    """Host blocks changed (a cordon, a cool-down, their end): waiting nodes
    on a blocked host become spares, told why; spares whose host is free
    again are admitted (the forming round, or a scale-up below max_nodes); and
    running members on a host in ``drain`` are replaced at once: a new round
    opens without them (they rejoin and wait as spares)."""
    fx = Effects()
    if job.finished:
        return fx
    drained: list[Node] = []
    for node in list(job.nodes.values()):
        why = blocked(job, node, now)
        if node.state == RUNNING and not job.forming and node.host in drain and why is not None:
            drained.append(node)
        elif node.state == WAITING and why is not None:
            move(job, node, SPARE)
            node.note = why
            fx.send(node.node_id, SpareMsg(round=job.round, reason=why))
            text = f"job {job.job_id} round {job.round}: node {node.node_id} waits as a spare: {why}"
            fx.logs.append(note(job, text, node.node_id, host=node.host, reason=why))
            fx.persist = True
        elif node.state == SPARE and why is None and node.note is not None:
            node.note = None
            fx.persist = True
            text = f"job {job.job_id} round {job.round}: host {node.host} of spare {node.node_id} may be admitted again"
            fx.logs.append(note(job, text, node.node_id, host=node.host))
            if job.forming:
                move(job, node, WAITING)
            elif len(job.order) + count(job, WAITING) < job.spec.max_nodes:
                move(job, node, WAITING)
                if job.scale_up_deadline is None:
                    job.scale_up_deadline = now + job.spec.scale_up_window_s
            else:
                fx.send(node.node_id, SpareMsg(round=job.round))
    job.status_dirty = job.status_dirty or fx.persist
    if drained:
        names = ", ".join(f"{n.node_id} ({n.host})" for n in drained[:8])
        why = blocked(job, drained[0], now) or "drained"
        return fx.merge(_open_round(job, f"drain: node(s) {names} replaced: {why}", now))
    if job.forming:
        fx.merge(_check_complete(job, now))
    return fx
