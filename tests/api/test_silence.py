"""A heartbeat arms no timer (issue 24, item 5): the agent channel's idle timeout
is one timer per connection (rdzv_server.silence), not a ``receive(timeout=)``
per frame, which armed and cancelled one for every frame (over 11,000 a second
at 16,384 nodes). What it closes is tested in test_quotas / test_conn_limits."""

from __future__ import annotations

import asyncio

from rdzv_common.protocol import AGENT_PATH, HEARTBEAT_FRAME, JobSpec
from rdzv_server.quotas import FRAME_BURST

from .conftest import Agent, join_msg

FRAMES = FRAME_BURST * 3 // 4  # within the burst: more would close the connection


async def test_heartbeats_arm_no_timer_each(client, monkeypatch):
    spec = JobSpec(min_nodes=2, max_nodes=2)
    agent = Agent(await client.ws_connect(AGENT_PATH))
    await agent.send(join_msg("quiet", "n0", spec=spec))
    await agent.expect("joined")
    loop = asyncio.get_running_loop()
    armed = 0
    real = loop.call_at

    def counted(when, callback, *args, **kw):
        nonlocal armed
        armed += 1
        return real(when, callback, *args, **kw)

    monkeypatch.setattr(loop, "call_at", counted)
    for _ in range(FRAMES):
        await agent.ws.send_str(HEARTBEAT_FRAME)
    await agent.ws.send_str("not json")  # answered after every heartbeat before it was read
    assert (await agent.recv()).op == "error"
    monkeypatch.undo()
    # the store's tick and the error reply's send deadline arm a few; a timer per frame was one per frame
    assert armed < FRAMES // 10, armed
    await agent.close()
