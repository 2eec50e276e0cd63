"""rdzv_server.early: on a replica that does not serve, the agent's upgrade is
answered before aiohttp parses it, with what leader_middleware answers; and
anything else, or the same while the replica serves, takes aiohttp's path.
Through the server's own Listener and the agent's own client (aiohttp)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import aiohttp
from aiohttp import web

from rdzv_common.errors import LEADER_HEADER, NotLeaderError
from rdzv_common.protocol import AGENT_PATH
from rdzv_server import early
from rdzv_server.app import Settings, create_app
from rdzv_server.conns import Protocol
from rdzv_server.keys import STORE
from rdzv_server.listener import EarlyProtocol, Listener

LEADER = "http://10.0.0.7:29400"
HEAD = f"GET {AGENT_PATH} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n".encode()


class FakeReplica:
    """What the store asks of an HA replica (rdzv_server.ha.Replica): whether it serves, its refusal."""

    def __init__(self, leader: str | None = LEADER, serving: bool = False) -> None:
        self.leader, self.serving, self.asked = leader, serving, 0
        self.successor_url: str | None = None  # (what /healthz and a leader's 101 name)

    @property
    def leader_url(self) -> str | None:  # (what /healthz names)
        return self.leader

    def refusal(self) -> NotLeaderError:
        self.asked += 1
        why = f"this replica is not the leader; the leader is {self.leader}" if self.leader else "no leader is known"
        return NotLeaderError(why, leader=self.leader)


def _app(replica: FakeReplica | None) -> Any:
    return {STORE: SimpleNamespace(replica=replica, serving=replica is None or replica.serving)}


def _parse(answer: bytes) -> tuple[str, dict[str, str], dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status, *lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines)
    assert int(headers["Content-Length"]) == len(body)
    return status, headers, json.loads(body)


def test_the_upgrade_on_a_replica_that_does_not_serve_is_answered() -> None:
    replica = FakeReplica()
    refuse = early.Refuser(_app(replica))
    status, headers, body = _parse(refuse(HEAD) or b"")
    assert status == "HTTP/1.1 503 Service Unavailable"
    assert headers[LEADER_HEADER] == LEADER and headers["Connection"] == "close", headers
    assert body == {"code": "not_leader", "message": f"this replica is not the leader; the leader is {LEADER}"}
    assert refuse(HEAD) is refuse(HEAD), "one answer per state, not one per node"
    replica.leader = None  # an election: no leader named
    status, headers, body = _parse(refuse(HEAD) or b"")
    assert status.startswith("HTTP/1.1 503") and LEADER_HEADER not in headers and body["code"] == "not_leader"


def test_anything_else_takes_aiohttps_path() -> None:
    refuse = early.Refuser(_app(FakeReplica()))
    for data in (
        HEAD[:-2],  # the head split over reads
        HEAD + b"\x81\x80abcd",  # bytes after it
        HEAD.replace(b"GET", b"POST", 1),
        HEAD.replace(AGENT_PATH.encode(), b"/v1/jobs", 1),
        HEAD.replace(AGENT_PATH.encode(), AGENT_PATH.encode() + b"?x=1", 1),
        HEAD.replace(b"HTTP/1.1", b"HTTP/1.0", 1),
    ):
        assert refuse(data) is None, data
    assert early.Refuser(_app(FakeReplica(serving=True)))(HEAD) is None  # it leads
    assert early.Refuser(_app(None))(HEAD) is None  # no HA
    assert early.Refuser(_app(FakeReplica(leader="http://a\r\nSet-Cookie: x=1")))(HEAD) is None


@contextlib.asynccontextmanager
async def _replica(replica: FakeReplica) -> AsyncIterator[tuple[int, Listener]]:
    """A server (its app, the Listener with an early.Refuser) whose store is ``replica``'s."""
    app = create_app(Settings())
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        app[STORE].replica = replica  # type: ignore[assignment]  # (after the store opened: as a follower's)
        site = Listener(runner, "127.0.0.1", 0, refuse=early.Refuser(app))
        await site.start()
        yield site.sockets[0].getsockname()[1], site
    finally:
        app[STORE].replica = None
        await runner.cleanup()


async def _raw(port: int, data: bytes) -> bytes:
    """``data`` sent on a new connection; what came back until the server closed it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        return await asyncio.wait_for(reader.read(), 5.0)  # to EOF: the server closed it
    finally:
        writer.close()


async def test_the_agents_client_gets_what_aiohttps_path_answers() -> None:
    """The agent's client (aiohttp's ws_connect) is refused with the leader named, as a REST call
    through the middlewares is, and that answer came from the early path (the connection closed)."""
    replica = FakeReplica()
    async with _replica(replica) as (port, site), aiohttp.ClientSession() as http:
        base = f"http://127.0.0.1:{port}"
        try:
            await http.ws_connect(base + AGENT_PATH)
            raise AssertionError("the upgrade was accepted")
        except aiohttp.WSServerHandshakeError as e:
            headers = e.headers or {}
            assert e.status == 503 and headers.get(LEADER_HEADER) == LEADER, e
            assert "Server" not in headers, headers  # the early answer's, not aiohttp's (which names itself)
        async with http.get(base + "/v1/jobs") as resp:  # aiohttp's path: leader_middleware
            assert resp.status == 503 and resp.headers[LEADER_HEADER] == LEADER and "Server" in resp.headers
            rest = await resp.json()
        assert _parse(await _raw(port, HEAD))[2] == rest
        async with http.get(base + "/healthz") as resp:  # any replica answers it
            assert resp.status == 200
        # the connections it answered are counted out as they close
        kw = site._handler_kwargs
        await http.close()
        for _ in range(100):
            if kw["open_count"].n == 0:
                break
            await asyncio.sleep(0.01)
        assert kw["open_count"].n == 0 and kw["by_address"] == {}, (kw["open_count"].n, kw["by_address"])


async def test_it_comes_before_the_host_and_origin_checks_and_says_only_what_healthz_says() -> None:
    """A foreign Origin and a Host no loopback server answers (403 through the middlewares, while
    the replica serves) get the same not_leader, which /healthz tells anyone: who leads."""
    replica = FakeReplica()
    async with _replica(replica) as (port, _):
        foreign = HEAD.replace(b"Host: x\r\n", b"Host: evil.example\r\nOrigin: https://evil.example\r\n")
        assert foreign != HEAD
        status, headers, body = _parse(await _raw(port, foreign))
        assert status.startswith("HTTP/1.1 503") and headers[LEADER_HEADER] == LEADER and body["code"] == "not_leader"
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/healthz") as resp:
            assert (await resp.json())["leader"] == LEADER


async def test_a_connection_accepted_while_the_replica_serves_is_aiohttps() -> None:
    """Accepted while serving: a plain conns.Protocol (no extra call per read), and the upgrade is
    aiohttp's: accepted (101)."""
    replica = FakeReplica(serving=True)
    async with _replica(replica) as (port, site), aiohttp.ClientSession() as http:
        ws = await http.ws_connect(f"http://127.0.0.1:{port}{AGENT_PATH}")
        await ws.close()
        assert replica.asked == 0
        made = site._protocol()
        assert type(made) is Protocol, type(made)
        replica.serving = False
        assert type(site._protocol()) is EarlyProtocol


async def test_a_failing_early_answer_leaves_the_request_to_aiohttp(caplog) -> None:
    """A bug in the early answer costs one log line, not the request: aiohttp's path answers."""
    replica = FakeReplica()

    def broken() -> NotLeaderError:
        raise RuntimeError("a bug")

    replica.refusal = broken  # type: ignore[method-assign]
    async with _replica(replica) as (port, _), aiohttp.ClientSession() as http:
        try:
            await http.ws_connect(f"http://127.0.0.1:{port}{AGENT_PATH}")
            raise AssertionError("the upgrade was accepted")
        except aiohttp.WSServerHandshakeError as e:
            assert e.status == 500, e  # leader_middleware met the same bug, through aiohttp's error path
    assert any("the early answer to a request failed (RuntimeError('a bug'))" in r.getMessage() for r in caplog.records)
