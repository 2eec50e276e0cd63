"""The job lifecycle through the real app (issue 12): a node whose launcher
gives up ends the job for every agent; a finished job id starts a new run
while late agents of the old run are told it finished."""

from __future__ import annotations

from rdzv_server.protocol import ExitRecord, FailedMsg, JobSpec

from .conftest import form, join_msg

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
