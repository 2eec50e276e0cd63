"""Progress sent with heartbeats (issue 15): the second, validated heartbeat
form, the job view's per-node fields, /metrics, and hostile input."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from rdzv_common.protocol import HeartbeatMsg, JobSpec, RankTiming

from .conftest import form, join_msg


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


async def test_rank_timings_show_per_rank_in_the_job_view_and_bad_ones_change_nothing(client, connect) -> None:
    """Per-rank timings (issue 20 item 6) ride on a progress heartbeat: the job
    view shows them per node and global rank; a heartbeat with bad timings is
    refused with a clear error and changes nothing (step, rate, timings)."""
    agents, assigned = await form(connect, "t", ["n0", "n1"], nproc=2)
    timings = [
        RankTiming(local_rank=0, window_s=2.0, steps=10, compute_s=0.4, wait_s=1.5),
        RankTiming(local_rank=1, window_s=2.0, steps=10, compute_s=1.9, wait_s=0.05),
    ]
    await agents[1].send(HeartbeatMsg(step=10, rate=5.0, timings=timings))
    for _ in range(200):
        nodes = {n["node_id"]: n for n in (await _view(client, "t"))["nodes"]}
        if nodes["n1"]["timings"] is not None:
            break
        await asyncio.sleep(0.01)
    offset = assigned["n1"].rank_offset
    shown = nodes["n1"]["timings"]
    assert [(t["rank"], t["local_rank"], t["compute_s"], t["wait_s"], t["steps"]) for t in shown] == [
        (offset, 0, 0.4, 1.5, 10),
        (offset + 1, 1, 1.9, 0.05, 10),
    ], shown
    assert all(t["window_s"] == 2.0 and t["age_s"] >= 0 for t in shown)
    assert nodes["n0"]["timings"] is None  # its ranks do not time
    ok = {"local_rank": 0, "window_s": 1.0, "steps": 1, "compute_s": 0.5, "wait_s": 0.5}
    for bad, says in (
        ({**ok, "compute_s": -0.1}, "compute_s"),
        ({**ok, "wait_s": float("inf")}, "wait_s"),
        ({**ok, "local_rank": 2}, "local rank 2, but node 'n1' has 2 local rank(s)"),  # the node has 2
    ):
        body = HeartbeatMsg(step=99, rate=9.0).model_dump(mode="json") | {"timings": [bad]}
        await agents[1].send(json.dumps(body, allow_nan=True))
        err = await agents[1].expect("error")
        assert err.code.value == "validation_error" and says in err.message and "\n" not in err.message, err
    nodes = {n["node_id"]: n for n in (await _view(client, "t"))["nodes"]}
    assert nodes["n1"]["step"] == 10 and nodes["n1"]["steps_per_s"] == 5.0
    assert [t["compute_s"] for t in nodes["n1"]["timings"]] == [0.4, 1.9]
    assert not agents[1].ws.closed
    # the next progress heartbeat without timings: its ranks stopped timing (nothing stale shown)
    await agents[1].send(HeartbeatMsg(step=11, rate=5.0))
    for _ in range(200):
        nodes = {n["node_id"]: n for n in (await _view(client, "t"))["nodes"]}
        if nodes["n1"]["step"] == 11:
            break
        await asyncio.sleep(0.01)
    assert nodes["n1"]["timings"] is None


async def test_a_slow_node_is_flagged_straggler_in_the_view_and_the_log(client, connect, monkeypatch, caplog) -> None:
    from rdzv_server.rounds import progress

    monkeypatch.setattr(progress, "STRAGGLER_CHECK_S", 0.0)
    spec = JobSpec(min_nodes=3, max_nodes=3, straggler_window_s=0.001)  # flag on the second slow check
    agents = await _form_spec(connect, "s", ["n0", "n1", "n2"], spec)
    await _slow_n2(client, "s", agents, 100)

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
    from rdzv_common.protocol import JobSpec

    from .conftest import join_msg

    a, b = await connect(), await connect()
    await a.send(join_msg("h", "n0", spec=JobSpec(min_nodes=2, max_nodes=2, hang_timeout_s=60.0)))
    await a.expect("joined")
    await b.send(join_msg("h", "n1", spec=JobSpec(min_nodes=2, max_nodes=2)))
    err = await b.expect("error")
    assert err.code.value == "spec_mismatch" and "hang_timeout_s" in err.message, err
    view = await _view(client, "h")
    assert [n["node_id"] for n in view["nodes"]] == ["n0"]


async def _form_spec(connect, job_id: str, node_ids: list[str], spec: JobSpec) -> list:
    """Join ``node_ids`` with ``spec`` and wait until each is assigned."""
    agents = [await connect() for _ in node_ids]
    for agent, node_id in zip(agents, node_ids):
        await agent.send(join_msg(job_id, node_id, spec=spec))
    for agent in agents:
        await agent.expect("joined")
        await agent.expect("assigned")
    return agents


async def _slow_n2(client, job_id: str, agents: list, steps: int) -> None:
    """n0 and n1 at 10 steps/s, n2 at 1; once the server has all three rates
    (three connections: any order), heartbeats from n0 for the checks after
    the window (the first slow check starts it)."""
    for agent, rate in zip(agents, (10.0, 10.0, 1.0)):
        await agent.send(HeartbeatMsg(step=steps, rate=rate))
    for _ in range(500):
        if all(n["steps_per_s"] is not None for n in (await _view(client, job_id))["nodes"]):
            break
        await asyncio.sleep(0.01)
    for i in range(1, 3):
        await agents[0].send(HeartbeatMsg(step=steps + i, rate=10.0))
        await asyncio.sleep(0.01)


async def test_straggler_policy_replace_a_waiting_spare_takes_the_stragglers_place(
    client, connect, monkeypatch, caplog
) -> None:
    from rdzv_server.rounds import progress

    monkeypatch.setattr(progress, "STRAGGLER_CHECK_S", 0.0)
    spec = JobSpec(min_nodes=3, max_nodes=3, straggler_policy="replace", straggler_window_s=0.001)
    agents = await _form_spec(connect, "r", ["n0", "n1", "n2"], spec)
    spare = await connect()
    await spare.send(join_msg("r", "n3", spec=spec))
    await spare.expect("joined")
    await spare.expect("spare")
    await _slow_n2(client, "r", agents, 100)
    for agent in agents:  # a new round opens at once, and says why
        restart = await agent.expect("restart")
        assert restart.round == 1 and "straggler: node(s) n2 (n2) replaced by a spare" in restart.reason
    await agents[2].send(join_msg("r", "n2", spec=spec))  # the straggler rejoins: a spare, told why
    await agents[2].expect("joined")
    told = await agents[2].expect("spare")
    assert told.reason is not None and "replaced as a straggler: 1 steps/s" in told.reason
    for agent, node_id in zip(agents[:2], ("n0", "n1")):
        await agent.send(join_msg("r", node_id, spec=spec))
    for agent in agents[:2]:
        await agent.expect("joined")
        assert (await agent.expect("assigned")).assignment.round == 1
    assert (await spare.expect("assigned")).assignment.round == 1
    view = await _view(client, "r")
    assert view["round"] == 1 and view["restarts"] == 0 and view["state"] == "running"
    assert sorted(n["node_id"] for n in view["nodes"]) == ["n0", "n1", "n3"]
    assert [n["node_id"] for n in view["spares"]] == ["n2"]
    assert "straggler" in view["history"][-1]["reason"]
    assert any("is a straggler: 1 steps/s" in r.getMessage() for r in caplog.records)


async def test_a_straggler_replacement_logs_its_lines_with_their_event_fields(
    client, connect, monkeypatch, caplog
) -> None:
    """The round a replacement opens is logged as every round_opened line is
    (event, reason, waiting_for, restarts), after the save; the straggler's
    line names its node and the round it was flagged in."""
    from rdzv_server.rounds import progress

    monkeypatch.setattr(progress, "STRAGGLER_CHECK_S", 0.0)
    caplog.set_level("INFO", logger="rdzv_server")
    spec = JobSpec(min_nodes=3, max_nodes=3, straggler_policy="replace", straggler_window_s=0.001)
    agents = await _form_spec(connect, "rl", ["n0", "n1", "n2"], spec)
    spare = await connect()
    await spare.send(join_msg("rl", "n3", spec=spec))
    await spare.expect("joined")
    await spare.expect("spare")
    await _slow_n2(client, "rl", agents, 100)
    for agent in agents:
        await agent.expect("restart")
    opened = [r for r in caplog.records if getattr(r, "rdzv", {}).get("event") == "round_opened"]
    assert len(opened) == 1, [r.getMessage() for r in caplog.records]
    f = opened[0].rdzv
    assert f["job"] == "rl" and f["round"] == 1 and f["restarts"] == 0 and f["waiting_for"] is not None
    assert "straggler: node(s) n2 (n2) replaced by a spare" in f["reason"]
    flagged = [r for r in caplog.records if "is a straggler: 1 steps/s" in r.getMessage()]
    assert len(flagged) == 1 and flagged[0].rdzv["node"] == "n2" and flagged[0].rdzv["round"] == 0


async def test_a_straggler_replacement_whose_save_fails_says_nothing(
    make_client, connect, tmp_path, monkeypatch, caplog
) -> None:
    """Persist, then log: a replacement whose write fails is refused (its
    agents reconnect) and no line says a round opened or a node was replaced."""
    import sqlite3

    from rdzv_server.app import Settings
    from rdzv_server.keys import STORE
    from rdzv_server.rounds import progress

    monkeypatch.setattr(progress, "STRAGGLER_CHECK_S", 0.0)
    client = await make_client(Settings(data_dir=tmp_path))
    spec = JobSpec(min_nodes=3, max_nodes=3, straggler_policy="replace", straggler_window_s=0.001)
    agents = await _form_spec(lambda: connect(on=client), "rf", ["n0", "n1", "n2"], spec)
    spare = await connect(on=client)
    await spare.send(join_msg("rf", "n3", spec=spec))
    await spare.expect("joined")
    await spare.expect("spare")
    for agent, rate in zip(agents, (10.0, 10.0, 1.0)):
        await agent.send(HeartbeatMsg(step=100, rate=rate))
    for _ in range(500):
        if all(n["steps_per_s"] is not None for n in (await _view(client, "rf"))["nodes"]):
            break
        await asyncio.sleep(0.01)

    def broken(job, now):
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(client.app[STORE].db, "save", broken)
    caplog.clear()
    for step in range(101, 104):  # the first slow check starts the window, a later one replaces
        with contextlib.suppress(ConnectionResetError):  # refused at once: the connection is closing
            await agents[0].send(HeartbeatMsg(step=step, rate=10.0))
        await asyncio.sleep(0.01)
    await agents[2].wait_closed()  # refused: its agents reconnect
    assert any("cannot save state" in r.getMessage() for r in caplog.records)
    said = [r.getMessage() for r in caplog.records if "replaced by a spare" in r.getMessage()]
    assert said == [], said


async def test_straggler_policy_replace_without_a_spare_flags_only_and_says_so(
    client, connect, monkeypatch, caplog
) -> None:
    from rdzv_server.rounds import progress

    monkeypatch.setattr(progress, "STRAGGLER_CHECK_S", 0.0)
    spec = JobSpec(min_nodes=3, max_nodes=3, straggler_policy="replace", straggler_window_s=0.001)
    agents = await _form_spec(connect, "w", ["n0", "n1", "n2"], spec)
    await _slow_n2(client, "w", agents, 100)
    for _ in range(200):
        nodes = {n["node_id"]: n for n in (await _view(client, "w"))["nodes"]}
        if nodes["n2"]["straggler"]:
            break
        await asyncio.sleep(0.01)
    assert nodes["n2"]["straggler"] and "no spare waits" in (nodes["n2"]["straggler_note"] or ""), nodes
    view = await _view(client, "w")
    assert view["round"] == 0 and view["state"] == "running" and len(view["nodes"]) == 3
    assert any("is kept: no spare waits" in r.getMessage() for r in caplog.records)
    with pytest.raises(asyncio.TimeoutError):  # nobody is told to restart
        await agents[2].recv(timeout=0.5)


async def test_a_join_with_another_straggler_policy_is_refused_and_changes_nothing(client, connect) -> None:
    spec = JobSpec(min_nodes=2, max_nodes=2, straggler_policy="replace")
    await _form_spec(connect, "m", ["n0", "n1"], spec)
    other = await connect()
    await other.send(join_msg("m", "n2", spec=JobSpec(min_nodes=2, max_nodes=2)))
    err = await other.expect("error")
    assert err.code.value == "spec_mismatch" and "straggler_policy replace" in err.message
    await other.send(
        '{"op":"join","job_id":"m","node_id":"n3","host":"h","addr":"a","local_world_size":1,"master_port":1,'
        '"spec":{"min_nodes":2,"max_nodes":2,"straggler_policy":"evict"}}'
    )
    err = await other.expect("error")
    assert err.code.value == "validation_error" and "\n" not in err.message
    view = await _view(client, "m")
    assert view["round"] == 0 and len(view["nodes"]) == 2 and view["spares"] == []
