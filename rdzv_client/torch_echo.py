"""A worker failure that echoes a round change is a membership change, not a
failure charged to torchrun's ``--max-restarts`` (issue 25, item 1).

When a peer node dies, the survivors' workers see gloo's error from the dead
peer within milliseconds, before the server (after its disconnect grace) has
opened the next round and told this node. torchrun's agent checks
``num_nodes_waiting`` (membership changes, not charged) only while its workers
are healthy: a failed worker group is charged to its restart budget first,
and with torchrun's and accelerate's default ``--max-restarts 0`` torchrun
gives up, and the plugin's give-up ends the job on every node.

rdzv-agent does not charge such a failure (the server already knows the
round changed). For torchrun, :func:`hook_agent` wraps the ``_monitor_workers``
of the one torch agent whose worker spec uses this handler (that instance
only; torch's classes are not patched): a failed result is held
up to the handler's ``failure_report_delay`` for the server to open a later
round (:meth:`RdzvRendezvousHandler.round_changed_since`); when it does, the
monitor reports the group healthy, so torchrun's own membership branch sees
``num_nodes_waiting() > 0`` and restarts its workers without charging them.
A failure with no round change behind it is torchrun's as before.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

log = logging.getLogger("rdzv_client.torch_plugin")  # the plugin's lines, under its name

FRAMES_SEARCHED = 20


def find_agent(handler: object, frame: FrameType | None) -> Any | None:
    """The torch ``SimpleElasticAgent`` whose worker spec's rdzv_handler is
    ``handler``, from the callers' frames (torch calls ``next_rendezvous`` from
    the agent's ``_rendezvous``), or None."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    for _ in range(FRAMES_SEARCHED):
        if frame is None:
            break
        agent = frame.f_locals.get("self")
        if isinstance(agent, SimpleElasticAgent):
            group = getattr(agent, "_worker_group", None)
            if group is not None and group.spec.rdzv_handler is handler:
                return agent
        frame = frame.f_back
    return None


def hook_agent(handler: Any, round_changed: Callable[[], str | None]) -> bool:
    """Wrap the monitor of the torch agent that calls ``handler`` (see the
    module's docstring). ``round_changed()`` waits briefly and returns why a
    later round opened (the server's reason), or None. False: no torch agent
    calls the handler (it is then torchrun's budget alone)."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

    agent = find_agent(handler, sys._getframe(1))
    if agent is None:
        return False
    if getattr(agent, "_rdzv_echo_hooked", False):
        return True
    monitor = agent._monitor_workers

    def monitor_workers(worker_group: Any) -> Any:
        result = monitor(worker_group)
        if result.state is not WorkerState.FAILED:  # (UNHEALTHY: a wedged worker, torchrun stops restarting)
            return result
        why = round_changed()
        if why is None:
            return result
        ranks = sorted(result.failures) if getattr(result, "failures", None) else []
        log.warning(
            "rdzv: worker failure (global rank(s) %s) follows a round change (%s): restarting as a membership "
            "change, not charged to --max-restarts",
            ",".join(map(str, ranks)) or "?",
            why,
        )
        return RunResult(state=WorkerState.HEALTHY)

    agent._monitor_workers = monitor_workers
    agent._rdzv_echo_hooked = True
    return True
