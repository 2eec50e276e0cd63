"""Progress sent with heartbeats (issue 15): the second, validated heartbeat
form, the job view's per-node fields, /metrics, and hostile input."""

from __future__ import annotations

import asyncio

from rdzv_server.protocol import HeartbeatMsg

from .conftest import form


async def _view(client, job_id: str) -> dict:
    return await (await client.get(f"/v1/jobs/{job_id}")).json()


async def test_progress_heartbeats_show_in_the_job_view_and_metrics(client, connect) -> None:
    agents, _ = await form(connect, "p", ["n0", "n1"])
    view = await _view(client, "p")
    assert all(
        n["step"] is None and n["steps_per_s"] is None and n["since_progress_s"] is None for n in view["nodes"]
    ), view["nodes"]
    await agents[0].send(HeartbeatMsg(step=12, rate=3.5))
    await agents[1].send(HeartbeatMsg())  # a plain heartbeat: no progress

    async def node0() -> dict:
        for _ in range(200):
            nodes = {n["node_id"]: n for n in (await _view(client, "p"))["nodes"]}
            if nodes["n0"]["step"] is not None:
                return nodes
            await asyncio.sleep(0.01)
        raise AssertionError("progress never showed")

    nodes = await node0()
    assert nodes["n0"]["step"] == 12 and nodes["n0"]["steps_per_s"] == 3.5
    assert nodes["n0"]["since_progress_s"] >= 0
    assert nodes["n1"]["step"] is None
    text = await (await client.get("/metrics")).text()
    assert 'rdzv_job_since_progress_seconds{job_id="p"}' in text
    # one series per job, never per node
    assert "n0" not in "".join(ln for ln in text.splitlines() if "since_progress" in ln)


async def test_invalid_progress_heartbeat_is_refused_and_changes_nothing(client, connect) -> None:
    agents, _ = await form(connect, "q", ["n0", "n1"])
    await agents[0].send(HeartbeatMsg(step=5, rate=1.0))
    for bad in (
        '{"op":"hb","step":-3}',
        '{"op":"hb","step":"5"}',
        '{"op":"hb","rate":-1}',
        '{"op":"hb","step":1,"evil":true}',
    ):
        await agents[0].send(bad)
        err = await agents[0].expect("error")
        assert err.code.value == "validation_error" and "\n" not in err.message
    nodes = {n["node_id"]: n for n in (await _view(client, "q"))["nodes"]}
    assert nodes["n0"]["step"] == 5 and nodes["n0"]["steps_per_s"] == 1.0
    assert not agents[0].ws.closed


async def test_a_slow_node_is_flagged_straggler_in_the_view_and_the_log(client, connect, monkeypatch, caplog) -> None:
    from rdzv_server.rounds import progress

    monkeypatch.setattr(progress, "STRAGGLER_WINDOW_S", 0.0)  # flag on the first slow check
    monkeypatch.setattr(progress, "STRAGGLER_CHECK_S", 0.0)
    agents, _ = await form(connect, "s", ["n0", "n1", "n2"])
    for agent, rate in zip(agents, (10.0, 10.0, 1.0)):
        await agent.send(HeartbeatMsg(step=100, rate=rate))
    await agents[0].send(HeartbeatMsg(step=101, rate=10.0))  # a check after all three rates are in

    for _ in range(200):
        nodes = {n["node_id"]: n for n in (await _view(client, "s"))["nodes"]}
        if nodes["n2"]["straggler"]:
            break
        await asyncio.sleep(0.01)
    assert nodes["n2"]["straggler"] and not nodes["n0"]["straggler"] and not nodes["n1"]["straggler"], nodes
    assert any(
        "node n2 (" in r.getMessage() and "is a straggler: 1 steps/s" in r.getMessage() for r in caplog.records
    ), [r.getMessage() for r in caplog.records]


async def test_a_join_with_another_hang_timeout_is_refused_naming_the_field(client, connect) -> None:
    from rdzv_server.protocol import JobSpec

    from .conftest import join_msg

    a, b = await connect(), await connect()
    await a.send(join_msg("h", "n0", spec=JobSpec(min_nodes=2, max_nodes=2, hang_timeout_s=60.0)))
    await a.expect("joined")
    await b.send(join_msg("h", "n1", spec=JobSpec(min_nodes=2, max_nodes=2)))
    err = await b.expect("error")
    assert err.code.value == "spec_mismatch" and "hang_timeout_s" in err.message, err
    view = await _view(client, "h")
    assert [n["node_id"] for n in view["nodes"]] == ["n0"]
