"""Hostile and idle connections against a real server process.

* a WebSocket that floods small frames and never reads is closed, and the
  server's memory stays bounded and comes back (bounded send queue, error
  replies rate-limited, a send deadline);
* half-sent HTTP requests and WebSockets that never join are closed by the
  server (header-read timeout, first-join deadline), while /healthz and a real
  agent's join keep working;
* at the file-descriptor limit (the server started under ``prlimit``) the log
  stays small and /healthz answers once the flood ends;
* malformed HTTP (a 10 kB request line, 1,000 headers, garbage) gets a JSON
  4xx like every other refusal and at most one log line, no traceback.

Raw sockets (``rawnet``), loopback only; every wait has a deadline.
"""

from __future__ import annotations

import json
import re
import select
import socket
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.cluster import FaultCluster
from tests.helpers.procs import Server, free_port, wait_until

from .rawnet import connect, is_closed, rss_mb, wait_closed, ws_frame, ws_open

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HEADER_TIMEOUT_S = 10.0  # the server's defaults, which these tests rely on
JOIN_DEADLINE_S = 10.0


def _join(job_id: str, node_id: str, node_secret: str | None = None) -> str:
    msg = {
        "op": "join",
        "job_id": job_id,
        "node_id": node_id,
        "host": "flood",
        "addr": "127.0.0.1",
        "local_world_size": 1,
        "master_port": 29500,
        "spec": {"min_nodes": 1, "max_nodes": 1},
    }
    if node_secret is not None:
        msg["node_secret"] = node_secret
    return json.dumps(msg)


def _read_text_frame(s: socket.socket, timeout: float = 10.0) -> dict:
    """One unmasked text frame from the server, parsed (small frames only)."""
    s.settimeout(timeout)

    def exact(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = s.recv(n - len(data))
            if not chunk:
                raise AssertionError("the server closed the connection")
            data += chunk
        return data

    head = exact(2)
    length = head[1] & 0x7F
    if length == 126:
        length = int.from_bytes(exact(2), "big")
    elif length == 127:
        length = int.from_bytes(exact(8), "big")
    return json.loads(exact(length))


def _flood(server: Server, s: socket.socket, frame: bytes, seconds: float) -> tuple[bool, float]:
    """Send ``frame`` over and over for up to ``seconds``, never reading.
    Returns (closed by the server, peak server RSS in MB)."""
    s.setblocking(False)
    batch = frame * max(1, 65536 // len(frame))
    pending = memoryview(batch)
    peak = rss_mb(server.pid)
    deadline = time.monotonic() + seconds
    next_sample = 0.0
    while time.monotonic() < deadline:
        if time.monotonic() >= next_sample:
            peak = max(peak, rss_mb(server.pid))
            next_sample = time.monotonic() + 0.2
        _, w, _ = select.select([], [s], [], 0.2)
        if not w:
            continue
        try:
            sent = s.send(pending)
        except (BrokenPipeError, ConnectionResetError):
            return True, max(peak, rss_mb(server.pid))
        except BlockingIOError:
            continue
        pending = pending[sent:] if sent < len(pending) else memoryview(batch)
    return False, max(peak, rss_mb(server.pid))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["invalid", "unread-replies"])
def test_a_websocket_that_floods_and_never_reads_is_closed_and_memory_stays_bounded(
    fcluster: FaultCluster, tmp_path: Path, kind: str
) -> None:
    """invalid: tiny frames that are not valid messages (each would get an error reply);
    unread-replies: valid joins of a running node, each answered with its assignment, never read."""
    server = fcluster.start_server_at(free_port(), tmp_path / "data", name="server")
    base = rss_mb(server.pid)
    s = ws_open(server.port, rcvbuf=4096)
    if kind == "invalid":
        frame = ws_frame(b"x")
    else:
        s.sendall(ws_frame(_join("flood", "n0")))
        joined = _read_text_frame(s)  # the one frame read: it carries the node's secret
        assert joined["op"] == "joined" and joined.get("node_secret"), joined
        server.wait_job("flood", lambda v: v["state"] == "running", 10, "the flooding node's job running")
        # the node's own valid re-joins (with its secret): each is answered, never read
        frame = ws_frame(_join("flood", "n0", joined["node_secret"]))
    closed, peak = _flood(server, s, frame, seconds=30)
    s.close()
    assert closed, f"the flooding connection was never closed; server RSS {base:.0f} -> {peak:.0f} MB"
    assert peak - base < 100, f"server RSS grew from {base:.0f} to {peak:.0f} MB while one connection flooded"
    # replies never read fill the send queue, unless the frame rate limit (handlers: 200, then
    # 50/s) closes the flood first, as it does at line rate
    why = "too many invalid messages" if kind == "invalid" else r"send queue full|more than \d+ frames at over"
    server.wait_log(why, 10)
    # the server serves on, and what the connection held is gone
    assert server.healthy()
    wait_until(lambda: rss_mb(server.pid) - base < 50, 10, "the server's RSS back within 50 MB of its start")
    assert "Traceback" not in server.text(), server.text()[-3000:]


@pytest.mark.timeout(90)
def test_half_sent_requests_and_websockets_that_never_join_are_closed(fcluster: FaultCluster, tmp_path: Path) -> None:
    """200 half-sent HTTP requests and 200 WebSockets that never join, held at once:
    /healthz answers and a real agent joins and finishes meanwhile, and the
    server closes every one of them after its deadline."""
    server = fcluster.start_server_at(free_port(), tmp_path / "data", name="server")
    half = []
    for i in range(200):
        s = connect(server.port)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " if i % 2 else b"GET /heal")
        half.append(s)
    idle = [ws_open(server.port) for _ in range(200)]
    started = time.monotonic()
    assert server.healthy()
    agent = fcluster.start_agent(server, "real", "/bin/true", nnodes="1", flags=("--no-python",), name="real")
    assert agent.wait_exit(60) == 0, agent.text()[-3000:]
    assert server.job("real")["state"] == "succeeded"
    assert server.healthy()
    # none was closed by us; the server closes them after its deadlines
    wait_closed(half, HEADER_TIMEOUT_S + 15 - (time.monotonic() - started), "half-sent HTTP requests")
    wait_closed(idle, JOIN_DEADLINE_S + 15 - (time.monotonic() - started), "WebSockets that never joined")
    for s in half + idle:
        s.close()
    assert server.healthy()
    assert "Traceback" not in server.text(), server.text()[-3000:]


@pytest.mark.timeout(90)
def test_at_the_fd_limit_the_log_stays_small_and_health_comes_back(fcluster: FaultCluster, tmp_path: Path) -> None:
    """The server runs with 128 file descriptors; 400 clients connect and hold."""
    port = free_port()
    argv = [
        "prlimit",
        "--nofile=128:128",
        sys.executable,
        "-m",
        "rdzv_server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--data-dir",
        str(tmp_path / "data"),
    ]
    server = Server("server", fcluster._spawn("server", argv, fcluster.env()), tmp_path / "server.log", port=port)
    fcluster.procs.append(server)
    wait_until(server.healthy, 20, "the server answering /healthz")
    lines_before = len(server.text().splitlines())
    flood = []
    for i in range(400):
        try:
            s = connect(port, timeout=2)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" if i % 2 else b"")
            flood.append(s)
        except OSError:  # the backlog is full, or the server reset it: also a refusal
            pass
    # the server accepts what it can and closes what it cannot hold at once; out of
    # descriptors, asyncio retries accept() every second: give it time to see them all
    alive = list(flood)

    def within_limit():
        alive[:] = [s for s in alive if not is_closed(s)]
        return len(alive) <= 128

    try:
        wait_until(within_limit, 30, "the server to hold no more connections than it has descriptors")
    except AssertionError as e:
        raise AssertionError(f"{e}: {len(alive)} connections still open") from None
    for s in flood:
        s.close()
    wait_until(server.healthy, 20, "/healthz answering after the flood")
    new_lines = server.text().splitlines()[lines_before:]
    assert len(new_lines) <= 20, f"{len(new_lines)} log lines for one flood:\n" + "\n".join(new_lines[:40])
    assert "Traceback" not in server.text(), server.text()[-3000:]
    assert re.search(r"file descriptors: .*128", server.text()), server.text()[-3000:]


@pytest.mark.timeout(60)
def test_connections_beyond_max_connections_are_closed_at_once(fcluster: FaultCluster, tmp_path: Path) -> None:
    """--max-connections 20 and 30 clients that hold half-sent requests: 10 are closed
    at once (long before the header timeout), /healthz answers once the others go."""
    server = fcluster.start_server_at(
        free_port(), tmp_path / "data", "--max-connections", "20", "--max-connections-per-address", "0", name="server"
    )
    server.wait_log(r"at most 20 connections", 5)
    held = []
    for _ in range(30):
        s = connect(server.port)
        s.sendall(b"GET /healthz HTTP/1.1\r\n")
        held.append(s)
    alive = list(held)

    def at_cap():
        alive[:] = [s for s in alive if not is_closed(s)]
        return len(alive) <= 20

    wait_until(at_cap, HEADER_TIMEOUT_S / 2, "the connections over the limit closed")
    assert len(alive) == 20, len(alive)  # the first 20 are held until their header timeout
    server.wait_log(r"refusing new connections: 20 open, the limit is 20", 5)
    for s in held:
        s.close()
    wait_until(server.healthy, 10, "/healthz answering once the clients left")


MALFORMED = {
    "long request line": b"GET /" + b"a" * 10_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    "1000 headers": b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
    + b"".join(b"X-H%d: v\r\n" % i for i in range(1000))
    + b"\r\n",
    "garbage": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\x1b[2J garbage\r\n\r\n",
    "bad header": b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad\x01Header: \x1b[31mred\r\n\r\n",
    "bad method": b"G\x1bT /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
}


def _exchange(port: int, request: bytes) -> bytes:
    s = connect(port)
    try:
        try:
            s.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass
        data = b""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
        return data
    finally:
        s.close()


@pytest.mark.timeout(60)
def test_malformed_http_gets_a_json_4xx_and_one_log_line(fcluster: FaultCluster, tmp_path: Path) -> None:
    server = fcluster.start_server_at(free_port(), tmp_path / "data", name="server")
    for name, request in MALFORMED.items():
        lines_before = len(server.text().splitlines())
        reply = _exchange(server.port, request)
        head, _, body = reply.partition(b"\r\n\r\n")
        status_line = head.split(b"\r\n")[0]
        assert re.fullmatch(rb"HTTP/1\.[01] 4\d\d .*", status_line), f"{name}: {reply[:300]!r}"
        assert b"application/json" in head.lower(), f"{name}: {head!r}"
        doc = json.loads(body)
        assert doc["code"] == "bad_request" and doc["message"], (name, doc)
        assert "\x1b" not in doc["message"] and "\n" not in doc["message"], (name, doc)
        assert server.healthy()
        new_lines = server.text().splitlines()[lines_before:]
        assert len(new_lines) <= 1, f"{name}: {len(new_lines)} log lines:\n" + "\n".join(new_lines[:30])
        assert all("\x1b" not in ln for ln in new_lines), (name, new_lines)
    assert "Traceback" not in server.text(), server.text()[-3000:]
