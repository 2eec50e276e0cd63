"""Simulated nodes of ONE big job, for bench/big_job.py: like bench/simagents.py
(WebSocket clients on ``/v1/agent``, in client processes driven over pipes),
but each node also follows its job through round changes as the agent does:
on ``restart`` it joins again at once (its node secret, no workers to stop),
and every ``assigned`` is recorded with its round and time (or a ``restart``
that carries the node's place: its joins offer direct ports, as the agent's;
``--classic``: they offer none, and every ``restart`` is answered with a join). Its connections
are bench/rawws.py's (each message taken where it is read, no task per node)
and its heartbeats and pings bench/beats.py's (one task per process): the
server sees what agents send, at the rates they send it, and the clients,
which share the server's cores here, take as little of them as they can.

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
import re
import sys
import time
from typing import Any

from . import _common as C
from .beats import Beats
from .rawws import WsConn
from .rawws import connect as ws_connect

CONNECT_TIMEOUT_S = 60.0  # --follow: a node's first connection (the link retries until then)
_ROUND = re.compile(r'"round":(\d+)')  # an assigned's round: the first "round" in it (the assignment's)


class Node:
    __slots__ = (
        *("node_id", "join", "ws", "secret", "hb_s", "beat_gen", "round", "t_round", "dropped", "joined"),
        *("running", "stopping", "refused", "link", "t_drop", "t_back", "run", "join_text", "source"),
    )

    def __init__(self, node_id: str, join: dict, source: str | None = None) -> None:
        self.node_id = node_id
        self.join = join
        self.source = source  # the loopback address its connections come from (source_addr)
        self.ws: WsConn | None = None
        self.secret: str | None = None
        self.hb_s: float | None = None
        self.beat_gen = 0  # bench.beats: its heartbeats and pings on the connection in use
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
        self.run: int | None = None  # the job's run, from its first joined
        self.join_text: tuple[str | None, int | None, str] | None = None  # (secret, run, its join's JSON)


def _live(node: Node) -> bool:
    """Whether the node's connection is open."""
    return node.ws is not None and not node.ws.closed


def _refused(frame: str) -> str | None:
    """ "evicted": the server forgot this node (its secret with it); "stale": its resume named a round
    that is over (the node stays); None: neither."""
    if '"op":"evicted"' in frame or ('"op":"error"' in frame and '"code":"evicted"' in frame):
        return "evicted"
    return "stale" if '"op":"error"' in frame and '"code":"stale_round"' in frame else None


def source_addr(index: int) -> str:
    """Node ``index``'s own loopback address, its connections' source, as a host has its
    own (127.1.0.1, 127.1.0.2, ...: bench.rawws.connect says why). Linux answers every address
    of 127.0.0.0/8 on ``lo``; macOS only 127.0.0.1 unless aliases are added."""
    return f"127.{1 + index // 65024}.{index // 254 % 256}.{index % 254 + 1}"


def join_fields(job: str, node_id: str, index: int, spec: dict, classic: bool = False) -> dict:
    """Node ``index``'s join: from its own address (:func:`source_addr`), as an agent's names its host's."""
    port = 20000 + index % 40000
    return {
        "op": "join",
        "job_id": job,
        "node_id": node_id,
        "host": f"sim{index}",
        "addr": source_addr(index),
        "local_world_size": 1,
        "master_port": port,
        "probe_port": port,  # as the agent's peer probes announce it (nobody probes here)
        "spec": spec,
        # as rdzv-agent's (session.DIRECT_PORTS): a round change's restart may carry its place
        "direct_ports": [] if classic else [port + 1, port + 2, port + 3, port + 4],
    }


class BigClient:
    def __init__(self, url: str, follow: bool = False, classic: bool = False) -> None:
        self.url = url
        self.follow = follow
        self.classic = classic  # offer no direct ports: join again after every restart
        self.nodes: dict[str, Node] = {}
        self.beats = Beats()

    def _send_join(self, node: Node, **extra: Any) -> bool:
        """Its join (with ``extra`` fields); the same join again is serialized once (a round
        change rejoins every node)."""
        if node.ws is None:
            return False
        made = node.join_text
        if extra or made is None or made[:2] != (node.secret, node.run):
            fields = dict(node.join, **extra)
            if node.secret is not None:
                fields["node_secret"] = node.secret
            if node.run is not None:
                fields["run"] = node.run
            text = json.dumps(fields)
            if not extra:
                node.join_text = (node.secret, node.run, text)
        else:
            text = made[2]
        return node.ws.send_text(text)

    def _on_text(self, conn: WsConn, data: str) -> None:
        """A message from the server, taken where it is read (bench.rawws)."""
        node: Node = conn.tag
        if conn is not node.ws:
            return  # an older connection's
        if '"op":"assigned"' in data or ('"op":"restart"' in data and '"assignment":{' in data):
            # (a restart that carries the node's place: its round is the restart's, the first "round")
            m = _ROUND.search(data)
            node.round = int(m.group(1)) if m else json.loads(data)["assignment"]["round"]
            node.t_round = time.time()
            node.running = True
            if node.t_drop is not None and node.t_back is None:
                node.t_back = node.t_round
        elif '"op":"restart"' in data:
            node.running = False
            self._send_join(node)  # an agent with no workers to stop joins again at once
        elif '"op":"pace"' in data:  # the server grew: a slower interval, as the agent's link takes it
            node.hb_s = json.loads(data)["heartbeat_s"]
        elif self.follow and (why := _refused(data)):  # --follow: the agent joins again
            node.running = False
            if why == "evicted":  # as a new node (session.evicted)
                node.secret = None
            self._send_join(node)
        elif '"op":"joined"' in data and (node.hb_s is None or node.run is None or '"node_secret":"' in data):
            msg = json.loads(data)  # (a joined again tells nothing new here: not parsed)
            node.secret = msg.get("node_secret") or node.secret
            if node.run is None:  # the job's run: named in every later join, as the agent does
                node.run = msg.get("run")
            if node.hb_s is None:
                node.hb_s = msg["heartbeat_s"]
                self.beats.start(node)

    def _on_closed(self, conn: WsConn) -> None:
        node: Node = conn.tag
        if conn is not node.ws:
            return
        self.beats.stop(node)
        if not self.follow or node.stopping:
            node.dropped = True
        else:  # the link reconnects (bench/follow.py)
            node.t_drop, node.t_back = time.time(), None

    async def _connect(self, url: str, node: Node) -> WsConn:
        return await ws_connect(url, self._on_text, self._on_closed, tag=node, source=node.source)

    async def _opened(self, node: Node) -> None:
        """--follow: a new connection. After a drop, the join again (the agent's intent)."""
        if not node.joined:
            return  # the first connection: the join goes when the driver says
        if node.running:
            self._send_join(node, resume_round=node.round)
        else:
            self._send_join(node)
        self.beats.start(node, spread=False)  # on the new connection, from now, as the link's

    @staticmethod
    async def _read(node: Node) -> None:
        """--follow: until the connection in use is gone (its messages are taken as they come)."""
        if node.ws is not None:
            await node.ws.done

    async def connect(self, job: str, spec: dict, specs: list[list]) -> dict:
        sem = asyncio.Semaphore(256)

        async def one(node_id: str, index: int) -> None:
            node = Node(node_id, join_fields(job, node_id, index, spec, self.classic), source_addr(index))
            if self.follow:
                from .follow import keep_linked

                connected = asyncio.Event()
                async with sem:
                    node.link = asyncio.ensure_future(
                        keep_linked(None, self.url, node, self._opened, self._read, connected, self._connect)
                    )
                    await asyncio.wait_for(connected.wait(), CONNECT_TIMEOUT_S)
                self.nodes[node_id] = node
                return
            async with sem:
                for attempt in range(30):
                    try:
                        node.ws = await self._connect(self.url, node)
                        break
                    except Exception:
                        if attempt == 29:
                            raise
                        await asyncio.sleep(min(1.0, 0.05 * 2**attempt))
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
            if not self._send_join(node):
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
        live = [n for n in self.nodes.values() if not n.dropped and _live(n)]
        node = self.nodes[node_id] if _live(self.nodes[node_id]) or not live else live[-1]
        node.dropped = node.stopping = True
        t = time.time()
        self.beats.stop(node)
        if _live(node):
            node.ws.abort()  # type: ignore[union-attr]  # no close frame: the server sees the connection lost
        elif node.link is not None:
            node.link.cancel()
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
            "beats_sent": self.beats.sent,  # heartbeats, pings
        }

    async def close(self) -> dict:
        nodes, self.nodes = list(self.nodes.values()), {}
        for n in nodes:
            n.stopping = True
            self.beats.stop(n)
            if n.link is not None:
                n.link.cancel()
            if n.ws is not None:
                n.ws.close()
        open_ = [n.ws.done for n in nodes if n.ws is not None and not n.ws.done.done()]
        if open_:  # the server's close frames back, or the connections gone
            await asyncio.wait(open_, timeout=5.0)
        return {"closed": len(nodes)}

    async def serve(self) -> None:
        try:
            await C.serve_commands(self.do)
        finally:
            await self.close()
            self.beats.close()

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
    from rdzv_server.gc_policy import tune_gc

    C.raise_nofile()
    # a client process holds thousands of nodes' connections, where each agent holds one: a
    # collection here would pause thousands of simulated agents at once (at CPython's
    # default thresholds, 0.1-0.2 s of each round change at 16,384 nodes), so these collect
    # as the server does
    tune_gc()
    flags = sys.argv[2:]
    client = BigClient(sys.argv[1], follow="--follow" in flags, classic="--classic" in flags)
    try:  # its connects, reads and writes in C: at 16,384 nodes a reconnect storm cost the two
        import uvloop  # processes 7.4 s of CPU on asyncio's loop, 4.9 s on uvloop (bench.big_job)
    except ImportError:  # (a dependency of rdzv-server where it builds: CPython on Linux, macOS)
        asyncio.run(client.serve())
    else:
        uvloop.run(client.serve())


if __name__ == "__main__":
    main()
