"""The real app in process: aiohttp's test client, and agents simulated over
its WebSocket with the wire models of protocol.py."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import WSMsgType
from aiohttp.test_utils import TestClient, TestServer
from pydantic import BaseModel

from rdzv_common.protocol import AGENT_PATH, SERVER_MESSAGE, JobSpec, JoinMsg
from rdzv_server.app import Settings, create_app

TIMEOUT = 3.0  # generous bound on anything the server pushes "at once"


def join_msg(job_id: str, node_id: str, nnodes: tuple[int, int] = (2, 2), nproc: int = 1, **kw) -> JoinMsg:
    """A join as an agent on host ``node_id`` would send it."""
    spec = kw.pop("spec", None) or JobSpec(min_nodes=nnodes[0], max_nodes=nnodes[1])
    defaults = dict(host=node_id, addr="10.0.0." + str(sum(map(ord, node_id)) % 250 + 1), master_port=29500)
    defaults.update(kw)
    return JoinMsg(job_id=job_id, node_id=node_id, local_world_size=nproc, spec=spec, **defaults)


class Agent:
    """One simulated agent: a WebSocket that speaks the protocol's JSON frames.

    Like the real agent's link it keeps the node secret its ``joined`` brought
    and adds it to its later joins of that node id (a test that wants a join
    without it builds one on another connection)."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.node_secret: str | None = None  # what the server's `joined` issued to this connection
        self.secret_of: str | None = None  # the node id it was issued for

    async def send(self, msg: BaseModel | dict | str) -> None:
        if isinstance(msg, JoinMsg) and msg.node_secret is None and msg.node_id == self.secret_of:
            msg = msg.model_copy(update={"node_secret": self.node_secret})
        if isinstance(msg, BaseModel):
            msg = msg.model_dump_json()
        elif isinstance(msg, dict):
            msg = json.dumps(msg)
        await self.ws.send_str(msg)

    async def recv(self, timeout: float = TIMEOUT):
        """The next server message (parsed), skipping throttled status pushes."""
        while True:
            frame = await asyncio.wait_for(self.ws.receive(), timeout)
            assert frame.type == WSMsgType.TEXT, f"expected a text frame, got {frame.type!r} {frame.data!r}"
            msg = SERVER_MESSAGE.validate_json(frame.data)
            if msg.op == "joined" and msg.node_secret:
                self.node_secret, self.secret_of = msg.node_secret, msg.node_id
            if msg.op != "status":
                return msg

    async def expect(self, op: str, timeout: float = TIMEOUT):
        msg = await self.recv(timeout)
        assert msg.op == op, f"expected {op!r}, got {msg!r}"
        return msg

    async def wait_closed(self, timeout: float = TIMEOUT) -> None:
        """The server closed the connection (after its last message)."""
        frame = await asyncio.wait_for(self.ws.receive(), timeout)
        assert frame.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED), frame

    async def close(self) -> None:
        await self.ws.close()


@pytest.fixture
async def make_client():
    """Start the real app (create_app(settings)) behind a test server; all are
    shut down (store closed) at the end of the test."""
    clients: list[TestClient] = []

    async def make(settings: Settings | None = None) -> TestClient:
        client = TestClient(TestServer(create_app(settings or Settings())))
        await client.start_server()
        clients.append(client)
        return client

    yield make
    for client in reversed(clients):
        await client.close()


@pytest.fixture
async def client(make_client) -> TestClient:
    return await make_client()


@pytest.fixture
async def connect(client):
    """Open agent connections to the default client's /v1/agent."""
    agents: list[Agent] = []

    async def open_agent(on: TestClient | None = None, **kw) -> Agent:
        agent = Agent(await (on or client).ws_connect(AGENT_PATH, **kw))
        agents.append(agent)
        return agent

    yield open_agent
    for agent in agents:
        await agent.close()


async def form(connect, job_id: str, node_ids: list[str], nnodes=None, nproc=1):
    """Join ``node_ids`` to a job with nnodes n:n and return (agents, assignments by node)."""
    n = len(node_ids)
    agents = [await connect() for _ in node_ids]
    for agent, node_id in zip(agents, node_ids):
        await agent.send(join_msg(job_id, node_id, nnodes or (n, n), nproc=nproc))
    assignments = {}
    for agent, node_id in zip(agents, node_ids):
        await agent.expect("joined")
        assignments[node_id] = (await agent.expect("assigned")).assignment
    return agents, assignments
