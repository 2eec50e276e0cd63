"""The job lifecycle through the real app (issue 12): a node whose launcher
gives up ends the job for every agent; a finished job id starts a new run
while late agents of the old run are told it finished."""

from __future__ import annotations

import asyncio

from rdzv_client.client import AgentLink
from rdzv_client.session import NodeSession
from rdzv_common.protocol import AGENT_PATH, ExitRecord, FailedMsg, JobSpec, SucceededMsg
from rdzv_server.app import Settings

from .conftest import Agent, form, join_msg

BOOM = [ExitRecord(local_rank=0, rank=1, pid=7, exit_code=1, timestamp=5.0, message="RuntimeError: boom")]


async def get_json(client, path: str):
    resp = await client.get(path)
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def until(agent, op):
    while (msg := await agent.recv()).op != op:
        pass
    return msg


async def test_a_give_up_fails_the_job_and_tells_every_agent(client, connect):
    """The server's budget is far from spent (torchrun's plugin keeps its own):
    a give-up still ends the job at once, with the failure as its root cause."""
    spec = JobSpec(min_nodes=2, max_nodes=2, max_restarts=1000)
    agents = [await connect() for _ in range(2)]
    for agent, node in zip(agents, ["a", "b"]):
        await agent.send(join_msg("quit", node, spec=spec))
    for agent in agents:
        await until(agent, "assigned")
    await agents[1].send(FailedMsg(round=0, failures=BOOM, give_up=True))
    for agent in agents:
        done = await until(agent, "done")
        assert done.state == "failed" and "gave up" in done.reason and "boom" in done.reason, done
        assert "node b (b) rank 1" in (done.root_cause or ""), done
    view = await get_json(client, "/v1/jobs/quit")
    assert (view["state"], view["round"], view["restarts"]) == ("failed", 0, 0), view
    assert "RuntimeError: boom" in view["root_cause"], view


async def test_a_plain_failure_still_restarts(client, connect):
    """Without give_up a failure report opens the next round, as before."""
    (a, b), _ = await form(connect, "plain", ["a", "b"])
    await b.send(FailedMsg(round=0, failures=BOOM))
    for agent in (a, b):
        assert (await until(agent, "restart")).round == 1
    view = await get_json(client, "/v1/jobs/plain")
    assert (view["state"], view["round"], view["restarts"]) == ("waiting", 1, 1), view


# --------------------------------------------------------------------- runs


async def run_once(connect, job_id: str, nodes: list[str], **kw) -> list:
    """Fresh agents form the job, report success and get done(succeeded)."""
    agents, got = await form(connect, job_id, nodes, **kw)
    for agent, node in zip(agents, nodes):
        await agent.send(SucceededMsg(round=got[node].round))
    for agent in agents:
        assert (await until(agent, "done")).state == "succeeded"
    return agents


async def test_the_same_job_id_runs_again_and_keeps_its_history(client, connect):
    """The same command twice: fresh agents (new node ids, no run) start run 2
    of the finished job id; REST shows the run and run 1's summary."""
    await run_once(connect, "again", ["a", "b"])
    agents = [await connect() for _ in range(2)]
    for agent, node in zip(agents, ["a2", "b2"]):
        await agent.send(join_msg("again", node))
    for agent in agents:
        joined = await agent.expect("joined")
        assert joined.run == 2, joined
        assert (await until(agent, "assigned")).assignment.round == 0
    view = await get_json(client, "/v1/jobs/again")
    assert (view["state"], view["run"], view["round"]) == ("running", 2, 0), view
    assert {n["node_id"] for n in view["nodes"]} == {"a2", "b2"}
    assert view["history"][0]["reason"] == "run 2 started (run 1 succeeded)", view["history"]
    (prev,) = view["runs"]
    assert (prev["run"], prev["state"], prev["rounds"], prev["restarts"]) == (1, "succeeded", 1, 0), prev
    assert prev["reason"].startswith("all 2 nodes of round 0 succeeded") and prev["ended_at"] >= prev["started_at"]
    listed = await get_json(client, "/v1/jobs")
    assert [(j["job_id"], j["run"], j["state"]) for j in listed["jobs"]] == [("again", 2, "running")]


async def test_a_new_run_takes_the_settings_and_job_secret_of_its_first_join(client, connect):
    agents, _ = await form(connect, "recfg", ["a"], nnodes=(1, 1))
    await client.post("/v1/jobs/recfg/close")
    assert (await until(agents[0], "done")).state == "closed"
    other = await connect()
    await other.send(join_msg("recfg", "x", nnodes=(1, 2), job_secret="run-2-secret-0123456789"))
    assert (await other.expect("joined")).run == 2
    view = await get_json(client, "/v1/jobs/recfg")
    assert (view["run"], view["min_nodes"], view["max_nodes"]) == (2, 1, 2), view
    wrong = await connect()
    await wrong.send(join_msg("recfg", "y", nnodes=(1, 2)))  # run 2 has a job secret now
    assert (await wrong.expect("error")).code == "job_secret_mismatch"


async def test_late_agents_of_a_finished_run_are_told_it_finished(client, connect):
    """An agent of run 1 that rejoins under a new node id (after an eviction)
    carries its run; one that reconnects resumes its round or holds its node
    secret: each is told job_finished, and nothing changes."""
    (a, b) = await run_once(connect, "late", ["a", "b"])
    before = await get_json(client, "/v1/jobs/late")
    for msg in (
        join_msg("late", "a-new-id", run=1),
        join_msg("late", "b", resume_round=0),
    ):
        agent = await connect()
        await agent.send(msg)
        err = await agent.expect("error")
        assert err.code == "job_finished" and "run 1" in err.message, err
    await a.send(join_msg("late", "a"))  # the connection that holds a's node secret
    assert (await a.expect("error")).code == "job_finished"
    after = await get_json(client, "/v1/jobs/late")
    assert (after["run"], after["state"], after["runs"]) == (1, "succeeded", []), after
    assert [n["node_id"] for n in after["nodes"]] == [n["node_id"] for n in before["nodes"]]


async def test_a_late_agent_of_run_1_cannot_join_run_2(client, connect):
    await run_once(connect, "two", ["a"], nnodes=(1, 2))
    fresh = await connect()
    await fresh.send(join_msg("two", "c", nnodes=(1, 2)))
    assert (await fresh.expect("joined")).run == 2
    late = await connect()
    await late.send(join_msg("two", "a-again", nnodes=(1, 2), run=1))
    err = await late.expect("error")
    assert err.code == "job_finished" and "run 1" in err.message and "run 2" in err.message, err
    view = await get_json(client, "/v1/jobs/two")
    assert [n["node_id"] for n in view["nodes"] + view["spares"]] == ["c"], view


async def test_a_removed_job_is_not_recreated_by_a_late_agent(make_client, tmp_path):
    """With a data dir every job an agent heard of is on disk: a join that
    carries a run for a job the server no longer has (deleted, or past
    --retain-finished) is a late agent. A fresh join creates the job anew."""
    client = await make_client(Settings(data_dir=tmp_path / "data"))
    ws = await client.ws_connect(AGENT_PATH)
    try:
        late = Agent(ws)
        await late.send(join_msg("gone", "a", run=3))
        err = await late.expect("error")
        assert err.code == "job_finished" and "not on this server" in err.message, err
        assert (await client.get("/v1/jobs/gone")).status == 404
        await late.send(join_msg("gone", "b"))
        assert (await late.expect("joined")).run == 1
    finally:
        await ws.close()


async def test_a_memory_only_server_takes_an_agents_run_back_after_a_restart(client, connect):
    """Without a data dir the server cannot tell a removed job from one it forgot
    in a restart: the agents' run comes back with them."""
    agent = await connect()
    await agent.send(join_msg("back", "a", nnodes=(1, 1), run=4))
    assert (await agent.expect("joined")).run == 4
    assert (await get_json(client, "/v1/jobs/back"))["run"] == 4


async def test_the_agent_link_carries_its_run_into_every_later_join(client):
    """The real AgentLink under the node's session: it learns its run from
    ``joined``; after the job ended, its join under a new node id (what an
    evicted agent sends) is told job_finished, while a fresh agent starts run 2."""

    def on(link: AgentLink, node_id: str) -> NodeSession:
        s = NodeSession(job_id="linked", host="h", nproc=1, spec=JobSpec(min_nodes=1, max_nodes=2), addr="127.0.0.1")
        s.node_id = node_id
        s.link = link
        return s

    port = client.server.port
    old, fresh = AgentLink(f"127.0.0.1:{port}", heartbeat_s=1.0), AgentLink(f"127.0.0.1:{port}", heartbeat_s=1.0)
    old_node, fresh_node = on(old, "n1"), on(fresh, "n2")
    await old.start()
    await fresh.start()
    try:
        old_node.join()
        assert (await asyncio.wait_for(old.recv(), 3)).run == 1
        assert old_node.run == 1 and old.intent["run"] == 1
        await client.post("/v1/jobs/linked/close")
        while (await asyncio.wait_for(old.recv(), 3)).op != "done":
            pass
        # as after an eviction: a new node id (no node secret: only the run says who it is),
        # sent when the link reconnects
        old_node.node_id = "n1-evicted"
        old.set_intent(old_node.join_msg(), send=False)
        assert old.intent["run"] == 1 and old.intent["node_secret"] is None
        assert old._ws is not None
        await old._ws.close()
        err = await asyncio.wait_for(old.recv(), 10)
        assert err.op == "error" and err.code == "job_finished" and "run 1" in err.message, err
        fresh_node.join()
        assert (await asyncio.wait_for(fresh.recv(), 3)).run == 2
        view = await get_json(client, "/v1/jobs/linked")
        assert (view["run"], [n["node_id"] for n in view["nodes"]]) == (2, ["n2"]), view
    finally:
        await old.close()
        await fresh.close()
