"""The event stream (/v1/events, /v1/jobs/{id}/events) against the real app:
events of real (simulated-agent) rounds, Last-Event-ID replay, the gap
marker, the JSON variant, slow clients dropped, caps, auth and the /ui cookie."""

from __future__ import annotations

import asyncio
import json
import socket
import sqlite3

from rdzv_common.protocol import ExitRecord, FailedMsg, JobSpec, SucceededMsg
from rdzv_server.app import Settings
from rdzv_server.keys import EVENTS, STORE
from tests.api.conftest import TIMEOUT, form, join_msg

DEADLINE = 10.0


class Stream:
    """One SSE response, read frame by frame."""

    def __init__(self, resp) -> None:
        self.resp = resp
        self.comments: list[str] = []

    async def next(self, timeout: float = DEADLINE) -> dict:
        """The next event: {"id", "event", "data" (parsed)}; comments are kept aside."""
        fields: dict = {}
        while True:
            line = await asyncio.wait_for(self.resp.content.readline(), timeout)
            assert line, "the stream ended"
            text = line.decode().rstrip("\n")
            if text == "":
                if "data" in fields:
                    fields["data"] = json.loads(fields["data"])
                    return fields
                fields = {}
                continue
            if text.startswith(":"):
                self.comments.append(text)
                continue
            name, _, value = text.partition(": ")
            fields[name] = value

    async def until(self, type_: str, timeout: float = DEADLINE) -> list[dict]:
        """Events up to and including the first of ``type_``."""
        out = []
        while True:
            ev = await self.next(timeout)
            out.append(ev)
            if ev["event"] == type_:
                return out

    def close(self) -> None:
        self.resp.close()


async def open_stream(client, path: str = "/v1/events", headers: dict | None = None) -> Stream:
    resp = await client.get(path, headers=headers or {})
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    return Stream(resp)


def types(events: list[dict]) -> list[str]:
    return [e["event"] for e in events]


async def test_a_forming_round_streams_joins_completion_and_state(client, connect):
    stream = await open_stream(client, "/v1/jobs/ev1/events")
    (a1, a2), _ = await form(connect, "ev1", ["node1", "node2"])
    got = await stream.until("round_completed")
    got += [await stream.next()]
    assert types(got) == ["job_state", "node_joined", "node_joined", "round_completed", "job_state"]
    created, j1, j2, completed, running = (e["data"] for e in got)
    assert created["state"] == "waiting" and created["reason"] == "job created" and created["job"] == "ev1"
    assert {j1["node"], j2["node"]} == {"node1", "node2"}
    assert j1["host"] == j1["node"] and j1["nproc"] == 1 and j1["state"] == "waiting"
    assert j2["state"] == "waiting"  # as it joined, though its join completed the round (the next event)
    assert completed["round"] == 0 and completed["world_size"] == 2 and completed["nodes"] == 2
    assert completed["formation_s"] >= 0
    assert running["state"] == "running" and running["previous"] == "waiting"
    ids = [int(e["id"]) for e in got]
    assert ids == list(range(ids[0], ids[0] + 5)) and [e["data"]["id"] for e in got] == ids
    for e in got:
        assert set(e["data"]) >= {"id", "time", "type", "job", "run", "round", "node"}
        assert e["data"]["type"] == e["event"]
    stream.close()


async def test_a_failure_streams_the_exit_record_the_restart_and_the_new_round(client, connect):
    (a1, a2), _ = await form(connect, "ev2", ["node1", "node2"])
    stream = await open_stream(client, "/v1/jobs/ev2/events")
    rec = ExitRecord(local_rank=0, rank=1, pid=42, exit_code=3, message="boom\x1b[2J\nsecond line")
    await a2.send(FailedMsg(round=0, failures=[rec]))
    got = await stream.until("job_state")
    assert types(got) == ["node_failed", "restart_charged", "round_opened", "job_state"]
    failed, charged, opened, state = (e["data"] for e in got)
    assert failed["node"] == "node2" and failed["round"] == 0
    assert "exit code 3" in failed["cause"] and "\x1b" not in failed["cause"]
    assert failed["failures"][0]["exit_code"] == 3 and failed["failures"][0]["pid"] == 42
    assert charged["restarts"] == 1 and charged["max_restarts"] == 3
    assert opened["round"] == 1 and "worker failure" in opened["reason"]
    assert state["state"] == "waiting" and state["previous"] == "running"
    stream.close()


async def test_an_in_place_collective_echo_is_no_node_failed_event(client, connect):
    """In-place mode: a survivor whose collective broke reports an echo (reason
    "collective") that changes nothing; only the peer whose worker really
    failed shows as failed in the event stream."""
    spec = JobSpec(min_nodes=2, max_nodes=2, restart_mode="in-place")
    agents = [await connect() for _ in range(2)]
    for agent, node in zip(agents, ("node1", "node2")):
        await agent.send(join_msg("ev9", node, spec=spec))
    for agent in agents:
        await agent.expect("joined")
        await agent.expect("assigned")
    stream = await open_stream(client, "/v1/jobs/ev9/events")
    echo = ExitRecord(local_rank=0, rank=0, pid=41, reason="collective", message="a collective failed")
    await agents[0].send(FailedMsg(round=0, failures=[echo]))
    rec = ExitRecord(local_rank=0, rank=1, pid=42, exit_code=3, message="boom")
    await agents[1].send(FailedMsg(round=0, failures=[rec]))
    got = await stream.until("node_failed")
    assert [(e["event"], e["data"]["node"]) for e in got] == [("node_failed", "node2")], got
    stream.close()


async def test_lost_nodes_and_success_are_events(make_client, connect):
    client = await make_client(Settings(disconnect_grace_s=0.2))
    (a1, a2), _ = await form(lambda: connect(on=client), "ev3", ["node1", "node2"], nnodes=(1, 2))
    stream = await open_stream(client, "/v1/jobs/ev3/events")
    await a2.close()  # its connection drops: lost after the grace
    got = await stream.until("round_opened")
    assert types(got) == ["node_lost", "round_opened"]
    assert got[0]["data"]["node"] == "node2" and "connection lost" in got[0]["data"]["reason"]
    await a1.expect("restart")
    await a1.send(join_msg("ev3", "node1", (1, 2)))
    await a1.expect("joined")
    await a1.expect("assigned", timeout=DEADLINE)
    await a1.send(SucceededMsg(round=1))
    got = []
    while not got or got[-1]["data"].get("state") != "succeeded":
        got += await stream.until("job_state")
    assert types(got) == ["job_state", "round_completed", "job_state", "node_succeeded", "job_state"]
    assert [e["data"]["state"] for e in got if e["event"] == "job_state"] == ["waiting", "running", "succeeded"]
    stream.close()


async def test_last_event_id_replays_what_was_missed(client, connect):
    stream = await open_stream(client)
    await form(connect, "ev4", ["node1", "node2"])
    first = await stream.until("round_completed")
    stream.close()
    seen = int(first[1]["id"])  # the first node_joined: everything after it was "missed"
    again = await open_stream(client, headers={"Last-Event-ID": str(seen)})
    replayed = [await again.next() for _ in range(len(first) - 2)]
    assert [int(e["id"]) for e in replayed] == [int(e["id"]) for e in first[2:]]
    assert types(replayed) == types(first[2:])
    # then live ones
    await client.post("/v1/hosts/h9/cordon", json={"reason": "bad disk"})
    live = await again.until("host_cordoned")
    assert live[-1]["data"]["host"] == "h9" and live[-1]["data"]["reason"] == "bad disk"
    again.close()


async def test_an_id_older_than_the_ring_gets_a_gap_marker(make_client, connect):
    client = await make_client(Settings(event_ring=3))
    stream = await open_stream(client)
    await form(lambda: connect(on=client), "ev5", ["node1", "node2"])
    got = await stream.until("round_completed")
    got += [await stream.next()]  # 5 events; the ring holds the last 3
    stream.close()
    again = await open_stream(client, headers={"Last-Event-ID": got[0]["id"]})
    gap = await again.next()
    assert gap["event"] == "gap" and "no longer held" in gap["data"]["message"]
    assert int(gap["id"]) == int(got[2]["id"]) - 1 and gap["data"]["after"] == int(got[0]["id"])
    rest = [await again.next() for _ in range(3)]
    assert [e["id"] for e in rest] == [e["id"] for e in got[2:]]
    again.close()
    # the JSON variant says the same
    resp = await client.get("/v1/events", params={"since": got[0]["id"]})
    body = await resp.json()
    assert body["gap"] is True and [e["id"] for e in body["events"]] == [int(e["id"]) for e in got[2:]]
    assert body["last_id"] == int(got[-1]["id"])


async def test_since_returns_json_filtered_by_job(client, connect):
    await form(connect, "ev6a", ["node1"])
    await form(connect, "ev6b", ["node2"])
    resp = await client.get("/v1/jobs/ev6b/events", params={"since": "0"})
    assert resp.status == 200 and resp.content_type == "application/json"
    body = await resp.json()
    assert body["gap"] is False
    assert {e["job"] for e in body["events"]} == {"ev6b"}
    assert [e["type"] for e in body["events"]] == ["job_state", "node_joined", "round_completed", "job_state"]
    resp = await client.get("/v1/jobs/ev6b/events", params={"since": str(body["last_id"])})
    assert (await resp.json())["events"] == []


async def test_a_slow_client_is_dropped_and_the_others_keep_up(make_client):
    """A client that never reads: its queue fills (queue 8) once the socket
    buffers are full and it is dropped; a reading client gets every event."""
    client = await make_client(Settings(event_queue=8))
    events = client.app[EVENTS]
    fast = await open_stream(client)
    slow = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
    slow.settimeout(DEADLINE)
    slow.connect((client.host, client.port))
    slow.sendall(b"GET /v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")  # a loopback name (auth.py)
    for _ in range(int(DEADLINE / 0.01)):
        if len(events.subscribers) == 2:
            break
        await asyncio.sleep(0.01)
    assert len(events.subscribers) == 2
    blob = "x" * 32768
    sent = 0
    while not events.dropped_total and sent < 2000:  # at most 64 MB
        for i in range(sent, sent + 4):
            events.emit("host_cordoned", None, host=f"h{i}", reason=blob)
        for i in range(sent, sent + 4):
            assert (await fast.next())["data"]["host"] == f"h{i}"
        sent += 4
    assert events.dropped_total == 1 and len(events.subscribers) == 1
    # the slow client's connection was aborted: after what was buffered, it ends
    slow.settimeout(DEADLINE)
    try:
        while slow.recv(1 << 20):
            pass
    except ConnectionResetError:
        pass
    slow.close()
    events.emit("host_uncordoned", None, host="after")
    assert (await fast.next())["event"] == "host_uncordoned"
    assert (await client.get("/healthz")).status == 200
    fast.close()


async def test_streams_are_capped(make_client):
    client = await make_client(Settings(max_event_streams=1))
    first = await open_stream(client)
    resp = await client.get("/v1/events")
    assert resp.status == 503
    assert (await resp.json())["code"] == "unavailable"
    first.close()


async def test_keepalive_comments_on_a_quiet_stream(make_client):
    client = await make_client(Settings(event_keepalive_s=0.05))
    stream = await open_stream(client)
    client.app[EVENTS].emit("host_cordoned", None, host="h1", reason="r")
    await stream.next()
    await asyncio.sleep(0.3)
    client.app[EVENTS].emit("host_uncordoned", None, host="h1")
    await stream.next()
    assert ": keep-alive" in stream.comments
    stream.close()


async def test_bad_event_requests_get_one_clear_error(client):
    for path, headers in [
        ("/v1/events", {"Last-Event-ID": "abc"}),
        ("/v1/events?since=-1", {}),
        ("/v1/events?since=1e9", {}),
        ("/v1/jobs/bad%20id/events", {}),
    ]:
        resp = await client.get(path, headers=headers)
        assert resp.status == 422, path
        body = await resp.json()
        assert body["code"] == "validation_error" and "\n" not in body["message"]
    assert not client.app[EVENTS].subscribers


async def test_a_failed_write_publishes_nothing(make_client, connect, tmp_path, monkeypatch):
    """Persist before publish: a join whose write fails is refused and no event says it happened."""
    client = await make_client(Settings(data_dir=tmp_path))
    store = client.app[STORE]
    before = store.events.next_id

    def broken(job, now):
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(store.db, "save", broken)
    agent = await connect(on=client)
    await agent.send(join_msg("ev7", "node1", (1, 1)))
    frame = await asyncio.wait_for(agent.ws.receive(), TIMEOUT)
    assert "unavailable" in frame.data
    assert store.events.next_id == before


async def test_events_need_the_token_or_the_ui_cookie(make_client, connect):
    client = await make_client(Settings(token="s3cret"))
    assert (await client.get("/v1/events")).status == 401
    resp = await client.get("/v1/events", params={"since": "0"}, headers={"Authorization": "Bearer s3cret"})
    assert resp.status == 200
    # the /ui login: a wrong token is refused, the right one sets an HttpOnly SameSite=Strict cookie
    resp = await client.post("/ui/login", json={"token": "nope"})
    assert resp.status == 401 and (await resp.json())["code"] == "unauthorized"
    assert "rdzv_session" not in client.session.cookie_jar.filter_cookies(client.make_url("/"))
    resp = await client.post("/ui/login", json={"token": "s3cret"})
    assert resp.status == 200
    cookie = resp.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "s3cret" not in cookie
    resp = await client.get("/v1/events", params={"since": "0"})
    assert resp.status == 200
    stream = await open_stream(client, "/v1/events")
    stream.close()


async def test_close_with_the_cookie_needs_the_ui_header_and_the_same_origin(make_client, connect):
    client = await make_client(Settings(token="s3cret"))
    bearer = {"Authorization": "Bearer s3cret"}
    await form(lambda: connect(on=client, headers=bearer), "ev8", ["node1"])
    assert (await client.post("/ui/login", json={"token": "s3cret"})).status == 200
    origin = f"http://{client.host}:{client.port}"
    resp = await client.post("/v1/jobs/ev8/close")  # a cookie alone: a form on another site could do this
    assert resp.status == 403 and (await resp.json())["code"] == "forbidden"
    resp = await client.post("/v1/jobs/ev8/close", headers={"X-Rdzv-UI": "1", "Origin": "http://evil.example"})
    assert resp.status == 403 and "cross-site" in (await resp.json())["message"]
    # even with the bearer token, another site's page may not change anything
    resp = await client.post("/v1/jobs/ev8/close", headers={**bearer, "Origin": "http://evil.example"})
    assert resp.status == 403
    assert (await (await client.get("/v1/jobs/ev8")).json())["state"] == "running"
    resp = await client.post("/v1/jobs/ev8/close", headers={"X-Rdzv-UI": "1", "Origin": origin})
    assert resp.status == 200 and (await resp.json())["state"] == "closed"


async def test_ui_pages_and_files(client):
    resp = await client.get("/", allow_redirects=False)
    assert resp.status == 302 and resp.headers["Location"] == "/ui"
    for path in ("/ui", "/ui/jobs/some-job"):
        resp = await client.get(path)
        assert resp.status == 200 and resp.content_type == "text/html"
        assert "script-src 'self'" in resp.headers["Content-Security-Policy"]
        assert "/ui/static/app.js" in await resp.text()
    resp = await client.get("/ui/static/app.js")
    assert resp.status == 200 and resp.content_type == "text/javascript"
    assert "innerHTML" not in await resp.text()
    assert (await client.get("/ui/static/nope.js")).status == 404
    assert (await client.get("/ui/static/..%2Fapp.py")).status == 404


async def test_ui_files_need_no_token_but_data_does(make_client):
    client = await make_client(Settings(token="s3cret"))
    assert (await client.get("/ui")).status == 200
    assert (await client.get("/ui/static/style.css")).status == 200
    assert (await client.get("/v1/jobs")).status == 401


async def test_after_a_restart_ids_keep_increasing_and_an_old_id_gets_a_gap(make_client, connect, tmp_path):
    """A server started again over the same data dir: its ids are higher than
    the old server's, a Last-Event-ID of the old one gets the gap marker, and
    the restored job's next step is not announced as a new job."""
    first = await make_client(Settings(data_dir=tmp_path))
    (a1, a2), _ = await form(lambda: connect(on=first), "ev9", ["node1", "node2"])
    old_last = first.app[EVENTS].next_id - 1
    await a1.close()
    await a2.close()
    await first.close()
    second = await make_client(Settings(data_dir=tmp_path, disconnect_grace_s=0.1))
    assert second.app[EVENTS].next_id > old_last
    stream = await open_stream(second, "/v1/jobs/ev9/events", headers={"Last-Event-ID": str(old_last)})
    gap = await stream.next()
    assert gap["event"] == "gap" and gap["data"]["after"] == old_last
    again = await connect(on=second)
    await again.send(join_msg("ev9", "node3", (2, 2)))  # a newcomer to the restored job
    got = await stream.until("node_joined")
    assert types(got) == ["node_joined"] and int(got[0]["id"]) > old_last
    stream.close()
