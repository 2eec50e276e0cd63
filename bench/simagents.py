"""Simulated agents: many WebSocket clients that speak the agent protocol
against a real server and run no workers. One module for the benchmark
(bench/server_scale.py) and the load test (tests/faults/test_load.py).

Each simulated node connects to ``/v1/agent``, sends a ``join``
(protocol.JoinMsg, ``--nnodes N:N``), heartbeats at the ``heartbeat_s`` the
server's ``joined`` frame gives it (spread at random, as real agents are) and,
optionally, sends WebSocket pings every ``WS_PING_S`` (15 s) as the real agent's
link does while the server sends nothing. It
counts what the server tells it: ``assigned`` (with the time), ``evicted``,
``restart``, ``done``, ``error``, and whether its connection dropped.

Nodes live in client processes (``python -m bench.simagents URL
[--no-ws-ping]``), so that their own work is not the caller's Python loop;
:class:`Clients` starts and drives them. Commands go in as JSON lines on
stdin, answers come back as JSON lines on stdout:

``{"cmd": "connect", "nodes": [[job, node_id, index, nnodes], ...]}``
    open the connections (256 at a time), send nothing yet;
``{"cmd": "join", "jobs": [job, ...] | null}``
    every connected node not yet joined (of those jobs) sends its join; the
    answer comes when all are assigned or after ``ASSIGN_TIMEOUT_S``, with the
    send and receive times;
``{"cmd": "storm", "nodes": [...]}``
    connect and join at once, every node (no warm-up);
``{"cmd": "stats"}``
    the counters (and the client process's CPU and RSS);
``{"cmd": "back", "timeout": S}``
    (``--follow`` only) wait up to S seconds until every node whose
    connection dropped got its ``assigned`` again on a new one; the answer has
    each node's ``[dropped, back]`` times (back None: not yet) and counts;
``{"cmd": "close"}``, ``{"cmd": "exit"}``
    close every connection; then also end the process.

``--follow`` (HA replicas, bench/ha.py): URL is an endpoint list
(``127.0.0.1:P1,127.0.0.1:P2``, as ``rdzv-agent --endpoint`` takes it) and each
node is a link like the real agent's (rdzv_client.endpoints's EndpointTries and
backoff): it connects to the endpoint that answers, follows a ``not_leader``
refusal's ``X-Rdzv-Leader`` hint within the list, and when its connection
drops it reconnects and resumes its round (a join with ``resume_round`` and
the node secret its ``joined`` gave it), as the agent does.

Stdlib and aiohttp only, plus rdzv_common.protocol to build the join.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import subprocess
import sys
import time

from rdzv_client.client import WS_PING_S

from . import _common as C

ASSIGN_TIMEOUT_S = 60.0


class Node:
    __slots__ = (
        "job_id",
        "node_id",
        "join_text",
        "ws",
        "t_connect",
        "t_sent",
        "t_recv",
        "hb_s",
        "hb_task",
        "reader",
        "evicted",
        "restarts",
        "done",
        "closed",
        "assigned",
        "errors",
        "why",
        "secret",
        "round",
        "t_drop",
        "t_back",
        "link",
        "refused",
        "stopping",
    )

    def __init__(self, job_id: str, node_id: str, join_text: str):
        self.job_id, self.node_id, self.join_text = job_id, node_id, join_text
        self.ws = None
        self.t_connect = self.t_sent = self.t_recv = None
        self.hb_s = None
        self.hb_task = None
        self.reader = None
        self.evicted = 0
        self.restarts = 0
        self.done = False  # the server said the job ended (``done``)
        self.closed = False
        self.assigned = asyncio.Event()
        self.errors = 0
        self.why = None
        self.secret: str | None = None  # what ``joined`` issued (--follow: sent on a resume)
        self.round: int | None = None  # the round of the last ``assigned``
        self.t_drop: float | None = None  # --follow: when the connection first dropped
        self.t_back: float | None = None  # ... and when ``assigned`` came again after that
        self.link = None  # --follow: the task that keeps the node connected
        self.refused = 0  # --follow: connection attempts refused (not_leader) or failed
        self.stopping = False


def _join_text(job_id: str, node_id: str, index: int, nnodes: int) -> str:
    from rdzv_common.protocol import JobSpec, JoinMsg

    msg = JoinMsg(
        job_id=job_id,
        node_id=node_id,
        host=f"sim{index}",
        addr="127.0.0.1",
        local_world_size=1,
        master_port=20000 + index % 40000,
        spec=JobSpec(min_nodes=nnodes, max_nodes=nnodes),
    )
    return msg.model_dump_json()


class ClientProc:
    def __init__(self, url: str, ws_ping: float | None, follow: bool = False):
        self.url = url
        self.ws_ping = ws_ping
        self.follow = follow
        self.nodes: list[Node] = []
        self.session = None
        self.hb_sent = 0
        self.connect_retries = 0

    async def _connect(self, node: Node) -> None:
        import aiohttp

        delay, err = 0.05, None
        for _ in range(30):
            try:
                # Pings as the agent's link sends them (every WS_PING_S), but without its
                # 2.5 s pong deadline: a slow sim client must not drop connections.
                node.ws = await self.session.ws_connect(self.url, autoping=True)
                return
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
                err = e
                self.connect_retries += 1
                await asyncio.sleep(delay)
                delay = min(1.0, delay * 2)
        raise RuntimeError(f"cannot connect to {self.url}: {err!r}")

    async def _read(self, node: Node) -> None:
        import aiohttp

        ws = node.ws
        try:
            async for frame in ws:
                if frame.type != aiohttp.WSMsgType.TEXT:
                    continue
                data = frame.data
                if '"op":"assigned"' in data:
                    now = time.time()
                    if node.t_recv is None:
                        node.t_recv = now
                    if self.follow:
                        node.round = json.loads(data)["assignment"]["round"]
                        if node.t_drop is not None and node.t_back is None:
                            node.t_back = now
                    node.assigned.set()
                elif '"op":"joined"' in data:
                    joined = json.loads(data)
                    node.secret = joined.get("node_secret") or node.secret
                    if node.hb_task is None:
                        node.hb_s = joined["heartbeat_s"]
                        node.hb_task = asyncio.ensure_future(self._heartbeat(node))
                elif '"op":"pace"' in data:  # the server grew: a slower interval, as the agent's link takes it
                    node.hb_s = json.loads(data)["heartbeat_s"]
                elif '"op":"evicted"' in data:
                    node.evicted += 1
                elif '"op":"restart"' in data:
                    node.restarts += 1
                elif '"op":"done"' in data:
                    node.done = True
                elif '"op":"error"' in data:
                    node.errors += 1
        except Exception as e:
            node.why = repr(e)[:80]
        node.closed = True
        node.why = node.why or f"close code {ws.close_code} {ws.exception()!r}"[:80]
        node.assigned.set()

    async def _heartbeat(self, node: Node) -> None:
        import random

        ws = node.ws
        loop = asyncio.get_running_loop()
        now = loop.time()
        next_hb = now + random.uniform(0, node.hb_s)
        next_ping = now + random.uniform(0, self.ws_ping) if self.ws_ping else float("inf")
        try:
            while not ws.closed:
                await asyncio.sleep(max(0.0, min(next_hb, next_ping) - loop.time()))
                now = loop.time()
                if now >= next_hb:
                    await ws.send_str('{"op":"hb"}')
                    self.hb_sent += 1
                    next_hb += node.hb_s
                if now >= next_ping:
                    await ws.ping()
                    next_ping += self.ws_ping
        except Exception:
            pass

    async def _link(self, node: Node, connected: asyncio.Event) -> None:
        """--follow: keep the node connected as the agent's link does (bench/follow.py);
        after a drop, resume the round it runs."""
        from .follow import keep_linked

        await keep_linked(self.session, self.url, node, self._opened, self._read_noting_drop, connected)

    async def _opened(self, node: Node) -> None:
        node.closed, node.why = False, None
        if node.t_sent is None:
            return  # the first connection: the join goes when the driver says
        fields = json.loads(node.join_text)  # a reconnect: the join again, resuming the round it runs
        fields.update(resume_round=node.round, node_secret=node.secret)
        try:
            await node.ws.send_str(json.dumps(fields))
        except (ConnectionError, RuntimeError, OSError):
            pass
        if node.hb_s is not None:  # heartbeats on the new connection
            if node.hb_task is not None:
                node.hb_task.cancel()
            node.hb_task = asyncio.ensure_future(self._heartbeat(node))

    async def _read_noting_drop(self, node: Node) -> None:
        await self._read(node)
        if not node.stopping and node.t_drop is None:
            node.t_drop = time.time()

    async def back(self, timeout: float) -> dict:
        """--follow: until every node that dropped has its assignment again (or ``timeout``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(n.t_drop is None or n.t_back is not None for n in self.nodes):
                break
            await asyncio.sleep(0.02)
        return {
            "times": [[n.t_drop, n.t_back] for n in self.nodes],
            "refused": sum(n.refused for n in self.nodes),
        }

    async def connect(self, specs: list[list]) -> dict:
        new = [Node(job, nid, _join_text(job, nid, idx, n)) for job, nid, idx, n in specs]
        t0 = time.time()
        sem = asyncio.Semaphore(256)

        async def one(node):
            async with sem:
                await self._connect(node)
            node.reader = asyncio.ensure_future(self._read(node))

        async def linked(node):
            connected = asyncio.Event()
            async with sem:
                node.link = asyncio.ensure_future(self._link(node, connected))
                await connected.wait()

        await asyncio.gather(*((linked if self.follow else one)(n) for n in new))
        self.nodes.extend(new)
        return {"connected": len(new), "s": time.time() - t0, "retries": self.connect_retries}

    async def join(self, job_ids: list[str] | None) -> dict:
        todo = [n for n in self.nodes if n.t_sent is None and (job_ids is None or n.job_id in job_ids)]
        for n in todo:
            n.t_sent = time.time()
            await n.ws.send_str(n.join_text)
        return await self._await_assigned(todo)

    async def _await_assigned(self, todo: list[Node]) -> dict:
        try:
            await asyncio.wait_for(asyncio.gather(*(n.assigned.wait() for n in todo)), ASSIGN_TIMEOUT_S)
        except asyncio.TimeoutError:
            pass
        return {
            "sent": [n.t_sent for n in todo],
            "recv": [n.t_recv for n in todo],
            "connect": [n.t_connect for n in todo],
        }

    async def storm(self, specs: list[list]) -> dict:
        new = [Node(job, nid, _join_text(job, nid, idx, n)) for job, nid, idx, n in specs]
        self.nodes.extend(new)

        async def one(node):
            node.t_connect = time.time()
            await self._connect(node)
            node.reader = asyncio.ensure_future(self._read(node))
            node.t_sent = time.time()
            await node.ws.send_str(node.join_text)

        await asyncio.gather(*(one(n) for n in new), return_exceptions=True)
        res = await self._await_assigned(new)
        res["retries"] = self.connect_retries
        return res

    def stats(self) -> dict:
        return {
            "nodes": len(self.nodes),
            "evicted": sum(n.evicted for n in self.nodes),
            "restart": sum(n.restarts for n in self.nodes),
            "done": sum(n.done for n in self.nodes),
            "closed": sum(n.closed for n in self.nodes),
            "errors": sum(n.errors for n in self.nodes),
            "dropped": sum(n.closed and not n.done for n in self.nodes),
            "assigned": sum(n.t_recv is not None for n in self.nodes),
            "hb_sent": self.hb_sent,
            "why": dict(collections.Counter(n.why for n in self.nodes if n.why)),
            "cpu_ticks": C.cpu_ticks(os.getpid()),
            "rss_kb": C.status_kb(os.getpid(), "VmRSS"),
        }

    async def close(self) -> dict:
        nodes, self.nodes = self.nodes, []
        for n in nodes:
            n.stopping = True
            if n.link:
                n.link.cancel()
            if n.hb_task:
                n.hb_task.cancel()
        await asyncio.gather(*(n.ws.close() for n in nodes if n.ws is not None), return_exceptions=True)
        for n in nodes:
            if n.reader:
                n.reader.cancel()
        return {"closed": len(nodes)}

    async def serve(self) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
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
            return await self.connect(cmd["nodes"])
        if op == "join":
            return await self.join(cmd.get("jobs"))
        if op == "storm":
            return await self.storm(cmd["nodes"])
        if op == "stats":
            return self.stats()
        if op == "back":
            return await self.back(float(cmd.get("timeout", ASSIGN_TIMEOUT_S)))
        if op == "close":
            return await self.close()
        return {"error": f"unknown {op}"}


def client_main(url: str, ws_ping: float | None, follow: bool = False) -> None:
    C.raise_nofile()
    asyncio.run(ClientProc(url, ws_ping, follow).serve())


class Clients:
    """The client processes, driven over pipes."""

    def __init__(self, n: int, url: str, ws_ping: float | None, follow: bool = False):
        argv = [sys.executable, "-m", "bench.simagents", url]
        if ws_ping is None:
            argv.append("--no-ws-ping")
        if follow:
            argv.append("--follow")
        self.procs = C.start_clients(n, argv)

    def __len__(self) -> int:
        return len(self.procs)

    def all(self, cmds: list[dict]) -> list[dict]:
        """Send one command to each client at once; collect every answer."""
        for p, cmd in zip(self.procs, cmds, strict=True):
            p.stdin.write(json.dumps(cmd) + "\n")
            p.stdin.flush()
        out = []
        for p in self.procs:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError("a client process died")
            out.append(json.loads(line))
        return out

    def same(self, cmd: dict) -> list[dict]:
        return self.all([cmd] * len(self.procs))

    def split(self, op: str, nodes: list[list]) -> list[dict]:
        return self.all([{"cmd": op, "nodes": nodes[i :: len(self.procs)]} for i in range(len(self.procs))])

    def stop(self) -> None:
        for p in self.procs:
            try:
                p.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                p.stdin.flush()
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                C.kill_tree(p.pid)
                p.wait(2)
            for pipe in (p.stdin, p.stdout):  # closed here, not by the garbage collector (a ResourceWarning)
                try:
                    pipe.close()
                except OSError:
                    pass


def node_specs(job_id: str, n: int, base: int = 0) -> list[list]:
    """``n`` nodes of a ``n:n`` job, as ``connect`` and ``storm`` take them."""
    return [[job_id, f"{job_id}-n{base + i}", base + i, n] for i in range(n)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.simagents", description=__doc__.split("\n\n")[0])
    p.add_argument("url", help="the server's agent URL, http://HOST:PORT/v1/agent (--follow: HOST:PORT,HOST:PORT..)")
    p.add_argument(
        "--no-ws-ping", action="store_true", help=f"send no WebSocket pings (the agent does, {WS_PING_S:g} s)"
    )
    p.add_argument("--follow", action="store_true", help="follow the leader of an endpoint list; reconnect on a drop")
    a = p.parse_args(argv)
    client_main(a.url, None if a.no_ws_ping else WS_PING_S, a.follow)


if __name__ == "__main__":
    main()
