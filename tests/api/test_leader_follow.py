"""Clients of an endpoint list follow the leader (issue 11, client side): the
agent's link, the REST client and its event stream, against the real app as
the leader and a tiny aiohttp peer as a replica that is not the leader (it
answers everything with 503 ``not_leader`` and, when it knows one, the
leader's URL in ``X-Rdzv-Leader``, as the contract in rdzv_server/errors.py
says). The order of tries itself is unit-tested (tests/unit/test_endpoints.py)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from rdzv_client import wsclient
from rdzv_client.client import AgentLink, RestClient
from rdzv_server.errors import LEADER_HEADER, NotLeaderError, UnavailableError
from rdzv_server.protocol import AGENT_PATH, JoinedMsg
from tests.helpers.procs import free_port

from .conftest import join_msg

T = 10.0  # deadline on every wait


class Follower:
    """A replica that is not the leader: every request is refused, and counted."""

    def __init__(self, server: TestServer, hits: list[str]) -> None:
        self.server = server
        self.hits = hits

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"


@pytest.fixture
async def follower() -> AsyncIterator[Callable[[str | None], Awaitable[Follower]]]:
    servers: list[TestServer] = []

    async def make(leader: str | None) -> Follower:
        hits: list[str] = []

        async def refuse(request: web.Request) -> web.Response:
            hits.append(request.path)
            headers = {LEADER_HEADER: leader} if leader else {}
            body = {"code": "not_leader", "message": "this replica is not the leader"}
            return web.json_response(body, status=503, headers=headers)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", refuse)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        return Follower(server, hits)

    yield make
    for server in servers:
        await server.close()


def _leader(client) -> tuple[str, str]:
    """(endpoint, base URL) of the real app."""
    return f"127.0.0.1:{client.server.port}", f"http://127.0.0.1:{client.server.port}"


async def _joined(link: AgentLink, job: str) -> JoinedMsg:
    link.set_intent(join_msg(job, "n1", (1, 1)).model_dump(mode="json"))
    while True:
        msg = await asyncio.wait_for(link.recv(), T)
        if isinstance(msg, JoinedMsg):
            return msg


async def test_a_refused_upgrade_carries_the_leader_header_and_the_body(follower) -> None:
    f = await follower("http://127.0.0.1:29411")
    with pytest.raises(wsclient.HandshakeError) as refused:
        await wsclient.connect("127.0.0.1", f.server.port, AGENT_PATH, timeout=T)
    e = refused.value
    assert e.status == 503
    assert e.headers[LEADER_HEADER.lower()] == "http://127.0.0.1:29411"
    assert json.loads(e.body)["code"] == "not_leader"
    assert f.hits == [AGENT_PATH]


async def test_the_link_follows_the_hint_to_the_leader_at_once(
    client, follower, caplog: pytest.LogCaptureFixture
) -> None:
    """F (names L), C (names none), L: the link goes from F straight to L; C is never asked."""
    endpoint, url = _leader(client)
    f = await follower(url)
    c = await follower(None)
    link = AgentLink(f"{f.endpoint},{c.endpoint},{endpoint}", heartbeat_s=1.0)
    with caplog.at_level(logging.INFO, logger="rdzv_client.client"):
        await link.start()
        try:
            joined = await _joined(link, "follow")
            assert joined.node_id == "n1"
            assert link.url == url + AGENT_PATH
            assert (f.hits, c.hits) == ([AGENT_PATH], [])
            assert link.down_for() == 0.0 and link.last_error is None
        finally:
            await link.close()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("link: leader is now")]
    assert said == [f"link: leader is now {url}"]


async def test_a_hint_outside_the_list_is_not_followed(client, follower, caplog: pytest.LogCaptureFixture) -> None:
    """F names E, which is not in the list: the link never asks E (nor sends it the token), it tries L."""
    endpoint, url = _leader(client)
    elsewhere = await follower(None)
    f = await follower(elsewhere.url)
    f2 = await follower(elsewhere.url)
    link = AgentLink(f"{f.endpoint},{f2.endpoint},{endpoint}", token="secret", heartbeat_s=1.0)
    with caplog.at_level(logging.INFO, logger="rdzv_client.client"):
        await link.start()
        try:
            await _joined(link, "nofollow")
            assert link.url == url + AGENT_PATH
        finally:
            await link.close()
    assert elsewhere.hits == []
    ignored = [r.getMessage() for r in caplog.records if "ignoring the leader hint" in r.getMessage()]
    assert len(ignored) == 1, ignored  # said once for both refusals (escaped: tests/unit/test_endpoints.py)
    assert elsewhere.url in ignored[0]


async def test_no_leader_anywhere_is_down_and_names_the_endpoint(follower) -> None:
    f = await follower(None)
    dead = f"127.0.0.1:{free_port()}"
    link = AgentLink(f"{dead},{f.endpoint}", heartbeat_s=1.0)
    await link.start()
    try:
        for _ in range(int(T / 0.05)):  # two full cycles: F refused twice
            if len(f.hits) >= 2:
                break
            await asyncio.sleep(0.05)
        assert len(f.hits) >= 2
        assert not link.connected.is_set() and link.down_for() > 0
        assert link.last_error is not None
        assert ("127.0.0.1:" + dead.split(":")[1]) in link.last_error or f.url in link.last_error
    finally:
        await link.close()


async def test_rest_calls_follow_the_hint_and_start_at_the_last_good_endpoint(client, follower) -> None:
    endpoint, url = _leader(client)
    f = await follower(url)
    dead = f"127.0.0.1:{free_port()}"
    rest = RestClient(f"{dead},{f.endpoint},{endpoint}", timeout=5.0)
    assert (await rest.jobs()).jobs == []
    assert f.hits == ["/v1/jobs"]
    assert rest.base == url
    await rest.jobs()
    assert f.hits == ["/v1/jobs"]  # the next call went to the leader first


async def test_a_rest_call_raises_the_last_error_only_when_every_endpoint_failed(follower) -> None:
    f = await follower(None)
    dead = f"127.0.0.1:{free_port()}"
    with pytest.raises(UnavailableError, match=f"cannot reach rdzv server at http://{dead}") as e:
        await RestClient(f"{f.endpoint},{dead}", timeout=5.0).jobs()
    assert not isinstance(e.value, NotLeaderError)
    with pytest.raises(NotLeaderError, match="not the leader") as e2:
        await RestClient(f"{dead},{f.endpoint}", timeout=5.0).jobs()
    assert f.url in e2.value.message
    assert len(f.hits) == 2


async def test_the_event_stream_follows_the_hint(client, follower) -> None:
    endpoint, url = _leader(client)
    f = await follower(url)
    rest = RestClient(f"{f.endpoint},{endpoint}", timeout=5.0)
    opened = asyncio.Event()
    retries: list[str] = []

    async def read() -> None:
        async for _ in rest.events(on_open=opened.set, on_retry=retries.append):
            pass

    reader = asyncio.create_task(read())
    try:
        await asyncio.wait_for(opened.wait(), T)
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
    assert f.hits == ["/v1/events"]
    assert len(retries) == 1 and retries[0].startswith(f.url) and "not the leader" in retries[0]
