"""A failed job explained in one place (issue 25, item 5), against the real app
with simulated agents over its WebSocket: the failing rank's last stderr lines
travel with its failure report and show in the job view (``rdzv status``'s
text is rendered from it), in the node_failed event, and the nodes that left
stay listed with when and why; hostile tails are refused or escaped; an
in-place store port taken by another process re-forms without a charge."""

from __future__ import annotations

import asyncio

from rdzv_client.cli import render_job
from rdzv_common.protocol import MAX_STDERR_LINE, MAX_STDERR_LINES, ExitRecord, FailedMsg, JobView, LeaveMsg
from tests.api.conftest import form, join_msg
from tests.api.test_events import open_stream
from tests.api.test_rest import get_json, wait_for_job

TAIL = [
    "Traceback (most recent call last):",
    '  File "train.py", line 7, in <module>',
    "\x1b[31mValueError: loss is nan\x1b[0m",
    "<script>alert(1)</script> \u202eevil",
]


def boom(rank: int, stderr: list[str] | None = TAIL, **kw) -> ExitRecord:
    return ExitRecord(
        local_rank=0, rank=rank, pid=4242, exit_code=1, message="ValueError: loss is nan", stderr=stderr, **kw
    )


async def test_the_failing_ranks_last_stderr_lines_show_in_the_view_the_status_and_the_event(client, connect):
    (a1, a2), _ = await form(connect, "why1", ["node1", "node2"])
    stream = await open_stream(client, "/v1/jobs/why1/events")
    await a2.send(FailedMsg(round=0, failures=[boom(1)]))
    failed = (await stream.until("node_failed"))[-1]["data"]
    stream.close()
    # the event: the first failure's record carries the lines, control characters escaped
    assert failed["exit"]["stderr"][:2] == TAIL[:2]
    assert failed["exit"]["stderr"][2] == "\\x1b[31mValueError: loss is nan\\x1b[0m"
    assert "\u202e" not in failed["exit"]["stderr"][3] and "\\u202e" in failed["exit"]["stderr"][3]
    view = await wait_for_job(client, "why1", lambda v: v["round"] == 1)
    c = view["culprit"]
    assert (c["node_id"], c["host"], c["rank"], c["local_rank"], c["round"]) == ("node2", "node2", 1, 0, 0)
    assert "loss is nan" in c["cause"] and c["stderr"] == failed["exit"]["stderr"]
    text = render_job(JobView.model_validate(view))
    assert "last failure: node node2 (node2), rank 1 (local rank 0), round 0" in text
    assert "  | \\x1b[31mValueError: loss is nan\\x1b[0m" in text and "\x1b" not in text


async def test_a_tail_beyond_the_wire_bounds_is_refused_and_changes_nothing(client, connect):
    (a1, a2), _ = await form(connect, "why2", ["node1", "node2"])
    for bad in (["x"] * (MAX_STDERR_LINES + 1), ["y" * (MAX_STDERR_LINE + 1)]):
        frame = FailedMsg(round=0, failures=[boom(1, stderr=None)]).model_dump(mode="json")
        frame["failures"][0]["stderr"] = bad
        await a2.send(frame)
        err = await a2.expect("error")
        assert err.code == "validation_error" and "stderr" in err.message, err
    view = await get_json(client, "/v1/jobs/why2")
    assert view["round"] == 0 and view["restarts"] == 0 and view["culprit"] is None


async def test_a_report_without_a_tail_is_the_frame_it_always_was(client, connect):
    """Left out when None: an agent with nothing to send sends what older servers read."""
    frame = FailedMsg(round=0, failures=[boom(1, stderr=None)]).model_dump_json()
    assert "stderr" not in frame
    (a1, a2), _ = await form(connect, "why3", ["node1", "node2"])
    await a2.send(frame)
    view = await wait_for_job(client, "why3", lambda v: v["round"] == 1)
    assert view["culprit"]["stderr"] == [] and view["restarts"] == 1


async def test_nodes_that_left_stay_listed_with_when_and_why(client, connect):
    (a1, a2, a3), _ = await form(connect, "why4", ["node1", "node2", "node3"], nnodes=(1, 3))
    await a3.send(LeaveMsg(reason="sigterm from the scheduler"))
    a2.ws._response.connection.transport.abort()  # a process that died: no leave
    view = await wait_for_job(client, "why4", lambda v: len(v["departed"]) == 2, timeout=10.0)
    left = {d["node_id"]: d for d in view["departed"]}
    assert "left (sigterm from the scheduler)" in left["node3"]["reason"]
    assert left["node2"]["reason"] == "connection lost"
    assert all(d["left_at"] > 0 and d["host"] == d["node_id"] for d in left.values())
    assert [n["node_id"] for n in view["nodes"]] == ["node1"]
    text = render_job(JobView.model_validate(view))
    assert "nodes that left:" in text and "node3 (node3) left at " in text


async def test_an_in_place_store_port_taken_re_forms_without_a_charge(client, connect):
    """Rank 0's worker could not bind the round's store port (another process took
    it): not the training's fault. A new round, nothing charged, no host cool-down."""
    from rdzv_common.protocol import JobSpec

    spec = JobSpec(min_nodes=2, max_nodes=2, max_restarts=0, restart_mode="in-place")
    agents = [await connect() for _ in range(2)]
    for agent, node in zip(agents, ("node1", "node2"), strict=True):
        await agent.send(join_msg("why5", node, spec=spec))
    for agent in agents:
        await agent.expect("joined")
        await agent.expect("assigned")
    await agents[0].send(FailedMsg(round=0, failures=[boom(0, reason="store_port")]))
    for agent in agents:
        restart = await agent.expect("restart")
        assert "store port taken, not charged" in restart.reason
    await agents[0].expect("ack")
    view = await get_json(client, "/v1/jobs/why5")
    assert view["state"] == "waiting" and view["round"] == 1 and view["restarts"] == 0
    host = await get_json(client, "/v1/hosts/node1", status=404)
    assert host["code"] == "not_found"
    for agent, node in zip(agents, ("node1", "node2"), strict=True):
        await agent.send(join_msg("why5", node, spec=spec))
    got = await asyncio.gather(*(a.expect("joined") for a in agents))
    assert len(got) == 2


async def test_the_job_list_newest_first_pages_and_says_why_each_ended(client, connect):
    """?order=newest (the /ui's list): newest first, paged with the same cursors; each
    summary's reason says how it ended, or why its latest round opened."""
    for i in range(5):
        agent = await connect()
        await agent.send(join_msg(f"list{i}", f"n{i}", (1, 1)))
        await agent.expect("joined")
        await agent.expect("assigned")
        if i == 3:
            await agent.send(FailedMsg(round=0, failures=[boom(0)]))
    oldest = [j["job_id"] for j in (await get_json(client, "/v1/jobs?limit=1000"))["jobs"]]
    assert oldest == [f"list{i}" for i in range(5)]
    seen, cursor = [], ""
    while True:
        page = await get_json(client, f"/v1/jobs?order=newest&limit=2&cursor={cursor}")
        seen += [j["job_id"] for j in page["jobs"]]
        if not page["next_cursor"]:
            break
        cursor = page["next_cursor"]
    assert seen == oldest[::-1]
    view = await wait_for_job(client, "list3", lambda v: v["round"] == 1)
    reasons = {j["job_id"]: j["reason"] for j in (await get_json(client, "/v1/jobs?order=newest"))["jobs"]}
    assert reasons["list3"].startswith("worker failure: node n3 (n3) rank 0") and len(reasons["list3"]) <= 160
    assert view["history"][-1]["reason"].startswith(reasons["list3"].removesuffix("...[truncated]"))
    first = (await get_json(client, "/v1/jobs/list0"))["history"][0]["reason"]
    assert reasons["list0"] == first and first  # a running job: why its round opened
    bad = await get_json(client, "/v1/jobs?order=sideways", status=422)
    assert bad["code"] == "validation_error" and "order" in bad["message"]


async def test_the_hosts_page_and_its_script_are_served_like_the_others(client):
    resp = await client.get("/ui/hosts")
    assert resp.status == 200 and resp.content_type == "text/html"
    page = await resp.text()
    assert "/ui/static/explain.js" in page and 'id="hosts-body"' in page
    for name in ("explain.js", "workers.js"):
        resp = await client.get(f"/ui/static/{name}")
        assert resp.status == 200 and resp.content_type == "text/javascript"
        assert "innerHTML" not in await resp.text()
