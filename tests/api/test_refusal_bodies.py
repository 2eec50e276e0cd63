"""Refusals whose body is JSON nested too deep to parse (a broken or hostile
replica of an endpoint list): the agent's link treats it as any refusal and
goes on to the next endpoint; the REST client raises its one-line error; an
event stream skips such an event. The real link and REST client against tiny
aiohttp peers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from rdzv_client.client import AgentLink
from rdzv_client.rest import RestClient
from rdzv_common.errors import RdzvError

T = 10.0  # deadline on every wait
DEEP = b"[" * 3000  # under the link's refusal body limit, past the JSON parser's recursion limit


@pytest.fixture
async def refuser() -> AsyncIterator[tuple[str, list[str]]]:
    hits: list[str] = []

    async def refuse(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.Response(body=DEEP, status=503, content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", refuse)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield f"127.0.0.1:{server.port}", hits
    await server.close()


async def test_the_link_survives_a_refusal_nested_too_deep(refuser: tuple[str, list[str]]) -> None:
    endpoint, hits = refuser
    link = AgentLink(endpoint)
    await link.start()
    try:
        deadline = time.monotonic() + T
        while len(hits) < 3:  # it keeps trying
            assert link._task is not None and not link._task.done(), link._task
            assert time.monotonic() < deadline, hits
            await asyncio.sleep(0.05)
        assert link.last_error and "503" in link.last_error, link.last_error
    finally:
        await link.close()


async def test_a_rest_call_raises_a_plain_error_on_a_refusal_nested_too_deep(refuser: tuple[str, list[str]]) -> None:
    endpoint, _ = refuser
    with pytest.raises(RdzvError) as e:
        await RestClient(endpoint).jobs()
    assert "HTTP 503" in str(e.value)


async def test_an_event_nested_too_deep_is_skipped_and_the_stream_goes_on() -> None:
    """An event stream whose one event's data is JSON nested too deep: that
    event is skipped (as one that is not a JSON object is), the next arrives."""

    async def stream(request: web.Request) -> web.StreamResponse:
        r = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await r.prepare(request)
        await r.write(b"id: 1\ndata: " + DEEP + b"\n\n")
        await r.write(b'id: 2\ndata: {"id": 2, "type": "after"}\n\n')
        await asyncio.sleep(T)
        return r

    app = web.Application()
    app.router.add_get("/v1/events", stream)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        events = RestClient(f"127.0.0.1:{server.port}").events()
        first = await asyncio.wait_for(events.__anext__(), T)
        assert first["type"] == "after", first
        await events.aclose()
    finally:
        await server.close()
