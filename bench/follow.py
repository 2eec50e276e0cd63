"""A simulated node's link to an endpoint list of HA replicas, as the real
agent's (rdzv_client.client.AgentLink): one place for bench/simagents.py
(``--follow``, bench/ha.py) and bench/bigagents.py (bench/big_job.py
``--etcd``).

:func:`keep_linked` connects to the endpoint that answers, with the link's own
code (rdzv_client.endpoints: EndpointTries, backoff_delays, election_wait):
a refused or unreachable replica sends it on to the next endpoint, a
``not_leader`` refusal's ``X-Rdzv-Leader`` hint to the leader it names if that
is one of the list; after a cycle of failures it backs off (short while a
replica says an election is on). Once connected it calls the node's
``opened`` (which says what the agent says then: its join, resuming the round
it runs), ``read`` until the connection drops (the caller notes the drop
there), and starts over, until the node's ``stopping`` is set.

The node is any object with the attributes ``ws`` (the connection in use),
``stopping`` (bool: do not reconnect) and ``refused`` (an int: connection
attempts refused or failed). Stdlib and aiohttp (or bench/rawws.py's connections,
through ``connect``), plus rdzv_client.endpoints.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any


async def keep_linked(
    session: Any,
    endpoint: str,
    node: Any,
    opened: Callable[[Any], Awaitable[None]],
    read: Callable[[Any], Awaitable[None]],
    connected: asyncio.Event | None = None,
    connect: Callable[[str, Any], Awaitable[Any]] | None = None,
) -> None:
    """Keep ``node`` connected to the leader of ``endpoint`` (``h:p,h:p``, as
    ``rdzv-agent --endpoint`` takes it); ``connected`` is set at the first connection.
    ``connect(url, node)``: how a connection is opened (bench.rawws.connect's way: it
    raises bench.rawws.Refused); None: aiohttp's ``session.ws_connect``."""
    import aiohttp

    from rdzv_client.client import STABLE_S
    from rdzv_client.endpoints import Endpoints, backoff_delays, election_wait
    from rdzv_common.errors import LEADER_HEADER, SUCCESSOR_HEADER
    from rdzv_common.wire import AGENT_PATH

    from .rawws import Refused

    endpoints = Endpoints(endpoint)
    tries = endpoints.tries()
    delays = backoff_delays()
    down_since, not_leader = time.monotonic(), False
    while not node.stopping:
        leader, refused_503, dropped = None, False, False
        try:
            url = tries.url + AGENT_PATH
            node.ws = await (connect(url, node) if connect is not None else session.ws_connect(url, autoping=True))
        except (aiohttp.WSServerHandshakeError, Refused) as e:
            status, headers = e.status, (e.headers or {})
            leader = (headers.get(LEADER_HEADER) or headers.get(LEADER_HEADER.lower())) if status == 503 else None
            refused_503 = status == 503  # what a replica answers while it does not lead
            not_leader = not_leader or refused_503
            node.refused += 1
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            node.refused += 1
        else:
            tries.ok()
            # (aiohttp's answer headers: its ClientResponse, which it keeps as _response; case-blind)
            headers = (
                node.ws.headers if connect is not None else getattr(getattr(node.ws, "_response", None), "headers", {})
            )
            endpoints.connected(headers.get(SUCCESSOR_HEADER) or headers.get(SUCCESSOR_HEADER.lower()))
            connected_at = time.monotonic()
            await opened(node)
            if connected is not None:
                connected.set()
            await read(node)
            if node.stopping:
                return
            down_since = time.monotonic()
            if down_since - connected_at >= STABLE_S:  # a drop after a service that held: news
                delays, dropped = backoff_delays(), True
        if not (tries.dropped() if dropped else tries.failed(leader, refused_503)):
            await asyncio.sleep(election_wait(next(delays), not_leader, time.monotonic() - down_since))
            not_leader = False
