"""Identity and trust on the real app: node takeover, job secrets and spec
collisions, repeated reports, network text in the server log, and the audit
lines for refusals."""

from __future__ import annotations

import asyncio
import logging
import sqlite3

import aiohttp

from rdzv_common.protocol import AGENT_PATH, ExitRecord, FailedMsg, JobSpec, LeaveMsg, SucceededMsg
from rdzv_server.app import Settings
from rdzv_server.keys import AUTH, STORE
from rdzv_server.throttle import DEFAULT_LIMIT

from .conftest import form, join_msg
from .test_hostile import expect_error, snapshot, wait_view

IMPOSTOR = dict(addr="10.66.66.66", host="evil", master_port=4444)
TOKEN = "s3cret-token-of-16+"


def server_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("rdzv_server")]


# ---------------------------------------------------------------- takeover


async def test_impostor_with_a_live_nodes_id_is_refused_and_changes_nothing(client, connect, caplog):
    """A join, a resume and a report from a stranger naming node2 (a live member,
    its id public in GET /v1/jobs) without node2's secret: each refused, nothing
    in the job view changes, no "reconnected" line, and node2's own connection
    still speaks for node2 (it hears the restart and rejoins with its secret)."""
    caplog.set_level(logging.INFO)
    (a1, a2), assigned = await form(connect, "base", ["node1", "node2"])
    assert a1.node_secret and a2.node_secret and a1.node_secret != a2.node_secret
    before = await snapshot(client)
    impostor = await connect()
    for msg in (
        join_msg("base", "node2", **IMPOSTOR),
        join_msg("base", "node2", resume_round=0, **IMPOSTOR),
        join_msg("base", "node2", node_secret=a1.node_secret, **IMPOSTOR),
    ):
        await impostor.send(msg)
        text = await expect_error(impostor, "node_secret_mismatch")
        assert "node2" in text and a2.node_secret not in text
    # not bound by any of that: its reports are not node2's
    await impostor.send(FailedMsg(round=0, failures=[ExitRecord(local_rank=0, rank=1, pid=1, exit_code=1)]))
    await expect_error(impostor, "not_joined")
    await impostor.send(LeaveMsg(reason="taking over"))
    await expect_error(impostor, "not_joined")
    assert await snapshot(client) == before
    assert not any("reconnected" in line for line in server_lines(caplog))
    # the victim's connection is still node2's: a failure on node1 reaches it, and it rejoins
    await a1.send(FailedMsg(round=0, failures=[ExitRecord(local_rank=0, rank=0, pid=1, exit_code=1)]))
    for agent in (a1, a2):
        assert (await agent.expect("restart")).round == 1
    await a1.expect("ack")
    await impostor.send(join_msg("base", "node2", **IMPOSTOR))  # between rounds too
    await expect_error(impostor, "node_secret_mismatch")
    await a2.send(join_msg("base", "node2", node_secret=a2.node_secret))
    await a1.send(join_msg("base", "node1", node_secret=a1.node_secret))
    for agent in (a1, a2):
        await agent.expect("joined")
    got = {(await agent.expect("assigned")).assignment.group_rank: agent for agent in (a1, a2)}
    view = await wait_view(client, "base", lambda v: v["state"] == "running" and v["round"] == 1)
    # MASTER_ADDR/PORT come from the node holding group rank 0, never from the impostor
    assert got[0] is a1
    assert (view["master_addr"], view["master_port"]) == (assigned["node1"].master_addr, 29500)
    assert view["restarts"] == 1  # node1's one failure; the impostor's report charged nothing
    assert {n["addr"] for n in view["nodes"]} == {assigned["node1"].master_addr, join_msg("base", "node2").addr}


async def test_node_secrets_never_show_in_rest_or_the_log(client, connect, caplog):
    """The job list, the job view, /metrics and the server log never carry a node secret."""
    caplog.set_level(logging.DEBUG)
    (a1, a2), _ = await form(connect, "quiet", ["node1", "node2"])
    texts = [await (await client.get(path)).text() for path in ("/v1/jobs", "/v1/jobs/quiet", "/metrics")]
    texts += server_lines(caplog)
    for secret in (a1.node_secret, a2.node_secret):
        assert secret and not any(secret in t for t in texts)


async def test_node_secrets_survive_a_server_restart(make_client, connect, tmp_path):
    """After a restart over the same data dir, a resume without the node's
    secret is refused and one with it gets the same assignment back; the
    database holds no secret in the clear."""
    first = await make_client(Settings(data_dir=tmp_path))
    agents = [await connect(on=first) for _ in range(2)]
    for agent, node in zip(agents, ("node1", "node2")):
        await agent.send(join_msg("durable", node))
    assigned = {}
    for agent, node in zip(agents, ("node1", "node2")):
        await agent.expect("joined")
        assigned[node] = (await agent.expect("assigned")).assignment
    secrets = {node: agent.node_secret for agent, node in zip(agents, ("node1", "node2"))}
    await first.close()
    raw = (tmp_path / "rdzv.db").read_bytes() + b"".join(p.read_bytes() for p in tmp_path.glob("rdzv.db-*"))
    assert all(s.encode() not in raw for s in secrets.values())

    second = await make_client(Settings(data_dir=tmp_path))
    impostor = await connect(on=second)
    await impostor.send(join_msg("durable", "node1", resume_round=0))
    await expect_error(impostor, "node_secret_mismatch")
    for node in ("node1", "node2"):
        agent = await connect(on=second)
        await agent.send(join_msg("durable", node, resume_round=0, node_secret=secrets[node]))
        assert (await agent.expect("assigned")).assignment == assigned[node]


# ------------------------------------------------------ squatting, collisions


async def test_every_spec_field_of_a_join_must_match_the_job(client, connect):
    """A second user's join to the same job id with other max_restarts or
    heartbeat timeout (same nnodes) is refused naming the field and both values."""
    first = await connect()
    await first.send(join_msg("exp1", "node1", spec=JobSpec(min_nodes=2, max_nodes=2, max_restarts=3)))
    await first.expect("joined")
    before = await snapshot(client)
    other = await connect()
    await other.send(join_msg("exp1", "node9", spec=JobSpec(min_nodes=2, max_nodes=2, max_restarts=0)))
    text = await expect_error(other, "spec_mismatch")
    assert "max_restarts 3" in text and "asked for 0" in text, text
    await other.send(join_msg("exp1", "node9", spec=JobSpec(min_nodes=2, max_nodes=2, heartbeat_timeout_s=60)))
    text = await expect_error(other, "spec_mismatch")
    assert "heartbeat_timeout_s 6" in text and "asked for 60" in text, text
    assert await snapshot(client) == before


async def test_job_secret_guards_a_job(client, connect, caplog, tmp_path):
    """The first join sets the job secret; joins without it, with another, or
    (for a job without one) with one are refused saying which, change nothing,
    and the secret shows nowhere; the right secret joins."""
    caplog.set_level(logging.DEBUG)
    first = await connect()
    await first.send(join_msg("guarded", "node1", job_secret="team-s3cret-0123456789"))
    await first.expect("joined")
    plain = await connect()
    await plain.send(join_msg("open", "node1"))
    await plain.expect("joined")
    before = await snapshot(client)
    squatter = await connect()
    await squatter.send(join_msg("guarded", "node2"))
    assert "requires a job secret" in await expect_error(squatter, "job_secret_mismatch")
    await squatter.send(join_msg("guarded", "node2", job_secret="guess-0123456789abcdef"))
    assert "wrong job secret" in await expect_error(squatter, "job_secret_mismatch")
    await squatter.send(join_msg("open", "node2", job_secret="team-s3cret-0123456789"))
    assert "created without a job secret" in await expect_error(squatter, "job_secret_mismatch")
    # a known node: the job secret first
    await squatter.send(join_msg("guarded", "node1", job_secret="guess-0123456789abcdef"))
    await expect_error(squatter, "job_secret_mismatch")
    assert await snapshot(client) == before
    second = await connect()
    await second.send(join_msg("guarded", "node2", job_secret="team-s3cret-0123456789"))
    await second.expect("joined")
    assert (await second.expect("assigned")).assignment.world_size == 2
    texts = [await (await client.get(p)).text() for p in ("/v1/jobs", "/v1/jobs/guarded", "/metrics")]
    assert not any("team-s3cret-0123456789" in t for t in texts + server_lines(caplog))


async def test_job_secret_is_kept_on_disk_as_a_hash(make_client, connect, tmp_path):
    """A job secret outlives a restart (still required) and is not in the database in the clear."""
    first = await make_client(Settings(data_dir=tmp_path))
    agent = await connect(on=first)
    await agent.send(join_msg("kept", "node1", job_secret="team-s3cret-0123456789"))
    await agent.expect("joined")
    await first.close()
    raw = (tmp_path / "rdzv.db").read_bytes() + b"".join(p.read_bytes() for p in tmp_path.glob("rdzv.db-*"))
    assert b"team-s3cret-0123456789" not in raw
    second = await make_client(Settings(data_dir=tmp_path))
    squatter = await connect(on=second)
    await squatter.send(join_msg("kept", "node2"))
    await expect_error(squatter, "job_secret_mismatch")
    member = await connect(on=second)
    await member.send(join_msg("kept", "node2", job_secret="team-s3cret-0123456789"))
    await member.expect("joined")


# ---------------------------------------------------------- repeated reports


async def test_repeated_success_writes_nothing_and_a_later_failure_is_stale(
    make_client, connect, tmp_path, monkeypatch, caplog
):
    """node1 succeeded (one write); 20 more `succeeded` from it are each acked
    with no database write and no log line; its `failed` after that is stale
    and charges nothing."""
    caplog.set_level(logging.INFO)
    client = await make_client(Settings(data_dir=tmp_path))
    (a1, a2), _ = await form(lambda: connect(on=client), "rep", ["node1", "node2"])
    db = client.app[STORE].db
    saves = []
    real_save = db.save
    monkeypatch.setattr(db, "save", lambda job, now: (saves.append(job.job_id), real_save(job, now)))
    await a1.send(SucceededMsg(round=0))
    assert (await a1.expect("ack")).of == "succeeded"
    assert saves == ["rep"]
    updated_at = sqlite3.connect(tmp_path / "rdzv.db").execute("SELECT updated_at FROM jobs").fetchone()
    before = await snapshot(client)
    logged = len(server_lines(caplog))
    for _ in range(20):
        await a1.send(SucceededMsg(round=0))
        assert (await a1.expect("ack")).of == "succeeded"
    assert saves == ["rep"]
    assert len(server_lines(caplog)) == logged
    assert sqlite3.connect(tmp_path / "rdzv.db").execute("SELECT updated_at FROM jobs").fetchone() == updated_at
    await a1.send(FailedMsg(round=0, failures=[ExitRecord(local_rank=0, rank=0, pid=1, exit_code=1)]))
    assert "already succeeded" in await expect_error(a1, "stale_round")
    assert await snapshot(client) == before
    assert saves == ["rep"]
    await a2.send(SucceededMsg(round=0))
    assert (await a2.expect("done")).state == "succeeded"


# ------------------------------------------------------ network text in logs

FORGED = "bye\n2026-01-01 00:00:00 INFO rdzv_server.store: job base round 7 complete: forged\x1b[2J\x1b]0;x\x07"


def assert_one_line_each(lines: list[str]) -> None:
    for line in lines:
        assert not any(c in line for c in "\n\r\x1b\x07"), repr(line)


async def test_leave_reason_and_failure_text_are_one_escaped_log_line(client, connect, caplog):
    """A leave reason and a failure's signal and message with a newline and
    escape sequences each reach the server log as one line, escaped."""
    caplog.set_level(logging.INFO)
    (a1, a2, a3), _ = await form(connect, "inj", ["node1", "node2", "node3"], nnodes=(2, 3))
    await a3.send(LeaveMsg(reason=FORGED[:250]))
    await a3.expect("ack")
    for agent in (a1, a2):
        await agent.expect("restart")
    for agent, node in ((a1, "node1"), (a2, "node2")):
        await agent.send(join_msg("inj", node, (2, 3), node_secret=agent.node_secret))
    for agent in (a1, a2):
        await agent.expect("joined")
        await agent.expect("assigned")
    bad = ExitRecord(local_rank=0, rank=0, pid=1, exit_code=None, signal="SIG\x1b[2J\nX", message="\x1b[2J" + FORGED)
    await a1.send(FailedMsg(round=1, failures=[bad]))
    await a1.expect("restart")
    await a1.expect("ack")
    lines = server_lines(caplog)
    assert_one_line_each(lines)
    left = [line for line in lines if "left (bye" in line]
    failed = [line for line in lines if "worker failure" in line]
    assert left and "bye\\n2026" in left[0] and "\\x1b[2J" in left[0], left
    assert failed and "SIG\\x1b[2J\\nX" in failed[0] and "\\x1b[2J" in failed[0], failed
    view = await (await client.get("/v1/jobs/inj")).json()
    assert_one_line_each([r["reason"] for r in view["history"]])


# ------------------------------------------------------------------ audit


def audit_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "rdzv_server.audit"]


async def test_a_refused_join_is_audited_with_node_job_address_and_why(client, connect, caplog):
    """A refused join logs one audit line naming the job, the node, the remote address, the code and why."""
    caplog.set_level(logging.INFO)
    await form(connect, "aud", ["node1", "node2"])
    impostor = await connect()
    await impostor.send(join_msg("aud", "node2", **IMPOSTOR))
    await expect_error(impostor, "node_secret_mismatch")
    lines = [line for line in audit_lines(caplog) if "join refused" in line]
    assert len(lines) == 1, audit_lines(caplog)
    for part in ("job aud", "node node2", "127.0.0.1", "node_secret_mismatch"):
        assert part in lines[0], lines[0]


async def test_a_rejected_token_is_audited_and_rate_limited(make_client, caplog):
    """A wrong bearer token logs the remote address and the path; a flood of
    them logs a bounded number of lines."""
    caplog.set_level(logging.INFO)
    client = await make_client(Settings(token="s3cret"))
    resp = await client.get("/v1/jobs/x%0Ay", headers={"Authorization": "Bearer nope"})
    assert resp.status == 401
    lines = [line for line in audit_lines(caplog) if "token rejected" in line]
    assert len(lines) == 1 and "127.0.0.1" in lines[0] and "GET /v1/jobs/x\\ny" in lines[0], lines
    statuses = [(await client.get("/v1/jobs", headers={"Authorization": "Bearer nope"})).status for _ in range(200)]
    # wrong tokens are refused (401) until the address is throttled (429: no more guesses for a while)
    assert statuses == [401] * (DEFAULT_LIMIT - 1) + [429] * (200 - DEFAULT_LIMIT + 1), statuses
    lines = [line for line in audit_lines(caplog) if "token rejected" in line]
    assert 1 < len(lines) <= 20, len(lines)
    assert_one_line_each(audit_lines(caplog))


async def test_an_address_that_guesses_tokens_is_throttled_but_the_right_token_passes(make_client, connect, caplog):
    """limit wrong tokens (bearer or /ui login: one count) from one address and
    its wrong tokens are answered 429 with Retry-After for the window, while the
    right token still works from there (an agent behind the guesser's NAT joins);
    after the window wrong ones are 401 again. Nothing is counted for the right one."""
    caplog.set_level(logging.INFO)
    client = await make_client(Settings(token=TOKEN))
    throttle = client.app[AUTH].throttle
    throttle.limit, throttle.window_s = 4, 1.0
    good = {"Authorization": f"Bearer {TOKEN}"}
    wrong = {"Authorization": "Bearer guess-guess-guess-guess"}
    assert (await client.get("/v1/jobs", headers=good)).status == 200
    for _ in range(2):
        assert (await client.get("/v1/jobs", headers=wrong)).status == 401
    assert (await client.post("/ui/login", json={"token": "guess"})).status == 401
    assert (await client.get("/v1/jobs", headers=good)).status == 200  # 3 wrong: not yet
    assert (await client.get("/v1/jobs")).status == 401  # no token at all counts too: the 4th
    assert throttle.blocked("127.0.0.1") > 0
    for req in (
        client.get("/v1/jobs", headers=wrong),
        client.get("/v1/jobs"),
        client.post("/ui/login", json={"token": "guess"}),
        client.ws_connect(AGENT_PATH, headers=wrong),
    ):
        try:
            resp = await req
        except aiohttp.WSServerHandshakeError as e:
            assert e.status == 429
            continue
        assert resp.status == 429, await resp.text()
        body = await resp.json()
        assert body["code"] == "rate_limited" and 1 <= int(resp.headers["Retry-After"]) <= 1, (body, resp.headers)
    # the right token from the throttled address: REST, the /ui login and the agent channel all work
    assert (await client.get("/v1/jobs", headers=good)).status == 200
    assert (await client.post("/ui/login", json={"token": TOKEN})).status == 200
    agent = await connect(on=client, headers=good)
    await agent.send(join_msg("natted", "node1", (1, 1)))
    await agent.expect("joined")
    assert (await client.get("/healthz")).status == 200  # never guarded
    assert any("sent 4 wrong tokens" in line for line in audit_lines(caplog))
    await asyncio.sleep(1.1)  # the window passes
    assert (await client.get("/v1/jobs", headers=wrong)).status == 401


async def test_closing_a_job_on_request_is_audited_once(client, connect, caplog):
    """POST close logs who closed the job (the remote address); closing it again logs nothing more."""
    caplog.set_level(logging.INFO)
    await form(connect, "shut", ["node1", "node2"])
    assert (await client.post("/v1/jobs/shut/close")).status == 200
    assert (await client.post("/v1/jobs/shut/close")).status == 200
    lines = [line for line in audit_lines(caplog) if "closed on request" in line]
    assert len(lines) == 1 and "job shut" in lines[0] and "127.0.0.1" in lines[0], audit_lines(caplog)


# ------------------------------------------------------- the agent's link


async def test_the_agent_link_keeps_its_node_secret_across_reconnects(client):
    """The real AgentLink under the node's session: the secret from `joined` goes
    on its later joins, so after the server drops its connection it resumes as
    the same node."""
    from rdzv_client.client import AgentLink
    from rdzv_client.session import NodeSession

    link = AgentLink(f"127.0.0.1:{client.server.port}", heartbeat_s=1.0)
    session = NodeSession(job_id="linked", host="h", nproc=1, spec=JobSpec(min_nodes=1, max_nodes=1), addr="127.0.0.1")
    session.node_id = "node1"
    session.link = link
    await link.start()
    try:
        session.join()
        joined = await asyncio.wait_for(link.recv(), 3)
        assert joined.op == "joined" and joined.node_secret
        assigned = await asyncio.wait_for(link.recv(), 3)
        assert assigned.op == "assigned"
        session.resume(assigned.assignment)  # what the agent does once its workers run
        assert link.intent["node_secret"] == joined.node_secret
        client.app[STORE].channels[("linked", "node1")].drop()  # the server drops it; the link reconnects
        again = await asyncio.wait_for(link.recv(), 5)
        assert again.op == "assigned" and again.assignment == assigned.assignment, again
        view = await (await client.get("/v1/jobs/linked")).json()
        assert [(n["node_id"], n["state"]) for n in view["nodes"]] == [("node1", "running")]
        session.node_id = "node2"  # another node id: no secret
        assert session.join_msg()["node_secret"] is None
    finally:
        await link.close()
