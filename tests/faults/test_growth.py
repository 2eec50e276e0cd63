"""A server left running: a stalled loop does not hide dead nodes, finished
jobs go away after --retain-finished, and a nearly full disk refuses new jobs
but never a running job's round change. Real server process; agents simulated
over its WebSocket (their behaviour is not what is tested here)."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
from pathlib import Path

import aiohttp
import pytest

from rdzv_common.protocol import AGENT_PATH, ExitRecord, FailedMsg, JobSpec, JoinMsg, SucceededMsg
from tests.helpers.cluster import FaultCluster, Ticks
from tests.helpers.procs import Server, free_port, wait_until

pytestmark = [pytest.mark.e2e]


def join(job_id: str, node_id: str, spec: JobSpec, resume: int | None = None, secret: str | None = None) -> str:
    return JoinMsg(
        job_id=job_id,
        node_id=node_id,
        host=node_id,
        addr="127.0.0.1",
        local_world_size=1,
        master_port=29500,
        spec=spec,
        resume_round=resume,
        node_secret=secret,
    ).model_dump_json()


class SimAgent:
    """One simulated agent: its WebSocket, the ops it received, optional heartbeats."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.ops: list[dict] = []
        self._reader = asyncio.ensure_future(self._read())
        self._hb: asyncio.Task | None = None

    @classmethod
    async def connect(cls, session: aiohttp.ClientSession, server: Server) -> SimAgent:
        return cls(await session.ws_connect(server.url + AGENT_PATH))

    async def _read(self) -> None:
        async for frame in self.ws:
            if frame.type == aiohttp.WSMsgType.TEXT:
                self.ops.append(frame.json())

    def heartbeat(self, every: float) -> None:
        async def beat():
            while not self.ws.closed:
                await self.ws.send_str('{"op":"hb"}')
                await asyncio.sleep(every)

        self._hb = asyncio.ensure_future(beat())

    async def wait_op(self, op: str, timeout: float = 10.0, count: int = 1) -> dict:
        async def seen():
            while sum(m["op"] == op for m in self.ops) < count:
                if self._reader.done():
                    raise AssertionError(f"connection closed before {op!r}; got {self.ops}")
                await asyncio.sleep(0.02)
            return [m for m in self.ops if m["op"] == op][count - 1]

        try:
            return await asyncio.wait_for(seen(), timeout)
        except asyncio.TimeoutError:
            raise AssertionError(f"no {op!r} within {timeout:g}s; got {[m['op'] for m in self.ops]}") from None

    @classmethod
    async def form(
        cls, session: aiohttp.ClientSession, server: Server, job_id: str, nodes: tuple[str, ...], spec: JobSpec
    ) -> list[SimAgent]:
        """One agent per node id, all joined to ``job_id``; returns once each is assigned."""
        agents = [await cls.connect(session, server) for _ in nodes]
        for agent, node in zip(agents, nodes):
            await agent.ws.send_str(join(job_id, node, spec))
        for agent in agents:
            await agent.wait_op("assigned")
        return agents

    async def closed(self, timeout: float = 5.0) -> None:
        await asyncio.wait_for(asyncio.shield(self._reader), timeout)

    async def close(self) -> None:
        if self._hb:
            self._hb.cancel()
        await self.ws.close()
        self._reader.cancel()


@pytest.mark.timeout(90)
async def test_silent_node_is_evicted_while_the_server_stalls_again_and_again(fcluster: FaultCluster, tmp_path: Path):
    """The server is stopped for 1.8 s every 2.2 s (each stop longer than the stall
    detector's 1.5 s, the period shorter than the 3 s heartbeat timeout). The
    node that heartbeats is never evicted; the silent one is, within a few
    timeouts, instead of getting a fresh timeout after every stall."""
    server = fcluster.start_server_at(free_port(), tmp_path / "data")
    spec = JobSpec(min_nodes=2, max_nodes=2, heartbeat_timeout_s=3.0)
    async with aiohttp.ClientSession() as session:
        live, silent = await SimAgent.form(session, server, "stall", ("live", "silent"), spec)
        live.heartbeat(0.5)
        stops = 0
        try:
            for _ in range(12):  # 26 s: almost 9 heartbeat timeouts
                os.kill(server.pid, signal.SIGSTOP)
                await asyncio.sleep(1.8)
                os.kill(server.pid, signal.SIGCONT)
                stops += 1
                await asyncio.sleep(0.4)
                if any(m["op"] == "evicted" for m in silent.ops):
                    break
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert any(m["op"] == "evicted" for m in silent.ops), (
            f"the silent node was not evicted after {stops} stalls; it got {silent.ops}\n{server.text()[-2000:]}"
        )
        assert stops <= 6, f"evicted only after {stops} stalls"
        assert not any(m["op"] == "evicted" for m in live.ops), live.ops
        assert "did not run for a while" in server.text()
        await live.wait_op("restart")  # the round re-forms without the silent node
        await live.close()
        await silent.close()


async def _run_and_succeed(session, server: Server, job_id: str) -> None:
    spec = JobSpec(min_nodes=1, max_nodes=1)
    agent = await SimAgent.connect(session, server)
    await agent.ws.send_str(join(job_id, "node1", spec))
    await agent.wait_op("assigned")
    await agent.ws.send_str(SucceededMsg(round=0).model_dump_json())
    await agent.wait_op("done")
    await agent.close()


def _rows(data_dir: Path, job_id: str) -> int:
    conn = sqlite3.connect(f"file:{data_dir / 'rdzv.db'}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT count(*) FROM jobs WHERE job_id=?", (job_id,)).fetchone()[0]
    finally:
        conn.close()


def _metrics(server: Server) -> str:
    import urllib.request

    with urllib.request.urlopen(server.url + "/metrics", timeout=5) as r:
        return r.read().decode()


@pytest.mark.timeout(90)
async def test_finished_jobs_go_away_after_retain_finished(fcluster: FaultCluster, tmp_path: Path):
    """--retain-finished 2s: a succeeded job is listed at first, then gone from
    REST, /metrics and the database, and stays gone after a restart; a
    running job is kept however old."""
    data = tmp_path / "data"
    port = free_port()
    server = fcluster.start_server_at(port, data, "--retain-finished", "2s", name="server")
    async with aiohttp.ClientSession() as session:
        keep = await SimAgent.connect(session, server)
        await keep.ws.send_str(join("keep", "node1", JobSpec(min_nodes=1, max_nodes=1)))
        await keep.wait_op("assigned")
        keep.heartbeat(1.0)
        await _run_and_succeed(session, server, "short")
        assert server.job("short")["state"] == "succeeded"
        assert _rows(data, "short") == 1 and 'job_id="short"' in _metrics(server)
        await asyncio.to_thread(wait_until, lambda: server.job("short") is None, 15, "the finished job removed")
        assert _rows(data, "short") == 0
        assert 'job_id="short"' not in _metrics(server) and 'job_id="keep"' in _metrics(server)
        _, listing = server.request("GET", "/v1/jobs")
        assert [j["job_id"] for j in listing["jobs"]] == ["keep"]
        assert server.job("keep")["state"] == "running"
        assert "removed 1 finished job(s) older than --retain-finished 2s: short" in server.text()
        await keep.close()
    server.popen.send_signal(signal.SIGTERM)
    assert server.wait_exit(15) == 0
    again = fcluster.start_server_at(port, data, "--retain-finished", "2s", name="server-again")
    assert again.job("short") is None and again.job("keep") is not None


@pytest.mark.timeout(90)
async def test_nearly_full_disk_refuses_new_jobs_but_not_a_round_change(fcluster: FaultCluster, tmp_path: Path):
    """On a 3 MB tmpfs with --min-free-disk 1MiB: once less than 1 MiB is free a
    new job is refused (unavailable, saying how much is free) and not created,
    while a running job still opens and completes its next round; with space
    back, new jobs are taken again."""
    if os.geteuid() != 0:
        pytest.skip("mounting a 3 MB tmpfs needs root (the suite runs as root in CI)")
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], check=True)
    try:
        server = fcluster.start_server_at(free_port(), mnt / "data", "--min-free-disk", "1MiB")
        spec = JobSpec(min_nodes=2, max_nodes=2)
        async with aiohttp.ClientSession() as session:
            a, b = await SimAgent.form(session, server, "kept", ("a", "b"), spec)
            for agent in (a, b):
                agent.heartbeat(1.0)
            st = os.statvfs(mnt)
            free = st.f_bavail * st.f_frsize
            (mnt / "filler").write_bytes(b"\0" * (free - 512 * 1024))  # leave ~0.5 MiB

            newcomer = await SimAgent.connect(session, server)
            await newcomer.ws.send_str(join("new", "n1", spec))
            err = await newcomer.wait_op("error")
            assert err["code"] == "unavailable" and "--min-free-disk" in err["message"], err
            assert "bytes free" in err["message"], err
            await newcomer.closed()
            assert server.job("new") is None

            failure = ExitRecord(local_rank=0, rank=1, pid=1, exit_code=1, message="boom")
            await b.ws.send_str(FailedMsg(round=0, failures=[failure]).model_dump_json())
            for agent, node in ((a, "a"), (b, "b")):
                await agent.wait_op("restart")
                secret = (await agent.wait_op("joined"))["node_secret"]  # a rejoin proves the node
                await agent.ws.send_str(join("kept", node, spec, secret=secret))
            for agent in (a, b):
                await agent.wait_op("assigned", count=2)
            view = server.job("kept")
            assert (view["state"], view["round"], view["restarts"]) == ("running", 1, 1), view

            (mnt / "filler").unlink()
            again = await SimAgent.connect(session, server)
            await again.ws.send_str(join("new", "n1", spec))
            await again.wait_op("joined")
            for agent in (a, b, again):
                await agent.close()
        server.popen.send_signal(signal.SIGTERM)
        assert server.wait_exit(15) == 0
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.timeout(90)
async def test_a_real_agent_refused_by_the_waiting_job_cap_says_why_and_gets_in_later(
    fcluster: FaultCluster, tmp_path: Path
):
    """--max-waiting-jobs 1 with one job waiting: a real rdzv-agent of a new job
    prints the server's reason, keeps its place (retrying), and once the
    waiting job is closed its own job is created, trains and succeeds."""
    server = fcluster.start_server_at(free_port(), tmp_path / "data", "--max-waiting-jobs", "1")
    async with aiohttp.ClientSession() as session:
        waiter = await SimAgent.connect(session, server)
        await waiter.ws.send_str(join("first", "node1", JobSpec(min_nodes=2, max_nodes=2)))
        await waiter.wait_op("joined")
        waiter.heartbeat(1.0)
        stop = tmp_path / "stop"
        agent = fcluster.start_ranks_agent(server.endpoint, "second", "n0", stop, nnodes="1")
        await asyncio.to_thread(agent.wait_log, r"1 jobs are waiting for nodes.*--max-waiting-jobs 1", 30)
        assert server.job("second") is None and agent.popen.poll() is None
        assert "refused a new job" in server.text()
        server.close_job("first")
        await waiter.wait_op("done")
        await asyncio.to_thread(wait_until, lambda: Ticks.last_step(agent, 0) >= 2, 60, "the second job training")
        stop.touch()
        assert await asyncio.to_thread(agent.wait_exit, 40) == 0
        assert server.job("second")["state"] == "succeeded"
        await waiter.close()
