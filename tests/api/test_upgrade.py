"""rdzv_server.upgrade: the agent's upgrade, taken by the server itself only
where every check of aiohttp's path passes, and the agent channel over it
(rdzv_server.own_socket) behaving as over aiohttp's: the join, heartbeats,
pings, errors, the join deadline, a close either way, the server's stop.
Everything else (a wrong token, an Origin, a cookie, a split head, any other
header) gets aiohttp's answers, as before. Through the server's own Listener
and the agent's own client (rdzv_client.wsclient)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gc
import json
import shutil
import ssl
import struct
import subprocess
import weakref
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from rdzv_client import wsclient
from rdzv_common.errors import SUCCESSOR_HEADER, NotLeaderError
from rdzv_common.protocol import AGENT_PATH, HEARTBEAT_FRAME, MAX_BODY_BYTES
from rdzv_common.wire import accept_key
from rdzv_server import early, own_socket, upgrade
from rdzv_server.app import Settings, create_app
from rdzv_server.auth import Auth
from rdzv_server.keys import STORE
from rdzv_server.listener import Listener, TakingProtocol
from rdzv_server.own_socket import OwnSocket

from .conftest import join_msg

TOKEN = "t" * 20
KEY = "dGhlIHNhbXBsZSBub25jZQ=="  # RFC 6455 1.3's example key
LINES = [
    f"GET {AGENT_PATH} HTTP/1.1",
    "Host: 127.0.0.1:29400",
    "Upgrade: websocket",
    "Connection: Upgrade",
    f"Sec-WebSocket-Key: {KEY}",
    "Sec-WebSocket-Version: 13",
]
HEAD = ("\r\n".join(LINES) + "\r\n\r\n").encode()


def _head(*extra: str, drop: str = "") -> bytes:
    lines = [ln for ln in LINES if not (drop and ln.startswith(drop))] + list(extra)
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


# ------------------------------------------------------------------ the checks, alone


def test_the_agents_head_is_read_and_what_follows_it_is_the_websockets() -> None:
    got = upgrade.request_head(HEAD + b"\x81\x85")
    assert got is not None
    headers, rest = got
    assert headers["sec-websocket-key"] == KEY and headers["host"] == "127.0.0.1:29400" and rest == b"\x81\x85"
    assert upgrade.switching(KEY) == (
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: upgrade\r\n"
        b"Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n"  # RFC 6455 1.3's answer
    )


@pytest.mark.parametrize(
    "data",
    [
        HEAD[:-2],  # the head not whole in the read
        HEAD.replace(b"GET", b"POST", 1),
        HEAD.replace(AGENT_PATH.encode(), b"/v1/jobs", 1),
        HEAD.replace(AGENT_PATH.encode(), AGENT_PATH.encode() + b"?x=1", 1),
        HEAD.replace(b"HTTP/1.1", b"HTTP/1.0", 1),
        _head("Origin: https://evil.example"),  # a browser's page: aiohttp's 403
        _head("Cookie: rdzv_session=x"),  # the /ui cookie: aiohttp's 401 on the agent path
        _head("Sec-WebSocket-Extensions: permessage-deflate"),  # compression: aiohttp negotiates it
        _head("Sec-WebSocket-Protocol: x"),
        _head("Content-Length: 0"),
        _head("Transfer-Encoding: chunked"),
        _head("User-Agent: curl/8"),  # any header an agent does not send
        _head("Host: 127.0.0.1:29400"),  # a header twice
        _head("X-Forwarded-For: 10.0.0.1"),
        _head(" folded"),  # an obsolete line folding
        _head("Authorization : Bearer x"),  # a space before the colon
        _head("Authorization: Bearer \x01x"),  # a control character
        HEAD.replace(b"Upgrade: websocket", b"Upgrade: websock\xe9t"),  # not ASCII
        _head("Authorization: Bearer x\nInjected: 1"),  # a bare line feed within a line
        _head("Authorization: Bearer " + "x" * upgrade.MAX_HEAD),  # over MAX_HEAD
    ],
)
def test_anything_but_exactly_an_agents_head_is_left_to_aiohttp(data: bytes) -> None:
    assert upgrade.request_head(data) is None, data


def _key(head: bytes, auth: Auth) -> str | None:
    got = upgrade.request_head(head)
    assert got is not None, head
    return upgrade.handshake_key(got[0], auth)


def test_the_handshake_and_the_credentials_are_checked_as_on_aiohttps_path() -> None:
    open_ = Auth(None)  # no token, on loopback: the Host check
    assert _key(HEAD, open_) == KEY
    assert _key(_head("Host: localhost", drop="Host"), open_) == KEY
    assert _key(_head("Host: evil.example:29400", drop="Host"), open_) is None  # DNS rebinding: aiohttp's 403
    assert _key(_head(drop="Host"), open_) is None
    assert _key(_head("Upgrade: h2c", drop="Upgrade"), open_) is None
    assert _key(_head("Connection: keep-alive", drop="Connection"), open_) is None
    assert _key(_head("Connection: keep-alive, Upgrade", drop="Connection"), open_) == KEY
    assert _key(_head("Sec-WebSocket-Version: 8", drop="Sec-WebSocket-Version"), open_) is None
    for bad in ("", "abc", base64.b64encode(b"x" * 15).decode(), "!" * 24):
        assert _key(_head(f"Sec-WebSocket-Key: {bad}", drop="Sec-WebSocket-Key"), open_) is None, bad
    assert _key(_head("Authorization: Bearer whatever"), open_) == KEY  # no token: none is asked for
    tokened = Auth(TOKEN, "o" * 20, listen_host="0.0.0.0")
    assert _key(HEAD, tokened) is None  # none sent: aiohttp's 401
    assert _key(_head("Authorization: Bearer wrong-token-xxxx"), tokened) is None  # wrong: its 401, throttle, audit
    assert _key(_head("Authorization: Basic " + TOKEN), tokened) is None
    assert _key(_head("Authorization: Bearer " + TOKEN), tokened) == KEY
    assert _key(_head("Authorization: bearer " + "o" * 20), tokened) == KEY  # the operator token is every role
    assert _key(_head("Host: anything.example", "Authorization: Bearer " + TOKEN, drop="Host"), tokened) == KEY


# ------------------------------------------------------------------ through the Listener


@contextlib.asynccontextmanager
async def _server(
    settings: Settings | None = None, tls: ssl.SSLContext | None = None
) -> AsyncIterator[tuple[int, Any, upgrade.Upgrader]]:
    """A server's app behind the Listener, taking agent upgrades and refusing them early while
    a replica does not serve (as rdzv_server.__main__ runs it)."""
    app = create_app(settings or Settings(data_dir=None))
    upgrades = upgrade.Upgrader(app)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    try:
        refuse = early.Refuser(app)
        site = Listener(runner, "127.0.0.1", 0, ssl_context=tls, take=upgrades, refuse=refuse, header_timeout_s=1.0)
        await site.start()
        yield site.sockets[0].getsockname()[1], app, upgrades
    finally:
        await runner.cleanup()


async def _agent(
    port: int, headers: dict[str, str] | None = None, tls: ssl.SSLContext | None = None
) -> wsclient.WebSocket:
    return await wsclient.connect("127.0.0.1", port, AGENT_PATH, headers=headers or {}, ssl=tls, timeout=5.0)


async def _recv(ws: wsclient.WebSocket) -> dict:
    text = await asyncio.wait_for(ws.recv(), 5.0)
    assert text is not None, (ws.close_code, ws.close_reason)
    return json.loads(text)


async def _until(cond, what: str) -> None:
    for _ in range(500):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(what)


async def test_an_agent_joins_heartbeats_pings_and_leaves_over_the_servers_own_upgrade() -> None:
    async with _server() as (port, app, upgrades):
        ws = await _agent(port)
        await _until(lambda: len(upgrades.open) == 1, "the upgrade was not taken")  # not aiohttp's
        await ws.send_str(join_msg("j", "n0", (1, 1)).model_dump_json())
        joined, assigned = await _recv(ws), await _recv(ws)
        assert joined["op"] == "joined" and assigned["op"] == "assigned", (joined, assigned)
        assert assigned["assignment"]["group_rank"] == 0
        store = app[STORE]
        seen = store.jobs["j"].nodes["n0"].last_seen
        await asyncio.sleep(0.02)
        await ws.send_str(HEARTBEAT_FRAME)
        await _until(lambda: store.jobs["j"].nodes["n0"].last_seen > seen, "the heartbeat did not count")
        await ws._send(wsclient.OP_PING, b"p")  # answered (the client takes the pong)
        await ws.send_str("not json")
        err = await _recv(ws)
        assert err["op"] == "error" and err["code"] == "validation_error", err
        chan = store.channels[("j", "n0")]
        await ws.close()
        await _until(lambda: not upgrades.open, "the connection's loop did not end")
        assert ("j", "n0") not in store.channels and chan.killed is False
        assert not store.jobs["j"].nodes["n0"].connected


async def test_a_join_sent_with_the_head_is_the_websockets_first_frame() -> None:
    async with _server() as (port, _, upgrades):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        frame = wsclient.encode_frame(wsclient.OP_TEXT, join_msg("j", "n0", (1, 1)).model_dump_json().encode())
        writer.write(HEAD + frame)
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
        assert answer.startswith(b"HTTP/1.1 101 ") and accept_key(KEY).encode() in answer, answer
        head = await asyncio.wait_for(reader.readexactly(2), 5.0)
        n = head[1] if head[1] < 126 else struct.unpack("!H", await reader.readexactly(2))[0]
        assert json.loads(await reader.readexactly(n))["op"] == "joined"
        assert len(upgrades.open) == 1
        writer.close()


async def test_what_fails_a_check_gets_aiohttps_answers() -> None:
    async with _server(Settings(data_dir=None, token=TOKEN, listen_host="0.0.0.0")) as (port, _, upgrades):
        with pytest.raises(wsclient.HandshakeError) as e:
            await _agent(port, {"Authorization": "Bearer wrong-token-xxxx"})
        assert e.value.status == 401 and "Server" in {k.title() for k in e.value.headers}, e.value.headers
        with pytest.raises(wsclient.HandshakeError) as e:
            await _agent(port, {"Authorization": f"Bearer {TOKEN}", "Origin": "https://evil.example"})
        assert e.value.status == 403
        ws = await _agent(port, {"Authorization": f"Bearer {TOKEN}"})
        await _until(lambda: len(upgrades.open) == 1, "the right token's upgrade was not taken")
        await ws.close()
        # another header than an agent's: aiohttp's upgrade, which works as ever
        ws = await _agent(port, {"Authorization": f"Bearer {TOKEN}", "User-Agent": "curl/8"})
        await ws.send_str(join_msg("k", "n0", (1, 1)).model_dump_json())
        assert (await _recv(ws))["op"] == "joined"
        await ws.close()


async def test_a_head_split_over_reads_is_upgraded_by_aiohttp() -> None:
    async with _server() as (port, _, upgrades):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HEAD[:20])
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.write(HEAD[20:])
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
        assert answer.startswith(b"HTTP/1.1 101 ") and b"Server:" in answer, answer  # aiohttp names itself
        assert not upgrades.open
        writer.close()


class Leading:
    """What the store asks of an HA replica for an upgrade (rdzv_server.ha.Replica): whether it
    serves, its successor, its refusal while it does not."""

    leader_url = None

    def __init__(self, successor: str | None, serving: bool = True) -> None:
        self.successor_url, self.serving = successor, serving

    def refusal(self) -> NotLeaderError:
        return NotLeaderError("this replica was just elected leader and is loading the state; retry")


async def test_a_connection_accepted_before_the_replica_serves_is_refused_or_taken_at_its_first_read() -> None:
    """A failover: thousands of connections are accepted while the new leader loads and read after
    it serves. Read while it does not serve: refused early (503 not_leader); read once it serves:
    taken by the server's own upgrade, not left to aiohttp's slower path."""
    async with _server() as (port, app, upgrades):
        app[STORE].replica = loading = Leading(None, serving=False)
        try:
            refused_r, refused_w = await asyncio.open_connection("127.0.0.1", port)
            taken_r, taken_w = await asyncio.open_connection("127.0.0.1", port)
            await asyncio.sleep(0.1)  # both accepted while it does not serve
            refused_w.write(HEAD)
            answer = await asyncio.wait_for(refused_r.read(), 5.0)  # to EOF: closed after the answer
            assert answer.startswith(b"HTTP/1.1 503 ") and b"not_leader" in answer and b"Server:" not in answer
            loading.serving = True  # elected and loaded: it serves
            taken_w.write(HEAD)
            head = await asyncio.wait_for(taken_r.readuntil(b"\r\n\r\n"), 5.0)
            assert head.startswith(b"HTTP/1.1 101 ") and b"Server:" not in head, head  # not aiohttp's (it names itself)
            await _until(lambda: len(upgrades.open) == 1, "the upgrade was not taken")
            for w in (refused_w, taken_w):
                w.close()
        finally:
            app[STORE].replica = None


async def test_an_ha_leader_names_its_successor_in_the_101_on_both_paths() -> None:
    """X-Rdzv-Successor (rdzv_server.ha_peers) in the server's own 101 and in aiohttp's; none
    without a successor (a lone replica, or not HA), and the agent's client keeps it."""
    successor = "http://rdzv-1.rdzv:29400"
    async with _server() as (port, app, upgrades):
        ws = await _agent(port)
        assert SUCCESSOR_HEADER.lower() not in ws.headers, ws.headers  # not HA
        await ws.close()
        app[STORE].replica = Leading(successor)
        try:
            ws = await _agent(port)
            await _until(lambda: len(upgrades.open) == 1, "the upgrade was not taken")
            assert ws.headers[SUCCESSOR_HEADER.lower()] == successor
            await ws.close()
            ws = await _agent(port, {"User-Agent": "curl/8"})  # aiohttp's path
            assert ws.headers[SUCCESSOR_HEADER.lower()] == successor and "server" in ws.headers
            await ws.close()
            app[STORE].replica = Leading(None)
            ws = await _agent(port)
            assert SUCCESSOR_HEADER.lower() not in ws.headers, ws.headers
            await ws.close()
        finally:
            app[STORE].replica = None


async def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout() -> None:
    async with _server() as (port, _, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(reader.read(), 4.0) == b""  # closed (header timeout 1 s here)
        writer.close()


async def test_a_taken_connection_that_never_joins_is_closed_at_the_join_deadline() -> None:
    async with _server(Settings(data_dir=None, join_deadline_s=0.3)) as (port, _, upgrades):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HEAD)
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)).startswith(b"HTTP/1.1 101 ")
        assert len(upgrades.open) == 1
        why = b"no join within 0.3s"  # the close frame says why, as on aiohttp's path
        assert await asyncio.wait_for(reader.read(), 5.0) == bytes((0x88, 2 + len(why))) + struct.pack("!H", 1008) + why
        await _until(lambda: not upgrades.open, "the connection's loop did not end")
        writer.close()


async def test_frames_against_the_rules_close_the_connection_with_their_code() -> None:
    async with _server() as (port, _, _):
        ws = await _agent(port)
        ws._writer.write(bytes((0x83, 0x80)) + b"mask")  # a reserved opcode (3), masked, empty
        assert await asyncio.wait_for(ws.recv(), 5.0) is None
        assert ws.close_code == 1002, ws.close_code
        ws = await _agent(port, {})
        ws.max_msg_size = 1 << 30
        big = "x" * (MAX_BODY_BYTES + 1)
        await ws.send_str(big)
        assert await asyncio.wait_for(ws.recv(), 5.0) is None
        assert ws.close_code == 1009, ws.close_code


async def test_the_servers_stop_closes_the_connections_it_took() -> None:
    async with _server() as (port, app, upgrades):
        ws = await _agent(port)
        await ws.send_str(join_msg("j", "n0", (2, 2)).model_dump_json())
        assert (await _recv(ws))["op"] == "joined"
        idle = await _agent(port)
        await _until(lambda: len(upgrades.open) == 2, "not taken")
        socks = list(upgrades.open)
        assert all(isinstance(s, OwnSocket) for s in socks)
        assert all(isinstance(s.protocol, TakingProtocol) for s in socks)
    # (the runner cleaned up: both connections closed, by the server)
    for conn in (ws, idle):
        while await asyncio.wait_for(conn.recv(), 5.0) is not None:  # (a status it was sent before)
            pass
        assert conn.close_code == 1000, conn.close_code
    assert not upgrades.open


async def test_a_closed_connection_is_freed_by_reference_counting_alone() -> None:
    """No cycle left once it closed (socket, protocol, reader, the channel's loop): what a
    reconnect storm made is frozen by rdzv_server.gc_policy, and a cycle frozen with it would
    wait for the valve."""
    async with _server() as (port, _, upgrades):
        gc.disable()
        try:
            ws = await _agent(port)
            await ws.send_str(join_msg("j", "n0", (1, 1)).model_dump_json())
            assert (await _recv(ws))["op"] == "joined"
            await _until(lambda: len(upgrades.open) == 1, "not taken")
            sock = next(iter(upgrades.open))
            probes = [weakref.ref(sock), weakref.ref(sock.protocol), weakref.ref(sock._parser)]
            del sock
            await ws.close()
            await _until(lambda: all(p() is None for p in probes), "not freed without the collector")
        finally:
            gc.enable()


async def test_the_servers_probe_of_a_silent_node_is_a_ping_on_its_connection() -> None:
    """rdzv_server.suspicion probes a node with a WebSocket ping (its kernel acknowledges it even
    while the agent is frozen): written on a connection this path took too."""
    async with _server() as (port, app, upgrades):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        frame = wsclient.encode_frame(wsclient.OP_TEXT, join_msg("j", "n0", (2, 2)).model_dump_json().encode())
        writer.write(HEAD + frame)
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
        await _until(lambda: ("j", "n0") in app[STORE].channels, "not joined")
        chan = app[STORE].channels[("j", "n0")]
        assert isinstance(chan.ws, OwnSocket)
        await chan.ws.ping(b"probe")
        data = b""
        while b"\x89\x05probe" not in data:  # after the joined (and any status) before it
            data += await asyncio.wait_for(reader.read(4096), 5.0)
        writer.close()


async def _upgraded(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(HEAD)
    assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)).startswith(b"HTTP/1.1 101 ")
    return reader, writer


async def test_pings_from_an_agent_that_never_reads_do_not_pile_up_in_the_server() -> None:
    """Each pong waits for the transport to drain, as aiohttp's does: the server stops reading
    the pings rather than holding every pong (12.5 MB of pings were ~9.7 MB of pongs held)."""
    async with _server() as (port, _, upgrades):
        reader, writer = await _upgraded(port)
        await _until(lambda: len(upgrades.open) == 1, "not taken")
        sock = next(iter(upgrades.open))
        ping = wsclient.encode_frame(wsclient.OP_PING, b"p" * 125)
        writer.write(ping * 100_000)  # ~13 MB, never read back
        held = 0
        for _ in range(20):
            await asyncio.sleep(0.05)
            held = max(held, sock.transport.get_write_buffer_size())
        assert held < 1 << 20, held
        writer.transport.abort()


async def test_a_connection_whose_first_read_comes_as_the_server_stops_is_closed() -> None:
    async with _server() as (port, app, upgrades):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.sleep(0.05)  # accepted, nothing sent yet
        await upgrades.shutdown(app)
        writer.write(HEAD)
        assert await asyncio.wait_for(reader.read(), 5.0) == b""  # no 101, nothing aiohttp's either
        assert not upgrades.open
        writer.close()


async def test_after_its_close_frame_the_server_reads_on_until_the_agent_closes(monkeypatch) -> None:
    """A socket closed with unread bytes resets, and the agent could lose the close frame and the
    messages before it: the server reads on (dropping it) until the agent closes, or LINGER_S."""
    monkeypatch.setattr(own_socket, "LINGER_S", 0.5)
    async with _server(Settings(data_dir=None, join_deadline_s=0.2)) as (port, _, upgrades):
        reader, writer = await _upgraded(port)
        close = await asyncio.wait_for(reader.readexactly(2), 5.0)
        assert close[0] == 0x88, close  # the join deadline's close frame
        await asyncio.wait_for(reader.readexactly(close[1]), 5.0)
        frame = wsclient.encode_frame(wsclient.OP_TEXT, b"x" * 1000)
        for _ in range(20):  # an agent still sending after it: read and dropped, no reset
            writer.write(frame)
            await asyncio.sleep(0.01)
        assert await asyncio.wait_for(reader.read(), 5.0) == b""  # closed cleanly after LINGER_S
        await _until(lambda: not upgrades.open, "the connection's loop did not end")
        writer.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
async def test_over_tls_the_agents_upgrade_is_taken_too(tmp_path) -> None:
    """rdzv-server --tls-cert/--tls-key: the first read is the decrypted head, the same path."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        + ["-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"]
        + ["-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
        timeout=30,
    )
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cafile=str(cert))
    async with _server(tls=server_ctx) as (port, _, upgrades):
        ws = await _agent(port, tls=client_ctx)
        await _until(lambda: len(upgrades.open) == 1, "the upgrade over TLS was not taken")
        await ws.send_str(join_msg("j", "n0", (1, 1)).model_dump_json())
        assert [(await _recv(ws))["op"] for _ in range(2)] == ["joined", "assigned"]
        await ws.close()
        await _until(lambda: not upgrades.open, "the connection's loop did not end")
