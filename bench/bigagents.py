"""Simulated nodes of ONE big job, for bench/big_job.py: like bench/simagents.py
(WebSocket clients on ``/v1/agent``, in client processes driven over pipes),
but each node also follows its job through round changes as the agent does:
on ``restart`` it joins again at once (its node secret, no workers to stop),
and every ``assigned`` is recorded with its round and time.

Commands (JSON lines on stdin, one answer line each on stdout):

``{"cmd": "connect", "nodes": [[node_id, index], ...], "job": J, "spec": {...}}``
    open the connections (256 at a time), send nothing yet;
``{"cmd": "join", "nodes": [node_id, ...] | null}``
    those nodes (null: every one not yet joined) send their join; answers at once
    with the send times;
``{"cmd": "wait", "round": R, "timeout": S}``
    until every node still connected holds an assignment of round R or later
    (or S seconds): the time the last one got it, and how many did not;
``{"cmd": "drop", "node": node_id}``
    cut that node's connection (TCP abort, no close frame): a lost node (it
    does not reconnect);
``{"cmd": "back", "since": T, "timeout": S}``
    (``--follow``) until every node still in the job had its connection drop
    at or after unix time T and got its assignment again on a new connection
    (or S seconds): the time each got it back, and how many did not;
``{"cmd": "stats"}``, ``{"cmd": "close"}``, ``{"cmd": "exit"}``.

``--follow`` (``python -m bench.bigagents ENDPOINTS --follow``, big_job
``--etcd``): the argument is an endpoint list of HA replicas, and each node
keeps its link as the agent does (bench/follow.py: the endpoint walk,
``X-Rdzv-Leader``, the backoff); on a new connection after a drop it sends its
join again with its node secret and, while it holds an assignment,
``resume_round`` (the agent's intent while its workers run); told it was
evicted (or its round is over) it joins anew, without a secret, as the agent
does (under its own id here, which the server no longer knows).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from typing import Any

from rdzv_client.client import WS_PING_S  # as the real agent's link: a ping after this long without a frame

from . import _common as C

CONNECT_TIMEOUT_S = 60.0  # --follow: a node's first connection (the link retries until then)


class Node:
    __slots__ = (
        *("node_id", "join", "ws", "secret", "hb_s", "hb", "reader", "round", "t_round", "dropped", "joined"),
        *("running", "stopping", "refused", "link", "t_drop", "t_back"),
    )

    def __init__(self, node_id: str, join: dict) -> None:
        self.node_id = node_id
        self.join = join
        self.ws = None
        self.secret: str | None = None
        self.hb_s: float | None = None
        self.hb: asyncio.Task | None = None
        self.reader: asyncio.Task | None = None
        self.round = -1  # the round of the last assignment it holds
        self.t_round = 0.0  # when it got that assignment
        self.dropped = False  # lost for good (cut by ``drop``; without --follow, any drop)
        self.joined = False
        self.running = False  # holds an assignment (no restart since): a reconnect resumes its round
        self.stopping = False  # --follow: do not reconnect
        self.refused = 0  # --follow: connection attempts refused (not_leader) or failed
        self.link: asyncio.Task | None = None  # --follow: the task that keeps it connected
        self.t_drop: float | None = None  # --follow: when its connection last dropped
        self.t_back: float | None = None  # ... and when an assignment came on a new one after that


def _transport(node: Node) -> Any:
    """The node's open connection's transport, or None (not connected, or closing)."""
    conn = None if node.ws is None or node.ws.closed else node.ws._conn
    return None if conn is None else conn.transport


def _refused(frame: str) -> str | None:
    """ "evicted": the server forgot this node (its secret with it); "stale": its resume named a round
    that is over (the node stays); None: neither."""
    if '"op":"evicted"' in frame or ('"op":"error"' in frame and '"code":"evicted"' in frame):
        return "evicted"
    return "stale" if '"op":"error"' in frame and '"code":"stale_round"' in frame else None


def join_fields(job: str, node_id: str, index: int, spec: dict) -> dict:
    return {
        "op": "join",
        "job_id": job,
        "node_id": node_id,
        "host": f"sim{index}",
        "addr": "127.0.0.1",
        "local_world_size": 1,
        "master_port": 20000 + index % 40000,
        "spec": spec,
    }


class BigClient:
    def __init__(self, url: str, follow: bool = False) -> None:
        self.url = url
        self.follow = follow
        self.nodes: dict[str, Node] = {}
        self.session = None

    async def _send_join(self, node: Node) -> None:
        fields = dict(node.join)
        if node.secret is not None:
            fields["node_secret"] = node.secret
        await node.ws.send_str(json.dumps(fields))

    async def _read(self, node: Node) -> None:
        import aiohttp

        try:
            async for frame in node.ws:
                if frame.type != aiohttp.WSMsgType.TEXT:
                    continue
                data = frame.data
                if '"op":"assigned"' in data:
                    node.round, node.t_round = json.loads(data)["assignment"]["round"], time.time()
                    node.running = True
                    if node.t_drop is not None and node.t_back is None:
                        node.t_back = node.t_round
                elif '"op":"restart"' in data:
                    node.running = False
                    try:
                        await self._send_join(node)
                    except (ConnectionError, RuntimeError, OSError):
                        break  # an agent with no workers to stop joins again at once
                elif '"op":"pace"' in data:  # the server grew: a slower interval, as the agent's link takes it
                    node.hb_s = json.loads(data)["heartbeat_s"]
                elif self.follow and (why := _refused(data)):  # --follow: the agent joins again
                    node.running = False
                    if why == "evicted":  # as a new node (session.evicted)
                        node.secret = None
                    try:
                        await self._send_join(node)
                    except (ConnectionError, RuntimeError, OSError):
                        break
                elif '"op":"joined"' in data:
                    msg = json.loads(data)
                    node.secret = msg.get("node_secret") or node.secret
                    if node.hb is None:
                        node.hb_s = msg["heartbeat_s"]
                        node.hb = asyncio.ensure_future(self._heartbeat(node))
        except Exception:
            pass
        if not self.follow or node.stopping:
            node.dropped = True
        else:  # the link reconnects (bench/follow.py)
            node.t_drop, node.t_back = time.time(), None

    async def _opened(self, node: Node) -> None:
        """--follow: a new connection. After a drop, the join again (the agent's intent)."""
        if not node.joined:
            return  # the first connection: the join goes when the driver says
        fields = dict(node.join, node_secret=node.secret)
        if node.running:
            fields["resume_round"] = node.round
        try:
            await node.ws.send_str(json.dumps(fields))
        except (ConnectionError, RuntimeError, OSError):
            return
        if node.hb is not None:  # heartbeats on the new connection
            node.hb.cancel()
            node.hb = asyncio.ensure_future(self._heartbeat(node))

    async def _heartbeat(self, node: Node) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        next_hb, next_ping = now + random.uniform(0, node.hb_s), now + random.uniform(0, WS_PING_S)
        try:
            while not node.ws.closed:
                await asyncio.sleep(max(0.0, min(next_hb, next_ping) - loop.time()))
                now = loop.time()
                if now >= next_hb:
                    await node.ws.send_str('{"op":"hb"}')
                    next_hb += node.hb_s
                if now >= next_ping:
                    await node.ws.ping()
                    next_ping += WS_PING_S
        except Exception:
            pass

    async def connect(self, job: str, spec: dict, specs: list[list]) -> dict:
        sem = asyncio.Semaphore(256)

        async def one(node_id: str, index: int) -> None:
            node = Node(node_id, join_fields(job, node_id, index, spec))
            if self.follow:
                from .follow import keep_linked

                connected = asyncio.Event()
                async with sem:
                    node.link = asyncio.ensure_future(
                        keep_linked(self.session, self.url, node, self._opened, self._read, connected)
                    )
                    await asyncio.wait_for(connected.wait(), CONNECT_TIMEOUT_S)
                self.nodes[node_id] = node
                return
            async with sem:
                for attempt in range(30):
                    try:
                        node.ws = await self.session.ws_connect(self.url, autoping=True)
                        break
                    except Exception:
                        if attempt == 29:
                            raise
                        await asyncio.sleep(min(1.0, 0.05 * 2**attempt))
            node.reader = asyncio.ensure_future(self._read(node))
            self.nodes[node_id] = node

        await asyncio.gather(*(one(nid, idx) for nid, idx in specs))
        return {"connected": len(specs)}

    async def join(self, which: list[str] | None) -> dict:
        todo = [self.nodes[n] for n in which] if which is not None else [n for n in self.nodes.values()]
        todo = [n for n in todo if not n.joined]
        sent, failed = [], 0
        for node in todo:
            node.joined = True
            sent.append(time.time())
            try:
                await self._send_join(node)
            except (ConnectionError, RuntimeError, OSError):
                failed += 1  # its connection closed: it counts as behind in wait
        return {"sent": sent, "failed": failed}

    async def wait(self, round_no: int, timeout: float) -> dict:
        # polled, not woken per assignment: a wake-up per node that looks at every node is O(N^2)
        deadline = time.monotonic() + timeout
        while True:
            live = [n for n in self.nodes.values() if n.joined and not n.dropped]
            behind = sum(1 for n in live if n.round < round_no)
            if not behind or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.05)
        done = [n.t_round for n in live if n.round >= round_no]
        return {"last": max(done) if done else None, "first": min(done) if done else None, "behind": behind}

    def drop(self, node_id: str) -> dict:
        """Cut ``node_id``'s connection, or, when that one is down already, the last live node's here
        (none connected, --follow: that node stops reconnecting: lost all the same)."""
        live = [n for n in self.nodes.values() if not n.dropped and _transport(n) is not None]
        node = self.nodes[node_id] if _transport(self.nodes[node_id]) is not None or not live else live[-1]
        node.dropped = node.stopping = True
        t = time.time()
        transport = _transport(node)
        if transport is not None:
            transport.abort()  # no close frame: the server sees the connection lost
        if node.link is not None and transport is None:
            node.link.cancel()
        if node.hb is not None:
            node.hb.cancel()
        return {"t": t, "node": node.node_id}

    async def back(self, since: float, timeout: float) -> dict:
        """--follow: until every node still in the job dropped at or after ``since`` and has
        its assignment again (or ``timeout``). Polled, as ``wait``."""
        deadline = time.monotonic() + timeout
        while True:
            live = [n for n in self.nodes.values() if n.joined and not n.stopping]
            behind = sum(1 for n in live if n.t_drop is None or n.t_drop < since or n.t_back is None)
            if not behind or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.05)
        done = [n for n in live if n.t_drop is not None and n.t_drop >= since and n.t_back is not None]
        return {
            "back": [n.t_back for n in done],
            "rounds": sorted({n.round for n in done}),
            "behind": behind,
            "refused": sum(n.refused for n in live),
        }

    def stats(self) -> dict:
        return {
            "nodes": len(self.nodes),
            "dropped": sum(n.dropped for n in self.nodes.values()),
            "cpu_ticks": C.cpu_ticks(os.getpid()),
            "hb_s": sorted({n.hb_s for n in self.nodes.values() if n.hb_s is not None}),  # the intervals told
        }

    async def close(self) -> dict:
        nodes, self.nodes = list(self.nodes.values()), {}
        for n in nodes:
            n.stopping = True
            if n.link is not None:
                n.link.cancel()
            if n.hb is not None:
                n.hb.cancel()
        await asyncio.gather(*(n.ws.close() for n in nodes if n.ws is not None), return_exceptions=True)
        for n in nodes:
            if n.reader is not None:
                n.reader.cancel()
        return {"closed": len(nodes)}

    async def serve(self) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, connect=30),
        )
        try:
            await C.serve_commands(self.do)
        finally:
            await self.close()
            await self.session.close()

    async def do(self, cmd: dict) -> dict:
        """One command from the driver; its answer."""
        op = cmd["cmd"]
        if op == "connect":
            return await self.connect(cmd["job"], cmd["spec"], cmd["nodes"])
        if op == "join":
            return await self.join(cmd.get("nodes"))
        if op == "wait":
            return await self.wait(int(cmd["round"]), float(cmd["timeout"]))
        if op == "drop":
            return self.drop(cmd["node"])
        if op == "back":
            return await self.back(float(cmd["since"]), float(cmd["timeout"]))
        if op == "stats":
            return self.stats()
        if op == "close":
            return await self.close()
        return {"error": f"unknown {op}"}


def main() -> None:
    C.raise_nofile()
    asyncio.run(BigClient(sys.argv[1], follow="--follow" in sys.argv[2:]).serve())


if __name__ == "__main__":
    main()
