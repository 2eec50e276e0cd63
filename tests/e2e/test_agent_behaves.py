"""Agents and the CLI that behave (issue 13): signals, giving up on a dead
server, root causes that name the error, escaped text from the network,
a bad server message. Real server, real agents, real workers."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cluster import Cluster
from tests.helpers.procs import ROOT, Proc, Server, alive, free_port, wait_until

pytestmark = pytest.mark.e2e

READY_RE = r"^\[(\d+)\]: ready rank \d+ pid (\d+)$"


def _worker_pids(agent: Proc, count: int = 1, timeout: float = 30.0) -> list[int]:
    return [int(m.group(2)) for m in agent.wait_log(READY_RE, timeout, count=count)]


def _no_traceback(agent: Proc) -> None:
    assert "Traceback" not in agent.text(), agent.text()[-3000:]


def rdzv(cluster: Cluster, *argv: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
    """The ``rdzv`` command, to its end."""
    return subprocess.run(
        [sys.executable, "-m", "rdzv_client.cli", *argv],
        capture_output=True,
        text=True,
        env=cluster.env(),
        cwd=ROOT,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


# ------------------------------------------------------------------ signals


@pytest.mark.timeout(90)
def test_second_sigint_kills_workers_that_ignore_signals(cluster: Cluster) -> None:
    """Ctrl-C twice: the second one kills a worker that ignores SIGINT and
    SIGTERM at once, long before --stop-timeout (60 s) would have."""
    server = cluster.start_server()
    agent = cluster.start_agent(server, "ctrlc", "stubborn.py", nnodes="1", flags=("--stop-timeout", "60"))
    [pid] = _worker_pids(agent)
    os.kill(agent.pid, signal.SIGINT)
    agent.wait_log(r"SIGINT: stopping workers", 10)
    assert alive(pid)  # it ignores SIGINT: only the stop timeout or a second Ctrl-C ends it
    os.kill(agent.pid, signal.SIGINT)
    # well before the 60 s stop timeout
    assert agent.wait_exit(30) == 128 + signal.SIGINT, agent.text()
    assert not alive(pid)
    assert not cluster.leftovers()
    _no_traceback(agent)


@pytest.mark.timeout(90)
def test_sighup_is_handled_like_sigterm(cluster: Cluster, tmp_path: Path) -> None:
    """A closed terminal (SIGHUP): the agent stops its workers, leaves the job,
    exits 128+1 and leaves no temporary directory behind."""
    server = cluster.start_server()
    tmp = tmp_path / "agent-tmp"
    tmp.mkdir()
    args = ("stubborn.py", "--ignore", "none")
    agents = [cluster.start_agent(server, "hup", *args, nnodes="1:2", env={"TMPDIR": str(tmp)}) for _ in range(2)]
    pids = [_worker_pids(a)[0] for a in agents]
    assert list(tmp.iterdir()), "the agent keeps its error files in a temporary directory"
    hup_id = agents[0].wait_log(r"node (\S+): joining", 1)[0].group(1)
    os.kill(agents[0].pid, signal.SIGHUP)
    assert agents[0].wait_exit(20) == 128 + signal.SIGHUP, agents[0].text()
    assert not alive(pids[0])
    view = server.wait_job("hup", lambda v: v["round"] >= 1, 20, "a new round without the hung-up node")
    assert hup_id in view["history"][1]["reason"] and "left" in view["history"][1]["reason"], view["history"]
    assert "SIGHUP" in view["history"][1]["reason"]
    assert alive(pids[1]) or agents[1].popen.poll() is None
    os.kill(agents[1].pid, signal.SIGTERM)
    assert agents[1].wait_exit(20) == 128 + signal.SIGTERM
    left = [p for p in tmp.rglob("*") if p.name != f"rdzv-{os.getuid()}"]  # the per-user base stays
    assert not left, left
    _no_traceback(agents[0])


# ------------------------------------------------------- an unreachable server

LOG_LINE = r"^\[rdzv-agent \d\d:\d\d:\d\d\] "  # a plain log line, not the status line


def _restart_server(cluster: Cluster, old: Server) -> Server:
    """The same server again: same port, same data dir."""
    argv = [
        sys.executable,
        "-m",
        "rdzv_server",
        "--host",
        "127.0.0.1",
        "--port",
        str(old.port),
        "--data-dir",
        str(cluster.tmp / "server-data"),
    ]
    name = old.name + "-again"
    server = Server(name, cluster._spawn(name, argv, cluster.env()), cluster.tmp / f"{name}.log", port=old.port)
    cluster.procs.append(server)
    wait_until(server.healthy, 20, "the restarted server's /healthz")
    return server


@pytest.mark.timeout(60)
def test_typoed_endpoint_gives_up_after_the_server_timeout(cluster: Cluster) -> None:
    """Nothing listens at the endpoint: the agent counts down in plain log
    lines, then exits 3 with one line that says why."""
    port = free_port()
    agent = cluster.start_agent(
        None,
        "typo",
        "stubborn.py",
        nnodes="1",
        flags=("--endpoint", f"127.0.0.1:{port}", "--job-id", "typo", "--server-timeout", "4"),
    )
    assert agent.wait_exit(40) == 3, agent.text()
    text = agent.text()
    assert re.search(
        LOG_LINE + r"job typo node \S+: server unreachable for \d+s at 127\.0\.0\.1:\d+ "
        r"\(cannot reach .*\); giving up in \d+s$",
        text,
        re.M,
    ), text
    [line] = [ln for ln in text.splitlines() if "giving up:" in ln]
    assert line.startswith(f"[rdzv-agent] job typo: giving up: server 127.0.0.1:{port} unreachable for 4s"), line
    assert "ready rank" not in text  # no worker ever started
    _no_traceback(agent)


@pytest.mark.timeout(60)
def test_unresolvable_server_name_is_an_error_at_once(cluster: Cluster) -> None:
    res = cluster.run_agent(
        "--endpoint",
        "no-such-host.invalid:29400",
        "--job-id",
        "dns",
        "--nnodes",
        "1",
        str(ROOT / "tests/e2e/scripts/stubborn.py"),
        timeout=30,
    )
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if "rdzv-agent: error" in ln]
    assert lines and "'no-such-host.invalid' does not resolve" in lines[0], res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.timeout(90)
def test_server_dies_while_workers_run_then_the_agent_gives_up(cluster: Cluster) -> None:
    """kill -9 of the server: the agent says so in a log line (workers keep
    running), and after --server-timeout stops its workers and exits 3."""
    server = cluster.start_server()
    agent = cluster.start_agent(
        server, "gone", "stubborn.py", "--ignore", "none", nnodes="1", flags=("--server-timeout", "5")
    )
    [pid] = _worker_pids(agent)
    os.kill(server.pid, signal.SIGKILL)
    server.wait_exit(10)
    agent.wait_log(
        LOG_LINE + r".*server unreachable for \d+s at 127\.0\.0\.1:\d+ \(.*\); workers keep running; "
        r"giving up in \d+s$",
        20,
    )
    assert alive(pid)
    assert agent.wait_exit(40) == 3, agent.text()
    assert "giving up: server" in agent.text() and "stopping workers" in agent.text()
    # off a terminal the countdown is the notice, every 30 s as README says: one line in these 5 s, not one per 2 s
    assert len([ln for ln in agent.text().splitlines() if "giving up in" in ln]) == 1, agent.text()
    assert not alive(pid)
    assert not cluster.leftovers()
    _no_traceback(agent)


@pytest.mark.timeout(90)
def test_server_dies_after_the_workers_finished_then_the_agent_gives_up(cluster: Cluster, tmp_path: Path) -> None:
    """The workers succeed while the server is down: the agent waits to report
    for --server-timeout, not forever (a SLURM allocation would stay held)."""
    server = cluster.start_server()
    agent = cluster.start_agent(
        server, "late", "stubborn.py", "--ignore", "none", "--seconds", "3", nnodes="1", flags=("--server-timeout", "5")
    )
    _worker_pids(agent)
    os.kill(server.pid, signal.SIGKILL)
    server.wait_exit(10)
    agent.wait_log(r"all 1 worker\(s\) exited 0; reporting success", 20)
    assert agent.wait_exit(40) == 3, agent.text()
    assert "giving up: server" in agent.text()
    _no_traceback(agent)


@pytest.mark.timeout(90)
def test_outage_notice_is_a_log_line_when_it_starts_and_ends(cluster: Cluster) -> None:
    """The outage is logged as plain lines (a terminal's status line is
    overwritten by worker output): when it starts and when it ends."""
    server = cluster.start_server()
    agent = cluster.start_agent(server, "blip", "stubborn.py", "--ignore", "none", nnodes="1")
    [pid] = _worker_pids(agent)
    os.kill(server.pid, signal.SIGKILL)
    server.wait_exit(10)
    agent.wait_log(LOG_LINE + r".*server unreachable for \d+s .*; workers keep running; giving up in \d+s$", 20)
    _restart_server(cluster, server)
    agent.wait_log(LOG_LINE + r"job blip node \S+: server 127\.0\.0\.1:\d+ reachable again$", 20)
    assert alive(pid) and agent.popen.poll() is None
    _no_traceback(agent)


# ------------------------------------------------------- a server that lies


class FakeServer:
    """A small aiohttp WebSocket server on 127.0.0.1, in a thread: connection
    ``i`` answers the agent's join with ``script[i]`` (a list of raw frames,
    ``{node_id}`` filled in). Records every frame the agent sent."""

    def __init__(self, script: list[list[dict]]) -> None:
        import asyncio
        import threading

        self.script = script
        self.received: list[dict] = []
        self.connections = 0
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.port = 0
        self.thread.start()
        assert self.ready.wait(10), "fake server did not start"

    def _run(self) -> None:
        import asyncio

        from aiohttp import web

        async def agent(request: web.Request) -> web.WebSocketResponse:
            ws = web.WebSocketResponse()
            await ws.prepare(request)
            conn = self.connections
            self.connections += 1
            async for frame in ws:
                msg = json.loads(frame.data)
                self.received.append(msg)
                if msg.get("op") == "join" and conn < len(self.script):
                    for out in self.script[conn]:
                        if "_sleep" in out:
                            await asyncio.sleep(out["_sleep"])
                            continue
                        text = json.dumps(out).replace("{node_id}", msg["node_id"])
                        await ws.send_str(text)
            return ws

        async def start() -> None:
            app = web.Application()
            app.router.add_get("/v1/agent", agent)
            self.runner = web.AppRunner(app, access_log=None)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]
            self.ready.set()

        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(start())
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.close()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _assigned(**over) -> dict:
    a = dict(
        job_id="liar",
        round=0,
        group_rank=0,
        group_world_size=1,
        local_world_size=1,
        rank_offset=0,
        world_size=1,
        master_addr="127.0.0.1",
        master_port=29501,
        max_restarts=3,
        restarts=0,
    )
    a.update(over)
    return {"op": "assigned", "assignment": a}


JOINED = {"op": "joined", "round": 0, "node_id": "{node_id}", "heartbeat_s": 2.0}


@pytest.mark.timeout(90)
def test_bad_server_messages_are_protocol_errors_not_crashes(cluster: Cluster) -> None:
    """A server that sends a NUL in master_addr, local_world_size 0, master
    port -1, another job's assignment, then (after the workers started) a
    world of 10**18: each is logged once, escaped, the agent reconnects, it
    never crashes, and its workers keep running with the same pids."""
    script = [
        [JOINED, _assigned(master_addr="127.0.0.1\u0000\u001b[2J")],
        [JOINED, _assigned(local_world_size=0)],
        [JOINED, _assigned(master_port=-1)],
        [JOINED, _assigned(job_id="someone-else")],
        # good: the workers start; then, while they run, a world of 10**18
        [JOINED, _assigned(), {"_sleep": 3.0}, _assigned(world_size=10**18)],
        [_assigned()],  # the answer to the resume: the same round, nothing changes
    ]
    fake = FakeServer(script)
    try:
        agent = cluster.start_agent(
            None,
            "liar",
            "stubborn.py",
            "--ignore",
            "none",
            nnodes="1",
            flags=("--endpoint", f"127.0.0.1:{fake.port}", "--job-id", "liar"),
        )
        [pid] = _worker_pids(agent, timeout=40)
        # the resume join itself, not the 6th connection: the fake server counts a
        # connection at its handshake, before the agent's join frame has arrived
        resumes = wait_until(
            lambda: [m for m in list(fake.received) if m.get("op") == "join" and m.get("resume_round") == 0],
            40,
            "the agent's resume join (resume_round 0) after the 10**18 world",
        )
        text = agent.text()
        assert alive(pid) and agent.popen.poll() is None, text
        assert len(re.findall(r"^\[0\]: ready rank", text, re.M)) == 1, text  # started once, never restarted
        errors = [ln for ln in text.splitlines() if "protocol error" in ln]
        for field in ("master_addr", "local_world_size", "master_port", "someone-else", "world_size"):
            assert any(field in ln for ln in errors), (field, errors)
        raw = agent.log_path.read_bytes()
        assert b"\x00" not in raw and b"\x1b[2J" not in raw
        # after the bad frame it came back as the node running round 0, on a new connection
        assert resumes and fake.connections >= 6, (fake.connections, fake.received)
        os.kill(agent.pid, signal.SIGTERM)
        assert agent.wait_exit(20) == 128 + signal.SIGTERM
        _no_traceback(agent)
    finally:
        fake.close()


# ------------------------------------------------------------- root causes


def _final_line(agent: Proc, job: str) -> str:
    lines = [ln for ln in agent.text().splitlines() if ln.startswith(f"[rdzv-agent] job {job} failed: ")]
    assert len(lines) == 1, agent.text()[-3000:]
    return lines[0]


@pytest.mark.timeout(90)
def test_root_cause_is_the_error_line_not_the_traceback_header(cluster: Cluster) -> None:
    """A worker prints a warning, then dies of ValueError with a plain
    traceback: every agent's final line, `rdzv status`'s root cause and its
    WHY column name "ValueError: bad lr"."""
    server = cluster.start_server()
    good = cluster.start_agent(server, "lr", "bad_lr.py", flags=("--max-restarts", "0"))
    bad = cluster.start_agent(
        server, "lr", "bad_lr.py", flags=("--max-restarts", "0"), env={"E2E_BAD_LR": "1", "PYTHONWARNINGS": "default"}
    )
    for a in (good, bad):
        assert a.wait_exit(60) == 1, a.text()
    assert "UserWarning" in bad.text()  # the warning was there, before the traceback
    for a in (good, bad):
        line = _final_line(a, "lr")
        assert "exit code 1: ValueError: bad lr" in line, line
        assert "Traceback" not in line and "Warning" not in line, line
    res = rdzv(cluster, "--endpoint", server.endpoint, "status", "lr")
    assert res.returncode == 0, res.stderr
    [cause] = [ln for ln in res.stdout.splitlines() if ln.startswith("root cause: ")]
    assert cause.endswith("exit code 1: ValueError: bad lr"), res.stdout


@pytest.mark.timeout(90)
def test_text_from_the_network_is_escaped_on_every_agent_and_in_status(cluster: Cluster) -> None:
    """Another node of the job reports a failure whose signal holds a newline
    and a screen clear: the real agent's final line and `rdzv status` print
    them escaped, on one line."""
    import asyncio

    import aiohttp

    from rdzv_common.protocol import AGENT_PATH, SERVER_MESSAGE, ExitRecord, FailedMsg, JobSpec, JoinMsg

    server = cluster.start_server()
    agent = cluster.start_agent(server, "esc", "stubborn.py", "--ignore", "none", flags=("--max-restarts", "0"))
    agent.wait_log(r"joining", 20)

    async def hostile() -> None:
        async with aiohttp.ClientSession() as s, s.ws_connect(f"ws://{server.endpoint}{AGENT_PATH}") as ws:
            await ws.send_str(
                JoinMsg(
                    job_id="esc",
                    node_id="evil-1-abcdef",
                    host="evil",
                    addr="127.0.0.1",
                    local_world_size=1,
                    master_port=free_port(),
                    spec=JobSpec(min_nodes=2, max_nodes=2, max_restarts=0),
                ).model_dump_json()
            )
            sent = False
            async for frame in ws:
                msg = SERVER_MESSAGE.validate_json(frame.data)
                if msg.op == "assigned" and not sent:
                    sent = True
                    await ws.send_str(
                        FailedMsg(
                            round=msg.assignment.round,
                            failures=[
                                ExitRecord(
                                    local_rank=0,
                                    rank=msg.assignment.rank_offset,
                                    pid=1,
                                    signal="SIG\n\x1b[2J",
                                    message="ValueError: x\x1b]0;pwned\x07",
                                )
                            ],
                        ).model_dump_json()
                    )
                if msg.op == "done":
                    return

    asyncio.run(asyncio.wait_for(hostile(), 40))
    assert agent.wait_exit(30) == 1, agent.text()
    raw = agent.log_path.read_bytes()
    assert b"\x1b" not in raw and b"\x07" not in raw, raw[-2000:]
    line = _final_line(agent, "esc")
    assert "signal SIG\\n\\x1b[2J" in line, line
    res = rdzv(cluster, "--endpoint", server.endpoint, "status", "esc")
    assert res.returncode == 0, res.stderr
    assert "\x1b" not in res.stdout and "\x07" not in res.stdout, repr(res.stdout)
    [cause] = [ln for ln in res.stdout.splitlines() if ln.startswith("root cause: ")]
    assert "SIG\\n\\x1b[2J" in cause, res.stdout


# -------------------------------------------------------------- node ranks


@pytest.mark.timeout(90)
def test_a_node_rank_that_cannot_be_honoured_is_said(cluster: Cluster) -> None:
    """--node-rank 5 in a job of 2 nodes: the agent says it got another rank
    and why, and the job view shows the rank each node asked for."""
    server = cluster.start_server()
    args = ("stubborn.py", "--ignore", "none")
    far = cluster.start_agent(server, "ranks", *args, flags=("--node-rank", "5"))
    first = cluster.start_agent(server, "ranks", *args, flags=("--node-rank", "0"))
    _worker_pids(far)
    _worker_pids(first)
    far.wait_log(r"node \S+: asked for node rank 5, got 1 \(this round has 2 node\(s\)\)$", 5)
    assert "asked for node rank" not in first.text()
    view = server.job("ranks")
    by_rank = {n["group_rank"]: n["requested_rank"] for n in view["nodes"]}
    assert by_rank == {0: 0, 1: 5}, view["nodes"]
