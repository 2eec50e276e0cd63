"""``rdzv status`` / ``rdzv close`` as a user runs them: ``python -m
rdzv_client.cli`` subprocesses against a real ``rdzv-server`` subprocess,
whose jobs are made by agents simulated over the WebSocket (protocol.JoinMsg).

Errors must be one clear line on stderr with a non-zero exit, never a
traceback.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import re
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from rdzv_common.protocol import AGENT_PATH, SERVER_MESSAGE, JobSpec, JobView, JoinMsg
from tests.helpers.procs import Server, free_port, start_server

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "s3cret-token-for-the-cli"
CLI_TIMEOUT_S = 15.0
WATCH_HEADER = re.compile(r"^\d\d:\d\d:\d\d  rdzv status ", re.M)


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RDZV_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra or {})
    return env


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    s = start_server(tmp_path_factory.mktemp("server"), env=_env())
    yield s
    s.stop()


@pytest.fixture(scope="module")
def token_server(tmp_path_factory: pytest.TempPathFactory):
    s = start_server(tmp_path_factory.mktemp("token-server"), "--token", TOKEN, env=_env())
    yield s
    s.stop()


class Agent:
    """One simulated agent: joins over the WebSocket, heartbeats, keeps every message."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.msgs: list = []
        self.arrived = asyncio.Event()
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._beat())]

    async def _read(self) -> None:
        async for frame in self.ws:
            if frame.type == aiohttp.WSMsgType.TEXT:
                self.msgs.append(SERVER_MESSAGE.validate_json(frame.data))
                self.arrived.set()

    async def _beat(self) -> None:
        while not self.ws.closed:
            await asyncio.sleep(1.0)
            try:
                await self.ws.send_str('{"op":"hb"}')
            except (ConnectionError, RuntimeError):
                return

    async def wait_for(self, op: str, timeout: float = 5.0):
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            hit = next((m for m in self.msgs if m.op == op), None)
            if hit is not None:
                return hit
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise AssertionError(f"no {op!r} message within {timeout:g}s; got {self.msgs!r}")
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), left)
            except asyncio.TimeoutError:
                pass

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.ws.close()


@pytest.fixture
async def agents():
    session = aiohttp.ClientSession()
    opened: list[Agent] = []

    async def join(
        server: Server, job_id: str, host: str, nnodes: tuple[int, int], token: str | None = None, nproc: int = 2
    ) -> Agent:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        agent = Agent(await session.ws_connect(f"ws://{server.endpoint}{AGENT_PATH}", headers=headers))
        opened.append(agent)
        await agent.ws.send_str(
            JoinMsg(
                job_id=job_id,
                node_id=f"{host}-1-abcdef",
                host=host,
                addr="127.0.0.1",
                local_world_size=nproc,
                master_port=free_port(),
                spec=JobSpec(min_nodes=nnodes[0], max_nodes=nnodes[1]),
            ).model_dump_json()
        )
        await agent.wait_for("joined")
        return agent

    yield join
    for agent in opened:
        await agent.close()
    await session.close()


async def rdzv(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """``python -m rdzv_client.cli ARGS``: (exit status, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "rdzv_client.cli",
        *args,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(env),
        start_new_session=True,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), CLI_TIMEOUT_S)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"rdzv {' '.join(args)} did not finish within {CLI_TIMEOUT_S:g}s") from None
    return proc.returncode, out.decode(), err.decode()


def _one_error_line(rc: int, out: str, err: str, *needles: str) -> None:
    assert rc == 1, (rc, out, err)
    assert out == "", out
    assert err.endswith("\n") and err.count("\n") == 1, f"not one line: {err!r}"
    assert err.startswith("rdzv: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


def _row(table: str, first: str) -> list[str]:
    return next(ln.split() for ln in table.splitlines() if ln.split()[:1] == [first])


# ------------------------------------------------------------------- tests


async def test_status_lists_shows_and_closes_a_job(server: Server, agents) -> None:
    a = await agents(server, "live", "node1", (2, 2))
    b = await agents(server, "live", "node2", (2, 2))
    spare = await agents(server, "live", "node3", (2, 2))
    for agent in (a, b):
        await agent.wait_for("assigned")
    await spare.wait_for("spare")
    await agents(server, "forming", "node7", (2, 3), nproc=1)
    ep = ("--endpoint", server.endpoint)

    (rc1, listing, e1), (rc2, shown, e2), (rc3, raw, e3), (rc4, forming, e4) = await asyncio.gather(
        rdzv(*ep, "status"),
        rdzv(*ep, "status", "live"),
        rdzv(*ep, "status", "live", "--json"),
        rdzv(*ep, "status", "forming"),
    )
    assert (rc1, rc2, rc3, rc4) == (0, 0, 0, 0), (e1, e2, e3, e4)
    assert e1 == e2 == e3 == e4 == ""

    # every job, one line each
    assert listing.splitlines()[0].split() == ["JOB", "STATE", "ROUND", "NODES", "MIN:MAX", "WORLD", "RESTARTS"]
    # NODES is the summary's count, which (rounds.summary) counts the spare too
    summary = {j["job_id"]: j for j in server.get("/v1/jobs")["jobs"]}
    assert _row(listing, "live") == ["live", "running", "0", str(summary["live"]["nodes"]), "2:2", "4", "0/3"]
    assert _row(listing, "forming") == ["forming", "waiting", "0", "1", "2:3", "0", "0/3"]

    # one job: ranks, spare, history
    lines = shown.splitlines()
    assert lines[0] == "job live: running, round 0, world size 4, nodes 2 (min 2, max 2), spares 1, restarts 0/3"
    assert re.fullmatch(r"master 127\.0\.0\.1:\d+", lines[1]), lines[1]
    assert _row(shown, "0")[:6] == ["0", "node1-1-abcdef", "node1", "127.0.0.1", "running", "2"]
    assert _row(shown, "1")[:6] == ["1", "node2-1-abcdef", "node2", "127.0.0.1", "running", "2"]
    assert _row(shown, "-")[:6] == ["-", "node3-1-abcdef", "node3", "127.0.0.1", "spare", "2"]
    assert "ROUND  OPENED" in shown and "FORMED IN" in shown
    hist = _row(shown, "ROUND")
    assert hist[:3] == ["ROUND", "OPENED", "FORMED"]
    row0 = next(ln for ln in lines if re.match(r"^0\s+\d\d:\d\d:\d\d\.\d{3}\s", ln))
    assert re.search(r"\d+ ms\s+4\s+job created$", row0), row0

    # --json is the REST view, valid against the model
    view = JobView.model_validate_json(raw)
    rest = server.get("/v1/jobs/live")
    got = json.loads(raw)
    for doc in (got, rest):
        for n in doc["nodes"] + doc["spares"]:
            n.pop("last_seen_s")
    assert got == rest
    assert (view.job_id, view.world_size, [n.group_rank for n in view.nodes]) == ("live", 4, [0, 1])

    # a forming round says what it waits for
    assert forming.splitlines()[0].startswith("job forming: waiting, round 0")
    assert any(ln.startswith("waiting for: ") and "more node" in ln for ln in forming.splitlines()), forming

    # close: the state says closed, and the agents hear it at once
    rc, out, err = await rdzv(*ep, "close", "live")
    assert (rc, out, err) == (0, "job live: closed\n", "")
    assert server.get("/v1/jobs/live")["state"] == "closed"
    for agent in (a, b, spare):
        done = await agent.wait_for("done")
        assert done.state == "closed"


async def test_errors_are_one_line_and_exit_1(server: Server, tmp_path: Path) -> None:
    down = f"127.0.0.1:{free_port()}"  # nothing listens there

    # a port that answers HTTP 200 with something that is not rdzv's JSON
    class Foreign(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"<html>hello</html>"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    foreign = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Foreign)
    thread = threading.Thread(target=foreign.serve_forever, daemon=True)
    thread.start()
    try:
        results = await asyncio.gather(
            rdzv("--endpoint", down, "status"),
            rdzv("--endpoint", server.endpoint, "status", "no-such-job"),
            rdzv("--endpoint", server.endpoint, "close", "no-such-job"),
            rdzv("--endpoint", f"127.0.0.1:{foreign.server_address[1]}", "status"),
        )
    finally:
        foreign.shutdown()
        foreign.server_close()
        thread.join(5)
    _one_error_line(*results[0], "cannot reach rdzv server", down)
    _one_error_line(*results[1], "no-such-job")
    _one_error_line(*results[2], "no-such-job")
    _one_error_line(*results[3], "unexpected answer")


async def test_token_and_environment_variables(token_server: Server, agents) -> None:
    a = await agents(token_server, "secured", "node1", (1, 1), token=TOKEN)
    await a.wait_for("assigned")
    ep = token_server.endpoint
    no_token, bad_token, by_env = await asyncio.gather(
        rdzv("--endpoint", ep, "status"),
        rdzv("close", "secured", env={"RDZV_ENDPOINT": ep, "RDZV_TOKEN": "wrong"}),
        rdzv("status", "secured", env={"RDZV_ENDPOINT": ep, "RDZV_TOKEN": TOKEN}),
    )
    _one_error_line(*no_token, "token")
    _one_error_line(*bad_token, "token")
    assert by_env[0] == 0 and by_env[1].startswith("job secured: running, round 0, world size 2"), by_env
    assert token_server.get("/v1/jobs/secured", token=TOKEN)["state"] == "running", "a refused close changed state"
    # flags win over the environment
    rc, out, err = await rdzv(
        "--endpoint",
        ep,
        "--token",
        TOKEN,
        "close",
        "secured",
        env={"RDZV_ENDPOINT": "127.0.0.1:1", "RDZV_TOKEN": "wrong"},
    )
    assert (rc, out, err) == (0, "job secured: closed\n", "")


async def test_watch_refreshes_until_terminated(server: Server, agents) -> None:
    a = await agents(server, "watched", "node1", (1, 1))
    await a.wait_for("assigned")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "rdzv_client.cli",
        "--endpoint",
        server.endpoint,
        "status",
        "watched",
        "--watch",
        "--interval",
        "0.5",
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
        start_new_session=True,
    )
    out = b""
    try:
        out += await asyncio.wait_for(proc.stdout.readline(), CLI_TIMEOUT_S)  # the first refresh began
        server_close = asyncio.get_running_loop().run_in_executor(
            None,
            lambda: urllib.request.urlopen(
                urllib.request.Request(f"{server.url}/v1/jobs/watched/close", method="POST", data=b""), timeout=5
            ).close(),
        )
        deadline = asyncio.get_running_loop().time() + 2.5
        while (left := deadline - asyncio.get_running_loop().time()) > 0:
            try:
                chunk = await asyncio.wait_for(proc.stdout.read(4096), left)
            except asyncio.TimeoutError:
                break
            if not chunk:
                break  # it exited: the assertion below says so
            out += chunk
        await server_close
        assert proc.returncode is None, f"--watch stopped on its own: {proc.returncode}"
    finally:
        if proc.returncode is None:
            proc.terminate()
        rest, err = await asyncio.wait_for(proc.communicate(), 10)
    text = (out + rest).decode()
    refreshes = WATCH_HEADER.findall(text)
    assert len(refreshes) >= 3, text
    assert "\x1b[" not in text, "no screen control codes when stdout is not a terminal"
    assert "job watched: running" in text and "job watched: closed" in text, text
    assert b"Traceback" not in err, err.decode()


async def test_delete_refuses_a_live_job_then_forgets_it_once_closed(server: Server, agents) -> None:
    """`rdzv delete` of a running job: one line saying to close it first, exit 1;
    after `rdzv close` it deletes, and `rdzv status --state closed` no longer lists it."""
    a = await agents(server, "old", "node1", (1, 1))
    await a.wait_for("assigned")
    await agents(server, "other", "node1", (2, 2))
    ep = ("--endpoint", server.endpoint)
    _one_error_line(*await rdzv(*ep, "delete", "old"), "close it first")
    assert server.get("/v1/jobs/old")["state"] == "running"
    assert (await rdzv(*ep, "close", "old"))[0] == 0
    rc, listing, err = await rdzv(*ep, "status", "--state", "closed")
    assert rc == 0 and _row(listing, "old")[:2] == ["old", "closed"] and "other" not in listing, (listing, err)
    assert await rdzv(*ep, "delete", "old") == (0, "job old: deleted (it had closed)\n", "")
    rc, listing, _ = await rdzv(*ep, "status")
    assert rc == 0 and "old" not in listing and _row(listing, "other")[:2] == ["other", "waiting"]
    _one_error_line(*await rdzv(*ep, "delete", "old"), "no job 'old'")
