"""Restart storms through the real app: worker failures that bring no progress
end the job with ``stop: "no_progress"`` and the reason, told to every agent."""

from __future__ import annotations

from rdzv_common.protocol import ExitRecord, FailedMsg, HeartbeatMsg, JobSpec

from .conftest import join_msg

SPEC = JobSpec(min_nodes=2, max_nodes=2, max_restarts=10, storm_restarts=2, min_round_s=3600.0)


async def until(agent, op):
    while (msg := await agent.recv()).op != op:
        pass
    return msg


async def test_a_storm_of_failures_without_progress_ends_the_job_with_the_reason(client, connect):
    agents = [await connect() for _ in range(2)]
    nodes = ["a", "b"]
    for agent, node in zip(agents, nodes):
        await agent.send(join_msg("storm", node, spec=SPEC))
    for agent in agents:
        await until(agent, "assigned")
    fail = [ExitRecord(local_rank=0, rank=0, pid=1, exit_code=1, message="RuntimeError: boom")]
    for r in range(4):
        # every round, a node reports step 5 again (restarted from its checkpoint) and the
        # other's workers fail (by turns: 3 failures on one host would cool it down)
        await agents[1 - r % 2].send(HeartbeatMsg(step=5, rate=1.0))
        await agents[r % 2].send(FailedMsg(round=r, failures=fail))
        if r == 3:
            break
        for agent in agents:
            await until(agent, "restart")
        for agent, node in zip(agents, nodes):
            await agent.send(join_msg("storm", node, spec=SPEC))
        for agent in agents:
            await until(agent, "assigned")
    # round 0 made progress (step 5); rounds 1 and 2 did not: 2 restarts without progress,
    # so round 3's failure stops the job
    for agent in agents:
        done = await until(agent, "done")
        assert done.state == "failed" and done.stop == "no_progress", done
        assert done.reason.startswith("no progress in 2 restarts") and "boom" in done.reason, done
    resp = await client.get("/v1/jobs/storm")
    view = await resp.json()
    assert view["state"] == "failed" and view["restarts"] == 3, view
    assert view["root_cause"].startswith("no progress in 2 restarts"), view


async def test_a_bad_storm_setting_is_refused_and_creates_nothing(client, connect):
    agent = await connect()
    join = join_msg("bad", "a").model_dump(mode="json")
    join["spec"]["storm_restarts"] = -1
    await agent.send(join)
    err = await agent.expect("error")
    assert err.code == "validation_error" and "storm_restarts" in err.message, err
    resp = await client.get("/v1/jobs/bad")
    assert resp.status == 404
