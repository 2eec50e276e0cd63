"""The torchrun handler checks an assignment as rdzv-agent does (one node
session, issue 9): one for another job, or for another number of local
workers, is a protocol error (the link reconnects), never a round this node
runs. A hostile WebSocket server on loopback plays the server; the handler is
the real one, with its real AgentLink and a real TCPStore."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

pytest.importorskip("torch")

from tests.helpers.procs import free_port

pytestmark = pytest.mark.e2e


class LyingServer:
    """Answers the n-th connection's join with ``joined`` and ``plan[n]``'s
    assignment fields (the last one repeats)."""

    def __init__(self, plan: list[dict]) -> None:
        self.plan = plan
        self.port = free_port()
        self.joins: list[dict] = []
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        assert ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.close()

    async def _start(self) -> None:
        from aiohttp import web

        from rdzv_common.protocol import AGENT_PATH

        app = web.Application()
        app.router.add_get(AGENT_PATH, self._agent)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def _agent(self, request):
        from aiohttp import WSMsgType, web

        from rdzv_common.protocol import AssignedMsg, Assignment, JoinedMsg

        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for frame in ws:
            if frame.type != WSMsgType.TEXT:
                break
            msg = json.loads(frame.data)
            if msg.get("op") != "join":
                continue
            self.joins.append(msg)
            fields = self.plan[min(len(self.joins), len(self.plan)) - 1]
            await ws.send_str(JoinedMsg(round=0, node_id=msg["node_id"], heartbeat_s=2.0).model_dump_json())
            a = Assignment(
                **{
                    "job_id": msg["job_id"],
                    "round": 0,
                    "group_rank": 0,
                    "group_world_size": 1,
                    "local_world_size": msg["local_world_size"],
                    "rank_offset": 0,
                    "world_size": msg["local_world_size"],
                    "master_addr": "127.0.0.1",
                    "master_port": msg["master_port"],
                    "max_restarts": 3,
                    "restarts": 0,
                    **fields,
                }
            )
            await ws.send_str(AssignedMsg(assignment=a).model_dump_json())
        return ws

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "lie", [{"job_id": "someone-else"}, {"local_world_size": 3, "world_size": 3}], ids=["other-job", "other-nproc"]
)
def test_the_handler_refuses_an_assignment_that_is_not_for_it(lie: dict, monkeypatch, caplog) -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from rdzv_client.torch_plugin import RdzvRendezvousHandler

    monkeypatch.delenv("PET_NPROC_PER_NODE", raising=False)
    server = LyingServer([lie, {"round": 1}])
    params = RendezvousParameters(
        backend="rdzv",
        endpoint=f"127.0.0.1:{server.port}",
        run_id="mine",
        min_nodes=1,
        max_nodes=1,
        local_addr="127.0.0.1",
        join_timeout=30,
    )
    handler = RdzvRendezvousHandler(params)
    try:
        info = handler.next_rendezvous()
        # the lie was dropped, the link reconnected and joined again; round 1 is the truthful one
        assert (info.rank, info.world_size) == (0, 1)
        assert handler._assignment.round == 1 and handler._assignment.job_id == "mine"
        assert len(server.joins) >= 2, server.joins
        assert any("protocol error" in r.getMessage() for r in caplog.records), caplog.text
    finally:
        handler.shutdown()
        server.close()
