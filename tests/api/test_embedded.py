"""rdzv_server.embedded.start_embedded: the server rdzv-agent --standalone runs
in its own loop, started through public aiohttp API (issue 9). The real app,
the real agent channel."""

from __future__ import annotations

import aiohttp

from rdzv_common.protocol import AGENT_PATH, SERVER_MESSAGE, JobSpec, JoinMsg
from rdzv_server.embedded import start_embedded


async def test_an_embedded_server_listens_on_the_port_it_returns_and_forms_a_round() -> None:
    runner, port = await start_embedded()
    try:
        assert 0 < port < 65536
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{port}/healthz") as r:
                assert r.status == 200
            async with s.ws_connect(f"ws://127.0.0.1:{port}{AGENT_PATH}") as ws:
                await ws.send_str(
                    JoinMsg(
                        job_id="solo",
                        node_id="n-1-abcdef",
                        host="h",
                        addr="127.0.0.1",
                        local_world_size=1,
                        master_port=29555,
                        spec=JobSpec(min_nodes=1, max_nodes=1, last_call_s=0.1),
                    ).model_dump_json()
                )
                ops = []
                while "assigned" not in ops:
                    msg = SERVER_MESSAGE.validate_json((await ws.receive(timeout=10)).data)
                    ops.append(msg.op)
                assert ops[0] == "joined" and msg.assignment.job_id == "solo"
    finally:
        await runner.cleanup()
    async with aiohttp.ClientSession() as s:  # stopped: nothing listens there any more
        try:
            async with s.get(f"http://127.0.0.1:{port}/healthz", timeout=aiohttp.ClientTimeout(total=2)):
                raise AssertionError("the server still answers after cleanup")
        except aiohttp.ClientConnectionError:
            pass


async def test_two_embedded_servers_get_different_ports() -> None:
    a, pa = await start_embedded()
    b, pb = await start_embedded()
    try:
        assert pa != pb
    finally:
        await a.cleanup()
        await b.cleanup()
