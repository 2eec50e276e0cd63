"""Clients of an endpoint list follow the leader (issue 11, client side): the
agent's link, the REST client and its event stream, against the real app as
the leader and a tiny aiohttp peer as a replica that is not the leader (it
answers everything with 503 ``not_leader`` and, when it knows one, the
leader's URL in ``X-Rdzv-Leader``, as the contract in rdzv_common/errors.py
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
from rdzv_client.client import AgentLink
from rdzv_client.rest import RestClient
from rdzv_common.errors import LEADER_HEADER, SUCCESSOR_HEADER, NotLeaderError, UnavailableError
from rdzv_common.protocol import AGENT_PATH, JoinedMsg
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


async def _waits(monkeypatch: pytest.MonkeyPatch, link: AgentLink, n: int, on_start=None) -> list[float]:
    """The first ``n`` backoff waits the link takes after a full cycle of its
    list failed (its ``_next``'s sleeps), taken at once (not slept)."""
    import sys

    real_sleep = asyncio.sleep
    waits: list[float] = []
    enough = asyncio.Event()

    async def sleep(delay: float, *args: object) -> object:
        if sys._getframe(1).f_code.co_name == "_next":
            waits.append(delay)
            if len(waits) >= n:
                enough.set()
            delay = 0.0
        return await real_sleep(delay, *args)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    await link.start()
    try:
        if on_start is not None:
            on_start()
        await asyncio.wait_for(enough.wait(), T)
    finally:
        await link.close()
        monkeypatch.undo()
    return waits[:n]


async def test_while_replicas_say_not_leader_the_link_retries_within_a_short_cap(follower, monkeypatch) -> None:
    """The leader died (its port refuses), the followers answer not_leader (one
    still names the dead leader, as it does until the lease expires): an
    election is on and a leader is due within the lease TTL, so the waits
    between cycles stay short instead of growing to BACKOFF_MAX_S (an agent
    that slept 1.6-3 s here came back that long after the new leader)."""
    from rdzv_client.endpoints import NOT_LEADER_BACKOFF_MAX_S

    dead = f"127.0.0.1:{free_port()}"
    f = await follower(f"http://{dead}")
    c = await follower(None)
    link = AgentLink(f"{dead},{f.endpoint},{c.endpoint}", heartbeat_s=1.0)
    waits = await _waits(monkeypatch, link, 12)
    assert max(waits) <= NOT_LEADER_BACKOFF_MAX_S, waits
    assert min(waits[-4:]) >= NOT_LEADER_BACKOFF_MAX_S / 2, waits  # still jittered, still backing off
    assert len(f.hits) >= 12 and len(c.hits) >= 12


async def test_with_no_replica_answering_the_backoff_grows_as_before(follower, monkeypatch) -> None:
    from rdzv_client.endpoints import BACKOFF_MAX_S, NOT_LEADER_BACKOFF_MAX_S

    link = AgentLink(f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}", heartbeat_s=1.0)
    waits = await _waits(monkeypatch, link, 12)
    assert max(waits) > NOT_LEADER_BACKOFF_MAX_S and max(waits) <= BACKOFF_MAX_S, waits


async def test_not_leader_for_longer_than_an_election_backs_off_as_before(follower, monkeypatch) -> None:
    """etcd itself is down: every replica says not_leader for long. Past
    NOT_LEADER_FAST_S of it the link backs off as for any outage (thousands of
    agents must not poll the replicas twice a second for the whole outage)."""
    import time

    from rdzv_client.endpoints import NOT_LEADER_BACKOFF_MAX_S, NOT_LEADER_FAST_S

    f = await follower(None)
    c = await follower(None)
    link = AgentLink(f"{f.endpoint},{c.endpoint}", heartbeat_s=1.0)

    def long_down() -> None:
        link.down_since = time.monotonic() - NOT_LEADER_FAST_S - 1.0

    waits = await _waits(monkeypatch, link, 12, on_start=long_down)
    assert max(waits) > NOT_LEADER_BACKOFF_MAX_S, waits


async def test_a_leader_that_accepts_and_drops_at_once_is_not_reconnected_to_without_a_backoff(follower) -> None:
    """It names a successor in its 101, then closes at once, and the successor names it back: a drop
    before the service held (STABLE_S) is a failure of the list's walk, which backs off, not the
    successor's turn (which would bounce the link between the two without one)."""
    hits: list[str] = []

    async def flap(request: web.Request) -> web.WebSocketResponse:
        hits.append(request.path)
        ws = web.WebSocketResponse()
        ws.headers[SUCCESSOR_HEADER] = f.url
        await ws.prepare(request)
        await ws.close()
        return ws

    app = web.Application()
    app.router.add_get(AGENT_PATH, flap)
    flapper = TestServer(app, host="127.0.0.1")
    await flapper.start_server()
    f = await follower(f"http://127.0.0.1:{flapper.port}")
    link = AgentLink(f"127.0.0.1:{flapper.port},{f.endpoint}", heartbeat_s=1.0)
    try:
        await link.start()
        await asyncio.sleep(1.5)
        assert 2 <= len(hits) <= 30, len(hits)  # backs off each cycle (a loop without one: hundreds)
        assert len(f.hits) <= len(hits) + 1, (len(f.hits), len(hits))
    finally:
        await link.close()
        await flapper.close()
