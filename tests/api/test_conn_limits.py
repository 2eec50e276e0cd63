"""Per-connection limits of the agent WebSocket, on the real app: the first-join
deadline (not for a joined agent), and the cap on error replies.
(The same against a real server process, with raw sockets that never read:
tests/faults/test_connections.py.)"""

from __future__ import annotations

import asyncio

from aiohttp import WSCloseCode, WSMsgType

from rdzv_common.protocol import AGENT_PATH, SERVER_MESSAGE, HeartbeatMsg, LeaveMsg
from rdzv_server import handlers
from rdzv_server.app import Settings

from .conftest import Agent, join_msg


async def _closed(agent: Agent, timeout: float = 5.0):
    """The close frame the server sent (skipping messages before it)."""
    while True:
        frame = await asyncio.wait_for(agent.ws.receive(), timeout)
        if frame.type != WSMsgType.TEXT:
            return frame


async def test_join_deadline_closes_a_connection_that_never_joins_or_left_but_not_a_joined_one(make_client):
    client = await make_client(Settings(join_deadline_s=0.5))
    idle = Agent(await client.ws_connect(AGENT_PATH))
    joined = Agent(await client.ws_connect(AGENT_PATH))
    await joined.send(join_msg("j", "n0", (2, 2)))
    await joined.expect("joined")

    frame = await _closed(idle)
    assert frame.type == WSMsgType.CLOSE and frame.data == WSCloseCode.POLICY_VIOLATION, frame
    assert frame.extra == "no join within 0.5s", frame

    await asyncio.sleep(1.0)  # twice the deadline: a joined agent stays
    await joined.send(HeartbeatMsg())
    assert not joined.ws.closed
    view = await (await client.get("/v1/jobs/j")).json()
    assert [n["node_id"] for n in view["nodes"]] == ["n0"]

    await joined.send(LeaveMsg(reason="done here"))
    await joined.expect("ack")
    frame = await _closed(joined)  # left, and no new join within the deadline
    assert frame.type == WSMsgType.CLOSE and frame.data == WSCloseCode.POLICY_VIOLATION, frame
    await idle.close()
    await joined.close()


async def test_too_many_invalid_messages_close_the_connection(client, connect):
    agent = await connect()
    for _ in range(handlers.MAX_ERRORS + 5):
        await agent.send("not json")
    errors = []
    while True:
        frame = await asyncio.wait_for(agent.ws.receive(), 5)
        if frame.type != WSMsgType.TEXT:
            break
        errors.append(SERVER_MESSAGE.validate_json(frame.data))
    assert [e.code.value for e in errors] == ["validation_error"] * handlers.MAX_ERRORS + ["bad_request"], errors
    assert "too many invalid messages" in errors[-1].message
    assert frame.type in (WSMsgType.CLOSE, WSMsgType.CLOSED), frame
    # the server serves on
    assert (await client.get("/healthz")).status == 200
