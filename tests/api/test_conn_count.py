"""The Listener counts its open connections itself (issue 24): aiohttp's
``Server.connections`` builds a list of every open connection on each read, so
reading it for every new connection cost O(open connections) each, quadratic
over a join storm of a 16,384-node job. The count must still be right: the
limit holds, and closed connections free their slots."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from .test_quotas import listening


async def _open(url: str, http: aiohttp.ClientSession, n: int) -> tuple[list, int]:
    held, refused = [], 0
    for _ in range(n):
        try:
            held.append(await asyncio.wait_for(http.ws_connect(url), 5))
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError):
            refused += 1
    return held, refused


async def test_new_connections_do_not_list_the_open_ones_and_the_limit_still_holds(monkeypatch):
    reads = 0
    real = web.Server.connections

    def counted(self):
        nonlocal reads
        reads += 1
        return real.fget(self)

    monkeypatch.setattr(web.Server, "connections", property(counted))
    async with listening(max_connections=6, per_address=0) as port:
        url = f"http://127.0.0.1:{port}/healthz"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as http:
            # plain requests open and close connections: the count goes down again
            for _ in range(20):
                async with http.get(url) as resp:
                    assert resp.status == 200
            await asyncio.sleep(0.2)
            held, refused = await _open(f"http://127.0.0.1:{port}/v1/agent", http, 9)
            assert (len(held), refused) == (6, 3)
            for ws in held[:2]:
                await ws.close()
            await asyncio.sleep(0.2)
            more, refused = await _open(f"http://127.0.0.1:{port}/v1/agent", http, 3)
            assert (len(more), refused) == (2, 1)
            for ws in held[2:] + more:
                await ws.close()
        assert reads == 0  # one read per connection before
