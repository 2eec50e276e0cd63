"""Hostile and broken requests: each gets a 4xx (or an error frame) with
{"code", "message"}, changes nothing, and never costs a 500."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import WSCloseCode, WSMsgType

from rdzv_common.protocol import MAX_BODY_BYTES, ExitRecord, FailedMsg, HeartbeatMsg, JobSpec, SucceededMsg
from rdzv_server.app import Settings

from .conftest import form, join_msg

GOOD_JOIN = json.loads(join_msg("newjob", "node9").model_dump_json())


def with_(path: str, value) -> str:
    """GOOD_JOIN with one dotted field replaced (or removed, for ...)."""
    msg = json.loads(json.dumps(GOOD_JOIN))
    *parents, last = path.split(".")
    target = msg
    for key in parents:
        target = target[key]
    if value is ...:
        del target[last]
    else:
        target[last] = value
    return json.dumps(msg)


BAD_FRAMES = {
    "not json": "hello",
    "truncated json": '{"op": "join", ',
    "json array": "[]",
    "json null": "null",
    "json number": "42",
    "empty object": "{}",
    "unknown op": '{"op": "reboot"}',
    "op wrong type": '{"op": 7}',
    "unknown field": with_("shell", "rm -rf /"),
    "unknown spec field": with_("spec.min_gpus", 8),
    "missing field": with_("node_id", ...),
    "wrong type nproc": with_("local_world_size", [4]),
    "wrong type job id": with_("job_id", 5),
    "nproc 0": with_("local_world_size", 0),
    "nproc huge": with_("local_world_size", 10**6),
    "min > max": with_("spec", {"min_nodes": 3, "max_nodes": 2}),
    "a billion nodes": with_("spec.max_nodes", 10**9),
    "zero nodes": with_("spec.min_nodes", 0),
    "negative restarts": with_("spec.max_restarts", -1),
    "infinite timeout": with_("spec.last_call_s", 1e309),
    "zero timeout": with_("spec.heartbeat_timeout_s", 0),
    "port 0": with_("master_port", 0),
    "port 70000": with_("master_port", 70000),
    "negative rank": with_("requested_rank", -1),
    "negative resume": with_("resume_round", -1),
    "10 kB job id": with_("job_id", "j" * 10_000),
    "10 kB node id": with_("node_id", "n" * 10_000),
    "empty id": with_("node_id", ""),
    "id with space": with_("job_id", "my job"),
    "id with slash": with_("job_id", "a/b"),
    "id with dotdot": with_("job_id", "../etc"),
    "id unicode": with_("node_id", "nøde-🙂"),
    "id with newline": with_("node_id", "node\n1"),
    "host with space": with_("host", "evil host"),
    "huge integer": with_("spec.max_restarts", 10**40),
    "failed without failures": '{"op": "failed", "round": 0, "failures": []}',
    "failed bad record": '{"op": "failed", "round": 0, "failures": [{"rank": "x"}]}',
    "succeeded round string": '{"op": "succeeded", "round": "zero"}',
    "succeeded round negative": '{"op": "succeeded", "round": -1}',
    "hb with extras": '{"op": "hb", "x": 1}',
    "leave reason too long": json.dumps({"op": "leave", "reason": "x" * 1000}),
    "deeply nested": "[" * 30_000,
    "deeply nested object": '{"op": "hb", "x": ' * 3000,
    "round overflows to inf": '{"op": "succeeded", "round": 1e999999}',
    "round above 2**53": '{"op": "succeeded", "round": 9007199254740993}',
    "fractional round": '{"op": "succeeded", "round": 1.5}',
    "1025 failures": json.dumps(
        {"op": "failed", "round": 0, "failures": [{"local_rank": 0, "rank": 0, "pid": 1}] * 1025}
    ),
}


def stable(view: dict) -> dict:
    """A job view without what moves with the clock alone."""
    view = json.loads(json.dumps(view))
    for node in view["nodes"] + view["spares"]:
        node.pop("last_seen_s")
    return view


async def snapshot(client) -> dict:
    """Everything REST shows: the job list and every job's view."""
    listing = await (await client.get("/v1/jobs")).json()
    views = {}
    for job in listing["jobs"]:
        resp = await client.get(f"/v1/jobs/{job['job_id']}")
        assert resp.status == 200
        views[job["job_id"]] = stable(await resp.json())
    return {"jobs": listing["jobs"], "views": views}


@pytest.fixture
async def world(client, connect):
    """A running 2:2 job 'base' (agents node1, node2) and a forming 2:3 job 'forming' with one node."""
    agents, _ = await form(connect, "base", ["node1", "node2"])
    lone = await connect()
    await lone.send(join_msg("forming", "node1", (2, 3)))
    await lone.expect("joined")
    return agents


async def expect_error(agent, *codes: str) -> str:
    msg = await agent.expect("error")
    assert msg.code.value in codes, msg
    assert msg.message
    return msg.message


@pytest.mark.parametrize("frame", BAD_FRAMES.values(), ids=BAD_FRAMES.keys())
async def test_bad_frames_get_an_error_frame_and_change_nothing(client, connect, world, frame):
    """A malformed, mistyped or out-of-range agent frame gets an error frame and the server state is unchanged."""
    before = await snapshot(client)
    fresh = await connect()
    await fresh.send(frame)
    await expect_error(fresh, "validation_error")
    member = world[0]  # the same frame from a joined member of a running job
    await member.send(frame)
    await expect_error(member, "validation_error")
    await fresh.send(HeartbeatMsg())  # the connection still works, and is still not joined
    await expect_error(fresh, "not_joined")
    assert await snapshot(client) == before


async def test_binary_frames_are_refused(client, connect, world):
    """A binary frame gets a bad_request error frame; the connection and the state survive."""
    before = await snapshot(client)
    for agent in (await connect(), world[0]):
        await agent.ws.send_bytes(join_msg("base", "node7").model_dump_json().encode())
        await expect_error(agent, "bad_request")
    await world[0].send(HeartbeatMsg())
    assert await snapshot(client) == before


async def test_oversized_frames_close_only_that_connection(client, connect, world):
    """A frame over 64 KiB closes that connection with 'message too big' and the server and other agents carry on."""
    before = await snapshot(client)
    fresh = await connect()
    await fresh.send(with_("host", "h" * (MAX_BODY_BYTES + 10)))
    frame = await asyncio.wait_for(fresh.ws.receive(), 3)
    assert frame.type in (WSMsgType.CLOSE, WSMsgType.CLOSED, WSMsgType.ERROR)
    if frame.type == WSMsgType.CLOSE:
        assert frame.data == WSCloseCode.MESSAGE_TOO_BIG
    assert await snapshot(client) == before
    assert (await client.get("/healthz")).status == 200
    another = await connect()
    await another.send(join_msg("forming", "node2", (2, 3)))
    assert (await another.expect("joined")).round == 0


async def test_invalid_utf8_text_frame_closes_only_that_connection(client, connect, world):
    """A text frame that is not UTF-8 closes that connection (1007) and the server carries on unchanged."""
    before = await snapshot(client)
    fresh = await connect()
    await fresh.ws.send_frame(b"\xff\xfe{", WSMsgType.TEXT)
    frame = await asyncio.wait_for(fresh.ws.receive(), 3)
    assert frame.type == WSMsgType.CLOSE and frame.data == WSCloseCode.INVALID_TEXT
    await world[0].send(HeartbeatMsg())
    assert await snapshot(client) == before


async def test_stale_rounds_are_refused(client, world):
    """Failure and success reports naming a round other than the running one get stale_round and change nothing."""
    a1, _ = world
    before = await snapshot(client)
    failures = [ExitRecord(local_rank=0, rank=0, pid=1, exit_code=1)]
    for msg in (
        FailedMsg(round=1, failures=failures),
        FailedMsg(round=99, failures=failures),
        SucceededMsg(round=1),
        SucceededMsg(round=2**53),
    ):
        await a1.send(msg)
        text = await expect_error(a1, "stale_round")
        assert "stale" in text and "round 0" in text
    assert await snapshot(client) == before


async def test_reports_before_join_are_refused(client, connect, world):
    """Reports, heartbeats and leaves from a connection that never joined get not_joined and change nothing."""
    before = await snapshot(client)
    fresh = await connect()
    for msg in (
        '{"op": "hb", "x": null}',
        FailedMsg(round=0, failures=[ExitRecord(local_rank=0, rank=0, pid=1)]),
        SucceededMsg(round=0),
        '{"op": "leave"}',
        '{"op":"hb"}',
    ):
        await fresh.send(msg)
        if isinstance(msg, str) and '"x"' in msg:
            await expect_error(fresh, "validation_error")
        else:
            await expect_error(fresh, "not_joined")
    assert await snapshot(client) == before


async def test_spec_mismatch_names_both_specs(client, connect, world):
    """A join with another min:max than the job's is refused with spec_mismatch naming both, changing nothing."""
    before = await snapshot(client)
    fresh = await connect()
    await fresh.send(join_msg("base", "node3", (1, 4)))
    text = await expect_error(fresh, "spec_mismatch")
    assert "2:2" in text and "1:4" in text
    await fresh.send(join_msg("forming", "node3", (2, 2)))
    text = await expect_error(fresh, "spec_mismatch")
    assert "2:3" in text and "2:2" in text
    assert await snapshot(client) == before


async def test_conflicting_joins_are_refused(client, connect, world):
    """A second identity on a joined connection, or a running node joining again, is refused without change."""
    a1, _ = world
    before = await snapshot(client)
    await a1.send(join_msg("base", "node3"))
    await expect_error(a1, "already_joined")
    await a1.send(join_msg("other-job", "node1"))
    await expect_error(a1, "already_joined")
    stranger = await connect()
    await stranger.send(join_msg("base", "node5", resume_round=0))
    await expect_error(stranger, "evicted")
    await stranger.send(join_msg("unknown-job", "node5", resume_round=3))
    await expect_error(stranger, "evicted")
    assert await snapshot(client) == before
    # the same node id and its secret on a new connection is that node reconnecting: same assignment, same round
    again = await connect()
    await again.send(join_msg("base", "node2", node_secret=world[1].node_secret))
    while (msg := await again.recv()).op != "assigned":
        pass
    assert msg.assignment.round == 0 and msg.assignment.group_rank in (0, 1)
    after = await client.get("/v1/jobs/base")
    assert (await after.json())["round"] == 0


# ------------------------------------------------------------------- REST


async def expect_json_error(resp, status: int, code: str) -> dict:
    assert resp.status == status, (resp.status, await resp.text())
    assert resp.content_type == "application/json"
    body = await resp.json()
    assert set(body) == {"code", "message"} and body["code"] == code and body["message"], body
    return body


@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_unknown_job_is_404(client, world, method):
    """An unknown but valid job id gets 404 job_not_found and changes nothing."""
    before = await snapshot(client)
    path = "/v1/jobs/no-such-job" + ("/close" if method == "POST" else "")
    body = await expect_json_error(await client.request(method, path), 404, "job_not_found")
    assert "no-such-job" in body["message"]
    assert await snapshot(client) == before


BAD_IDS = {
    "space": "my%20job",
    "slash": "a%2Fb",
    "unicode": "n%C3%B8de",
    "dotdot": "..",
    "dot first": ".x",
    "colon first": ":x",
    "too long": "j" * 129,
    "4 kB": "j" * 4000,
    "nul": "a%00b",
    "quote": "a%22b",
}


@pytest.mark.parametrize("job_id", BAD_IDS.values(), ids=BAD_IDS.keys())
@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_invalid_job_ids_are_422_or_404(client, world, job_id, method):
    """A job id outside the id syntax gets a JSON 4xx (validation_error, or not_found when it cannot match a route)."""
    before = await snapshot(client)
    path = f"/v1/jobs/{job_id}" + ("/close" if method == "POST" else "")
    resp = await client.request(method, path)
    if resp.status == 404:
        await expect_json_error(resp, 404, "not_found")
    else:
        await expect_json_error(resp, 422, "validation_error")
    assert await snapshot(client) == before


async def test_ten_kilobyte_path_gets_a_clean_4xx(client, world):
    """A 10 kB job id in the URL is refused with a 4xx and never reaches a 500."""
    before = await snapshot(client)
    resp = await client.get("/v1/jobs/" + "j" * 10_000)
    assert 400 <= resp.status < 500
    assert await snapshot(client) == before


async def test_close_bodies(client, world):
    """close refuses a non-empty body with 422 and a body over the limit with 413, leaving the job running."""
    before = await snapshot(client)
    resp = await client.post(
        "/v1/jobs/base/close", data=b'{"force": true}', headers={"Content-Type": "application/json"}
    )
    await expect_json_error(resp, 422, "validation_error")
    resp = await client.post("/v1/jobs/base/close", data=b"x" * (MAX_BODY_BYTES + 1))
    body = await expect_json_error(resp, 413, "body_too_large")
    assert str(MAX_BODY_BYTES) in body["message"]
    resp = await client.post("/v1/jobs/base/close", data=b"{" * (10 * MAX_BODY_BYTES))
    await expect_json_error(resp, 413, "body_too_large")
    assert await snapshot(client) == before


WRONG_METHODS = [
    ("DELETE", "/v1/jobs"),
    ("POST", "/v1/jobs"),
    ("PUT", "/v1/jobs/base"),
    ("DELETE", "/v1/jobs/base/close"),
    ("PATCH", "/v1/jobs/base"),
    ("GET", "/v1/jobs/base/close"),
    ("PUT", "/v1/jobs/base/close"),
    ("POST", "/healthz"),
    ("POST", "/metrics"),
    ("POST", "/v1/agent"),
    ("DELETE", "/openapi.json"),
]


@pytest.mark.parametrize(("method", "path"), WRONG_METHODS)
async def test_wrong_methods_are_405(client, world, method, path):
    """A known path with the wrong method gets 405 method_not_allowed with an Allow header."""
    before = await snapshot(client)
    resp = await client.request(method, path, data=b"{}")
    body = await expect_json_error(resp, 405, "method_not_allowed")
    assert method in body["message"] and resp.headers.get("Allow")
    assert await snapshot(client) == before


@pytest.mark.parametrize(
    "path",
    [
        "/ui/nope",  # ("/" redirects to the dashboard, /ui)
        "/v2/jobs",
        "/v1",
        "/v1/job",
        "/v1/jobs/base/nodes",
        "/v1/jobs/base/close/x",
        "/healthz/x",
        "/%ff",
        "/" + "x" * 3000,
        "/v1/jobs/base/../../etc/passwd",
    ],
)
async def test_unknown_paths_are_404_json(client, world, path):
    """An unknown path gets 404 not_found as JSON, never an HTML page."""
    before = await snapshot(client)
    await expect_json_error(await client.get(path), 404, "not_found")
    assert await snapshot(client) == before


async def test_plain_http_on_the_agent_path(client, world):
    """A GET on /v1/agent without a WebSocket upgrade gets a JSON 4xx, not a 500."""
    resp = await client.get("/v1/agent")
    assert 400 <= resp.status < 500
    body = await resp.json()
    assert set(body) == {"code", "message"}


async def test_job_spec_model_rejects_min_above_max():
    """The spec model itself refuses min > max with both numbers in the message."""
    with pytest.raises(ValueError, match=r"min_nodes \(3\).*max_nodes \(2\)"):
        JobSpec(min_nodes=3, max_nodes=2)


async def send_raw(port: int, data: bytes) -> bytes:
    """One raw HTTP/1.1 exchange, for bytes an HTTP client would not send."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 3)
    finally:
        writer.close()
        await writer.wait_closed()


@pytest.mark.parametrize("value", [b"Bearer \xff\xfe", b"\xff", b"Bearer s3cr\xc3\xa9t", b"Bearer " + b"x" * 4000])
async def test_undecodable_authorization_is_401(make_client, value):
    """An Authorization header that is not UTF-8 (or absurdly long) is a 401, not a 500."""
    client = await make_client(Settings(token="s3cret"))
    reply = await send_raw(
        client.server.port,
        b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: " + value + b"\r\nConnection: close\r\n\r\n",
    )
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 401 "), reply[:300]
    assert json.loads(body)["code"] == "unauthorized"


async def test_refused_resume_does_not_revive_a_dropped_node(client, connect, world):
    """A resume naming the wrong round is refused and leaves a dropped node dropped (it is still lost after grace)."""
    a1, a2 = world
    a2.ws._response.connection.transport.abort()  # node2's agent died
    await wait_view(client, "base", lambda v: v["nodes"][1]["state"] == "disconnected")
    before = await snapshot(client)
    impostor = await connect()  # (with node2's secret: a node that resumes the wrong round)
    await impostor.send(join_msg("base", "node2", resume_round=7, node_secret=a2.node_secret))
    await expect_error(impostor, "stale_round")
    assert await snapshot(client) == before
    restart = await a1.expect("restart", timeout=1.5)  # node2 is still lost after the 0.5 s grace
    assert "node2" in restart.reason


async def wait_view(client, job_id: str, pred, timeout: float = 3.0) -> dict:
    async def poll():
        while not pred(view := await (await client.get(f"/v1/jobs/{job_id}")).json()):
            await asyncio.sleep(0.01)
        return view

    return await asyncio.wait_for(poll(), timeout)
