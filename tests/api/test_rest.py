"""The REST API and the agent channel of the real app, in process."""

from __future__ import annotations

import asyncio
import sys

import pytest
from aiohttp import WSServerHandshakeError, web

from rdzv_common.protocol import AGENT_PATH, ExitRecord, FailedMsg, LeaveMsg, SucceededMsg
from rdzv_server.app import Settings, create_app
from rdzv_server.store import DataDirError, Store, StoreSettings

from .conftest import TIMEOUT, form, join_msg

JOB_FIELDS = {
    "job_id",
    "state",
    "round",
    "min_nodes",
    "max_nodes",
    "world_size",
    "restarts",
    "max_restarts",
    "master_addr",
    "master_port",
    "nodes",
    "spares",
    "waiting_for",
    "history",
}
NODE_FIELDS = {"node_id", "host", "state", "group_rank", "local_world_size", "last_seen_s"}
ROUND_FIELDS = {"round", "reason", "started_at", "world_size"}


async def get_json(client, path: str, status: int = 200, **kw):
    resp = await client.get(path, **kw)
    assert resp.status == status, await resp.text()
    return await resp.json()


async def wait_for_job(client, job_id: str, pred, timeout: float = TIMEOUT) -> dict:
    """Poll the job view until ``pred(view)`` holds (REST has no push)."""

    async def poll():
        while True:
            view = await get_json(client, f"/v1/jobs/{job_id}")
            if pred(view):
                return view
            await asyncio.sleep(0.02)

    return await asyncio.wait_for(poll(), timeout)


def failure(rank: int = 0, code: int = 1) -> list[ExitRecord]:
    return [ExitRecord(local_rank=0, rank=rank, pid=1234, exit_code=code, message="boom")]


async def test_two_agents_form_a_round_and_rest_shows_it(client, connect):
    """Two agents joining a 2:2 job get ranks 0/1 with prefix-sum offsets, and REST shows the job
    with the fields of docs/design.md."""
    agents, got = await form(connect, "exp1", ["node1", "node2"], nproc=4)
    a1, a2 = got["node1"], got["node2"]
    assert (a1.group_rank, a2.group_rank) == (0, 1)
    assert (a1.rank_offset, a2.rank_offset) == (0, 4)
    assert a1.world_size == a2.world_size == 8
    assert a1.group_world_size == 2 and a1.round == 0 and a1.restarts == 0
    assert a1.master_addr == a2.master_addr == join_msg("exp1", "node1").addr

    listing = await get_json(client, "/v1/jobs")
    assert [j["job_id"] for j in listing["jobs"]] == ["exp1"]
    assert listing["jobs"][0]["state"] == "running" and listing["jobs"][0]["nodes"] == 2

    view = await get_json(client, "/v1/jobs/exp1")
    assert view.keys() >= JOB_FIELDS
    assert view["state"] == "running" and view["round"] == 0 and view["world_size"] == 8
    assert (view["min_nodes"], view["max_nodes"], view["restarts"], view["max_restarts"]) == (2, 2, 0, 3)
    assert (view["master_addr"], view["master_port"]) == (a1.master_addr, a1.master_port)
    assert view["waiting_for"] is None and view["spares"] == []
    assert [(n["node_id"], n["group_rank"], n["state"], n["local_world_size"]) for n in view["nodes"]] == [
        ("node1", 0, "running", 4),
        ("node2", 1, "running", 4),
    ]
    for node in view["nodes"]:
        assert node.keys() >= NODE_FIELDS and node["host"] == node["node_id"] and node["last_seen_s"] >= 0
    # each node's workers' global ranks (the /ui's per-worker detail), as its assignment says
    assert [n["rank_offset"] for n in view["nodes"]] == [a1.rank_offset, a2.rank_offset]
    assert len(view["history"]) == 1 and view["history"][0].keys() >= ROUND_FIELDS
    assert view["history"][0]["round"] == 0 and view["history"][0]["world_size"] == 8


async def test_waiting_for_while_forming(client, connect):
    """A lone node of a 2:2 job is told, and REST says, that one more node is needed to reach min 2."""
    agent = await connect()
    await agent.send(join_msg("forming", "node1"))
    joined = await agent.expect("joined")
    assert "1 more node(s) to reach min 2" in joined.waiting_for.text
    view = await get_json(client, "/v1/jobs/forming")
    assert view["state"] == "waiting"
    assert "1 more node(s) to reach min 2" in view["waiting_for"]["text"]
    assert view["waiting_for"]["joined"] == 1 and view["waiting_for"]["min_nodes"] == 2
    assert [n["state"] for n in view["nodes"]] == ["waiting"]


async def test_agent_death_restarts_the_survivor(client, connect):
    """When one agent's connection drops without a leave, the other is told to restart within about a second."""
    (a1, a2), _ = await form(connect, "death", ["node1", "node2"])
    a2.ws._response.connection.transport.abort()  # the process died: no close frame, no leave
    restart = await a1.expect("restart", timeout=1.5)  # grace 0.5 s + one 0.1 s tick, with slack
    assert restart.round == 1 and "node2" in restart.reason
    view = await get_json(client, "/v1/jobs/death")
    assert view["state"] == "waiting" and view["round"] == 1
    assert view["history"][-1]["round"] == 1 and "node node2 (node2) connection lost" in view["history"][-1]["reason"]
    assert view["restarts"] == 0  # a lost node is not a worker failure


async def test_failed_report_restarts_everyone(client, connect):
    """A failure report sends restart to every member, bumps restarts, and the re-formed round keeps the ranks."""
    (a1, a2), _ = await form(connect, "fail", ["node1", "node2"])
    await a2.send(FailedMsg(round=0, failures=failure(rank=1)))
    restarts = [await a.expect("restart") for a in (a1, a2)]
    assert {r.round for r in restarts} == {1}
    assert "worker failure" in restarts[0].reason and "boom" in restarts[0].reason
    await a2.expect("ack")
    view = await get_json(client, "/v1/jobs/fail")
    assert view["restarts"] == 1 and view["round"] == 1 and view["state"] == "waiting"
    assert "worker failure" in view["history"][-1]["reason"]
    for agent, node in ((a1, "node1"), (a2, "node2")):
        await agent.send(join_msg("fail", node))
    for agent, rank in ((a1, 0), (a2, 1)):
        await agent.expect("joined")
        assignment = (await agent.expect("assigned")).assignment
        assert (assignment.round, assignment.group_rank, assignment.restarts) == (1, rank, 1)


async def test_success_of_every_member_ends_the_job(client, connect):
    """When both members report success the job is succeeded and both get done."""
    (a1, a2), _ = await form(connect, "ok", ["node1", "node2"])
    await a1.send(SucceededMsg(round=0))
    await a1.expect("ack")
    assert (await get_json(client, "/v1/jobs/ok"))["state"] == "running"
    await a2.send(SucceededMsg(round=0))
    for agent in (a1, a2):
        done = await agent.recv()
        if done.op == "ack":
            done = await agent.recv()
        assert done.op == "done" and done.state == "succeeded"
    view = await get_json(client, "/v1/jobs/ok")
    assert view["state"] == "succeeded" and view["round"] == 0


async def test_close_ends_the_job_for_its_agents(client, connect):
    """POST /v1/jobs/{id}/close tells every agent done/closed and the job stays closed."""
    (a1, a2), _ = await form(connect, "closeme", ["node1", "node2"])
    resp = await client.post("/v1/jobs/closeme/close")
    assert resp.status == 200
    assert await resp.json() == {"job_id": "closeme", "state": "closed"}
    for agent in (a1, a2):
        done = await agent.expect("done")
        assert done.state == "closed"
    assert (await get_json(client, "/v1/jobs/closeme"))["state"] == "closed"
    again = await client.post("/v1/jobs/closeme/close")  # idempotent
    assert again.status == 200 and (await again.json())["state"] == "closed"
    late = await connect()  # an agent of the closed run (a fresh one would start run 2: test_lifecycle.py)
    await late.send(join_msg("closeme", "node3", run=1))
    err = await late.expect("error")
    assert err.code.value == "job_finished"


async def test_jobs_with_the_same_node_ids_are_isolated(client, connect):
    """Two jobs using the same node ids form, fail and report independently."""
    (a1, a2), got_a = await form(connect, "jobA", ["node1", "node2"])
    (b1, b2), got_b = await form(connect, "jobB", ["node1", "node2"], nproc=2)
    assert got_a["node2"].world_size == 2 and got_b["node2"].world_size == 4
    assert got_b["node2"].job_id == "jobB"
    await b1.send(FailedMsg(round=0, failures=failure()))
    await b1.expect("restart")
    await b2.expect("restart")
    a = await get_json(client, "/v1/jobs/jobA")
    b = await get_json(client, "/v1/jobs/jobB")
    assert (a["state"], a["round"], a["restarts"]) == ("running", 0, 0)
    assert (b["state"], b["round"], b["restarts"]) == ("waiting", 1, 1)
    await a1.send(SucceededMsg(round=0))  # round 0 is stale for jobB but current for jobA
    assert (await a1.expect("ack")).of == "succeeded"
    listing = await get_json(client, "/v1/jobs")
    assert {j["job_id"]: j["round"] for j in listing["jobs"]} == {"jobA": 0, "jobB": 1}


async def test_leave_reforms_without_the_leaver(client, connect):
    """A leave is acknowledged and the others restart at once with the reason naming it."""
    (a1, a2, a3), _ = await form(connect, "leave", ["node1", "node2", "node3"], nnodes=(2, 3))
    await a2.send(LeaveMsg(reason="SIGTERM"))
    await a2.expect("ack")
    for agent in (a1, a3):
        restart = await agent.expect("restart")
        assert restart.round == 1 and "node2" in restart.reason and "SIGTERM" in restart.reason
    for agent, node in ((a1, "node1"), (a3, "node3")):
        await agent.send(join_msg("leave", node, (2, 3)))
    ranks = {}
    for agent, node in ((a1, "node1"), (a3, "node3")):
        await agent.expect("joined")
        ranks[node] = (await agent.expect("assigned")).assignment.group_rank
    assert ranks == {"node1": 0, "node3": 1}


# ------------------------------------------------------------------- auth


AUTHED = [
    ("GET", "/v1/jobs"),
    ("GET", "/v1/jobs/authjob"),
    ("POST", "/v1/jobs/authjob/close"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
    ("GET", "/v1/nothing-here"),
]


@pytest.mark.parametrize("header", [None, "Bearer wrong", "Basic s3cret", "Bearer", "s3cret", "Bearer s3cret2"])
async def test_auth_refuses_missing_or_wrong_tokens(make_client, header):
    """With a token set, every endpoint but /healthz answers 401 unauthorized to a missing or wrong token."""
    client = await make_client(Settings(token="s3cret"))
    headers = {"Authorization": header} if header is not None else {}
    for method, path in AUTHED:
        resp = await client.request(method, path, headers=headers)
        assert resp.status == 401, (method, path)
        assert resp.headers["WWW-Authenticate"] == "Bearer"
        body = await resp.json()
        assert body["code"] == "unauthorized" and body["message"]
        # the message names what is true: nothing sent, or a token that is not this server's
        sent = header is not None and header.startswith("Bearer ") and len(header) > len("Bearer ")
        assert ("not this server's" if sent else "no bearer token was sent") in body["message"], (header, body)
    resp = await client.get(
        AGENT_PATH,
        headers={
            **headers,
            "Upgrade": "websocket",
            "Connection": "Upgrade",
            "Sec-WebSocket-Version": "13",
            "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
        },
    )
    assert resp.status == 401 and (await resp.json())["code"] == "unauthorized"
    with pytest.raises(WSServerHandshakeError) as refused:
        await client.ws_connect(AGENT_PATH, headers=headers)
    assert refused.value.status == 401
    assert (await client.get("/healthz", headers=headers)).status == 200
    assert (await get_json(client, "/v1/jobs", headers={"Authorization": "Bearer s3cret"}))["jobs"] == []


async def test_auth_accepts_the_right_token(make_client, connect):
    """With the right bearer token every endpoint and the agent WebSocket work."""
    client = await make_client(Settings(token="s3cret"))
    auth = {"Authorization": "Bearer s3cret"}
    agents = []
    for node in ("node1", "node2"):
        agent = await connect(on=client, headers=auth)
        await agent.send(join_msg("authjob", node))
        agents.append(agent)
    for agent in agents:
        await agent.expect("joined")
        await agent.expect("assigned")
    assert (await get_json(client, "/v1/jobs", headers=auth))["jobs"][0]["job_id"] == "authjob"
    assert (await get_json(client, "/v1/jobs/authjob", headers=auth))["state"] == "running"
    assert (await client.get("/metrics", headers={"Authorization": "bearer s3cret"})).status == 200
    assert (await get_json(client, "/openapi.json", headers=auth))["openapi"].startswith("3.")
    resp = await client.post("/v1/jobs/authjob/close", headers=auth)
    assert resp.status == 200
    for agent in agents:
        assert (await agent.expect("done")).state == "closed"


# ------------------------------------------------------------- durability


async def test_state_survives_a_server_restart(make_client, connect, tmp_path):
    """A job formed before a restart is back after it, and agents resuming their round get the same assignment."""
    settings = Settings(data_dir=tmp_path)
    first = await make_client(settings)
    agents = [await connect(on=first) for _ in range(2)]
    for agent, node in zip(agents, ("node1", "node2")):
        await agent.send(join_msg("durable", node, nproc=2))
    before = {}
    for agent, node in zip(agents, ("node1", "node2")):
        await agent.expect("joined")
        before[node] = (await agent.expect("assigned")).assignment
    view_before = await get_json(first, "/v1/jobs/durable")
    await first.close()  # the server goes away under its agents
    for agent in agents:
        await agent.wait_closed()

    second = await make_client(Settings(data_dir=tmp_path))
    view = await get_json(second, "/v1/jobs/durable")
    assert (view["state"], view["round"], view["world_size"]) == ("running", 0, 4)
    assert [(n["node_id"], n["group_rank"]) for n in view["nodes"]] == [("node1", 0), ("node2", 1)]
    assert all(n["state"] == "disconnected" for n in view["nodes"])
    assert (view["master_addr"], view["master_port"]) == (view_before["master_addr"], view_before["master_port"])
    assert view["history"] == view_before["history"]

    resumed = [await connect(on=second) for _ in range(2)]
    for agent, old, node in zip(resumed, agents, ("node1", "node2")):
        await agent.send(join_msg("durable", node, nproc=2, resume_round=0, node_secret=old.node_secret))
    for agent, node in zip(resumed, ("node1", "node2")):
        assert (await agent.expect("assigned")).assignment == before[node]
    view = await get_json(second, "/v1/jobs/durable")
    assert (view["state"], view["round"], len(view["history"])) == ("running", 0, 1)
    assert [n["state"] for n in view["nodes"]] == ["running", "running"]


async def test_corrupt_database_refuses_to_start(tmp_path):
    """A garbage rdzv.db makes the store and the app's startup raise DataDirError, and the file is left as it was."""
    garbage = b"this is not a SQLite database\x00\xff" * 100
    db = tmp_path / "rdzv.db"
    db.write_bytes(garbage)
    with pytest.raises(DataDirError, match="rdzv.db.*(corrupt|not a database)") as info:
        Store(StoreSettings(data_dir=tmp_path)).open()
    assert "move it away" in str(info.value)

    runner = web.AppRunner(create_app(Settings(data_dir=tmp_path)))
    with pytest.raises(DataDirError, match="move it away"):
        await runner.setup()
    await runner.cleanup()
    assert db.read_bytes() == garbage
    # nothing but the data dir's lock file (taken before the database is opened, never removed)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rdzv.db", "rdzv.lock"]


async def test_server_command_refuses_a_corrupt_database(tmp_path):
    """rdzv-server over a corrupt data dir exits 2 with a message saying what to do, and leaves the file alone."""
    garbage = b"\x00garbage\xff" * 500
    (tmp_path / "rdzv.db").write_bytes(garbage)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "rdzv_server",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--data-dir",
        str(tmp_path),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2, (out, err)
    assert b"refusing to start" in err and b"rdzv.db" in err and b"move it away" in err
    assert b"Traceback" not in err
    assert (tmp_path / "rdzv.db").read_bytes() == garbage
