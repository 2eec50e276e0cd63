"""One client process's heartbeats and pings, for bench/bigagents.py: one
task and a heap of due times, not a task per node sleeping on its own timer.

Each node beats on its current connection: a heartbeat (``{"op":"hb"}``) every
``node.hb_s`` (what the server told it, as the agent's link keeps it) and a
ping every ``rdzv_client.client.WS_PING_S`` (the agent's link pings after that
long without a frame from the server), the first of each at a random point of
its interval so that the nodes spread, or, on a connection after a drop, a
whole interval after it, as the link's are. A node's beats stop when its connection
does, and :meth:`Beats.start` starts them on a new one (an older connection's
entries are skipped when they come due). The task sleeps until the next due
time (at most :data:`MAX_NAP_S`, so that a node started meanwhile is not late;
what is due within :data:`MIN_NAP_S` goes in the same pass), and sleeps at
least that long after every pass.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import random
from typing import Any

from rdzv_client.client import WS_PING_S
from rdzv_common.wire import HEARTBEAT_FRAME

MAX_NAP_S = 0.05
# Each pass sleeps at least this long, and takes what is due by its end: thousands of nodes'
# beats are due every fraction of a millisecond, and a pass per beat (a sleep of ~0 between
# them) spun the loop (uvloop's 1 ms timers: 1.5 cores at 16,384 nodes). A beat goes at most
# this much early or late; the agent's heartbeat is every 2 s or more.
MIN_NAP_S = 0.01
_HB, _PING = 0, 1


class Beats:
    """The beats of every node of this process. A node has ``ws`` (a bench.rawws.WsConn
    or None), ``hb_s`` (seconds, or None: no heartbeats yet) and ``beat_gen`` (an int
    this class counts up: entries of an older generation are stale)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Any, int, int]] = []
        self._seq = itertools.count()
        self._task: asyncio.Task | None = None
        self.sent = [0, 0]  # heartbeats, pings

    def start(self, node: Any, spread: bool = True) -> None:
        """Beat ``node`` on its connection now (any earlier beats of it stop): the first
        of each at a random point of its interval (``spread``: nodes that joined over
        time), or a whole interval from now, as the agent's link does on a new
        connection (its heartbeat task sleeps first; it pings after WS_PING_S without
        a frame from the server)."""
        node.beat_gen += 1
        if node.hb_s is None:
            return
        now = asyncio.get_running_loop().time()
        first = random.uniform if spread else (lambda lo, hi: hi)
        self._push(now + first(0, node.hb_s), node, _HB)
        self._push(now + first(0, WS_PING_S), node, _PING)
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    def stop(self, node: Any) -> None:
        node.beat_gen += 1

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._heap.clear()

    def _push(self, due: float, node: Any, kind: int) -> None:
        heapq.heappush(self._heap, (due, next(self._seq), node, node.beat_gen, kind))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        heap = self._heap
        while heap:
            now = loop.time()
            while heap and heap[0][0] <= now + MIN_NAP_S:
                due, _, node, gen, kind = heapq.heappop(heap)
                ws = node.ws
                if gen != node.beat_gen or ws is None or ws.closed:
                    continue  # stopped, or an older connection's
                if kind == _HB:
                    ws.send_text(HEARTBEAT_FRAME)
                    every = node.hb_s
                else:
                    ws.ping()
                    every = WS_PING_S
                self.sent[kind] += 1
                nxt = due + every
                self._push(nxt if nxt > now else now + every, node, kind)  # late: no burst to catch up
            if heap:  # every pass yields, however soon the next is due: the loop's other work runs
                await asyncio.sleep(min(max(MIN_NAP_S, heap[0][0] - MIN_NAP_S - loop.time()), MAX_NAP_S))
