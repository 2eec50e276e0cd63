"""Nothing kept forever, nothing that grows with idle jobs: deleting finished
jobs, the cap on jobs waiting for nodes, paging /v1/jobs, /metrics off the
loop, and the OpenAPI document. The real app in process."""

from __future__ import annotations

import asyncio
import threading

from openapi_spec_validator import validate

from rdzv_common.protocol import ID_PATTERN, SucceededMsg
from rdzv_server.app import Settings, openapi_document
from rdzv_server.keys import METRICS

from .conftest import form, join_msg


async def get(client, path: str, status: int = 200):
    resp = await client.get(path)
    assert resp.status == status, (resp.status, await resp.text())
    return await resp.json()


async def finish(connect, job_id: str) -> None:
    """A 1:1 job that ran round 0 and succeeded."""
    (agent,), _ = await form(connect, job_id, ["node1"])
    await agent.send(SucceededMsg(round=0))
    await agent.expect("done")


async def test_delete_a_finished_job_removes_it_everywhere(client, connect):
    """DELETE of a finished job: gone from its view, the listing and /metrics;
    a second DELETE is a 404; the id can then start a new job."""
    await finish(connect, "old")
    assert 'job_id="old"' in await (await client.get("/metrics")).text()
    resp = await client.delete("/v1/jobs/old")
    assert resp.status == 200, await resp.text()
    assert await resp.json() == {"job_id": "old", "state": "succeeded", "deleted": True}
    body = await get(client, "/v1/jobs/old", 404)
    assert body["code"] == "job_not_found"
    assert "old" not in [j["job_id"] for j in (await get(client, "/v1/jobs"))["jobs"]]
    assert 'job_id="old"' not in await (await client.get("/metrics")).text()
    again = await client.delete("/v1/jobs/old")
    assert again.status == 404 and (await again.json())["code"] == "job_not_found"
    _, got = await form(connect, "old", ["node1"])
    assert got["node1"].round == 0
    assert (await get(client, "/v1/jobs/old"))["state"] == "running"


async def test_delete_a_live_job_is_refused_and_changes_nothing(client, connect):
    """A waiting or running job cannot be deleted: 409 telling to close it first."""
    agent = await connect()
    await agent.send(join_msg("live", "node1"))
    await agent.expect("joined")
    resp = await client.delete("/v1/jobs/live")
    assert resp.status == 409
    body = await resp.json()
    assert body["code"] == "job_not_finished" and "close it first" in body["message"], body
    assert (await get(client, "/v1/jobs/live"))["state"] == "waiting"
    bad = await client.delete("/v1/jobs/a%20b")
    assert bad.status == 422 and (await bad.json())["code"] == "validation_error"


async def test_jobs_waiting_for_nodes_are_capped(make_client):
    """With --max-waiting-jobs 2 a third new job is refused (unavailable, saying
    why) and not created; joins to the waiting jobs still work, and once one
    forms there is room again."""
    client = await make_client(Settings(max_waiting_jobs=2))
    agents = []

    async def agent(job_id, node_id):
        a = await client.ws_connect("/v1/agent")
        agents.append(a)
        await a.send_str(join_msg(job_id, node_id).model_dump_json())
        return a

    for job_id in ("w1", "w2"):
        assert (await (await agent(job_id, "node1")).receive_json(timeout=3))["op"] == "joined"
    third = await agent("w3", "node1")
    refused = await third.receive_json(timeout=3)
    assert refused["op"] == "error" and refused["code"] == "unavailable", refused
    assert "2 jobs are waiting for nodes" in refused["message"] and "--max-waiting-jobs" in refused["message"]
    assert (await third.receive(timeout=3)).type.name in ("CLOSE", "CLOSING", "CLOSED")  # it will retry
    await get(client, "/v1/jobs/w3", 404)
    second = await agent("w1", "node2")  # an existing waiting job still forms
    assert (await second.receive_json(timeout=3))["op"] == "joined"
    assert (await get(client, "/v1/jobs/w1"))["state"] == "running"
    retry = await agent("w3", "node1")
    assert (await retry.receive_json(timeout=3))["op"] == "joined"
    for a in agents:
        await a.close()


async def test_list_jobs_in_pages(client, connect):
    """?limit pages in creation order with an opaque next_cursor; ?state filters;
    a job created between pages comes last, nothing is repeated or skipped."""
    for i in range(3):
        await form(connect, f"run{i}", ["node1"])
    for i in range(2):
        await finish(connect, f"done{i}")
    page = await get(client, "/v1/jobs?limit=2")
    assert [j["job_id"] for j in page["jobs"]] == ["run0", "run1"] and page["next_cursor"]
    await form(connect, "late", ["node1"])
    seen = [j["job_id"] for j in page["jobs"]]
    while page["next_cursor"]:
        page = await get(client, f"/v1/jobs?limit=2&cursor={page['next_cursor']}")
        seen += [j["job_id"] for j in page["jobs"]]
    assert seen == ["run0", "run1", "run2", "done0", "done1", "late"]
    running = await get(client, "/v1/jobs?state=running&limit=100")
    assert [j["job_id"] for j in running["jobs"]] == ["run0", "run1", "run2", "late"]
    assert running["next_cursor"] is None
    done = await get(client, "/v1/jobs?state=succeeded&limit=1")
    assert [j["job_id"] for j in done["jobs"]] == ["done0"]
    done = await get(client, f"/v1/jobs?state=succeeded&limit=1&cursor={done['next_cursor']}")
    assert [j["job_id"] for j in done["jobs"]] == ["done1"]


async def test_list_jobs_refuses_bad_parameters(client, connect):
    """Bad limit, state or cursor: 422 naming the parameter, as every refusal."""
    await form(connect, "one", ["node1"])
    for query, word in [
        ("limit=0", "limit"),
        ("limit=1001", "limit"),
        ("limit=x", "limit"),
        ("state=sleeping", "state"),
        ("cursor=not-ours", "cursor"),
        ("cursor=" + "A" * 600, "cursor"),
    ]:
        body = await get(client, f"/v1/jobs?{query}", 422)
        assert body["code"] == "validation_error" and word in body["message"], (query, body)
    assert [j["job_id"] for j in (await get(client, "/v1/jobs?limit=1000"))["jobs"]] == ["one"]


async def test_metrics_are_rendered_off_the_event_loop(client, connect):
    """While /metrics renders (here: held on purpose), the loop still answers
    /healthz: a large registry cannot stop the server."""
    await form(connect, "m", ["node1"])
    metrics = client.app[METRICS]
    events: list[str] = []
    started, release = threading.Event(), threading.Event()
    real_render = metrics.render

    def held_render() -> bytes:
        events.append("render started")
        started.set()
        release.wait(3)
        events.append("render done")
        return real_render()

    metrics.render = held_render
    try:
        pending = asyncio.ensure_future(client.get("/metrics"))
        await asyncio.to_thread(started.wait, 5)
        health = await asyncio.wait_for(client.get("/healthz"), 5)
        events.append(f"healthz {health.status}")
        release.set()
        resp = await asyncio.wait_for(pending, 5)
        assert resp.status == 200 and 'job_id="m"' in await resp.text()
    finally:
        release.set()
        metrics.render = real_render
    assert events == ["render started", "healthz 200", "render done"]


def test_openapi_is_a_valid_3_1_document_with_the_enforced_patterns():
    """openapi-spec-validator accepts /openapi.json as OpenAPI 3.1; it declares the
    job id pattern and lengths, DELETE, and the paging parameters."""
    doc = openapi_document()
    assert doc["openapi"] == "3.1.0"
    validate(doc)
    job = doc["paths"]["/v1/jobs/{job_id}"]
    param, limit, _cursor = job["get"]["parameters"]  # the job id; the page of its nodes
    assert limit["schema"]["maximum"] == 10_000
    assert param["schema"] == {"type": "string", "minLength": 1, "maxLength": 128, "pattern": ID_PATTERN}
    assert {"get", "delete"} <= job.keys() and "409" in job["delete"]["responses"]
    params = {p["name"]: p for p in doc["paths"]["/v1/jobs"]["get"]["parameters"]}
    assert params["limit"]["schema"]["minimum"] == 1 and params["limit"]["schema"]["maximum"] == 1000
    assert set(params["state"]["schema"]["enum"]) == {"waiting", "running", "succeeded", "failed", "closed"}
    assert params["cursor"]["schema"]["maxLength"] == 512


async def test_the_rest_client_walks_every_page(client, connect):
    """RestClient.all_jobs (what `rdzv status` uses) follows next_cursor to the end."""
    from rdzv_client.rest import RestClient

    for i in range(5):
        await form(connect, f"j{i}", ["node1"])
    rest = RestClient(f"127.0.0.1:{client.port}")
    listing = await rest.all_jobs(page=2)
    assert [j.job_id for j in listing.jobs] == [f"j{i}" for i in range(5)] and listing.next_cursor is None
    first = await rest.jobs(limit=2)
    assert len(first.jobs) == 2 and first.next_cursor


async def test_job_view_is_bounded(client, connect, monkeypatch):
    """A job view lists at most MAX_VIEW_NODES nodes (members by rank first) and the
    latest MAX_VIEW_HISTORY rounds, and says how many it left out."""
    from rdzv_common.protocol import ExitRecord, FailedMsg
    from rdzv_server import rounds

    agents, got = await form(connect, "big", [f"node{i}" for i in range(5)])
    nodes = list(got)

    async def until(agent, op):
        while (msg := await agent.recv()).op != op:
            pass
        return msg

    for r in range(2):  # a worker failure, twice: rounds 1 and 2
        await agents[0].send(FailedMsg(round=r, failures=[ExitRecord(local_rank=0, rank=0, pid=1, exit_code=1)]))
        for agent in agents:
            await until(agent, "restart")
        for agent, node in zip(agents, nodes):
            await agent.send(join_msg("big", node, (5, 5)))
        for agent in agents:
            await until(agent, "assigned")
    monkeypatch.setattr(rounds.views, "MAX_VIEW_NODES", 3)
    monkeypatch.setattr(rounds.views, "MAX_VIEW_HISTORY", 2)
    view = await get(client, "/v1/jobs/big")
    assert [n["group_rank"] for n in view["nodes"]] == [0, 1, 2] and view["nodes_omitted"] == 2
    assert [h["round"] for h in view["history"]] == [1, 2] and view["history_omitted"] == 1
