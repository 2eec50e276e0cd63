"""/metrics of the real app: it parses, passes the lint of tests/helpers/promlint
(promtool check metrics when promtool is installed), and says what people
alert on: job state, nodes by state, round formation times, time without
progress, waiting time, hosts cordoned; the job label set stays bounded."""

from __future__ import annotations

import asyncio

from rdzv_common import __version__
from rdzv_common.protocol import ExitRecord, FailedMsg, HeartbeatMsg, JobState
from rdzv_server.app import EVENTS, Settings
from rdzv_server.metrics import Metrics
from rdzv_server.rounds import new_job
from tests.helpers.promlint import lint, series, value

from .conftest import form, join_msg
from .test_events import open_stream
from .test_hosts import post_json

JOB_STATES = [s.value for s in JobState]
NODE_STATES = ["waiting", "rejoining", "running", "succeeded", "spare"]


async def _metrics(client) -> str:
    resp = await client.get("/metrics")
    assert resp.status == 200
    return await resp.text()


async def _until(agent, op: str):
    while (msg := await agent.recv()).op != op:
        pass
    return msg


def _job_state(text: str, job_id: str) -> str:
    on = [lab["state"] for lab, v in series(text)["rdzv_job_state"] if lab["job_id"] == job_id and v == 1]
    assert len(on) == 1, on  # one state at a time
    return on[0]


async def test_an_empty_server_passes_the_lint_and_says_its_version(client) -> None:
    text = await _metrics(client)
    assert lint(text) == []
    assert value(text, "rdzv_server_info", version=__version__) == 1
    assert value(text, "rdzv_hosts_cordoned") == 0


async def test_a_job_through_its_life_in_metrics(client, connect) -> None:
    waiting = await connect()
    await waiting.send(join_msg("m", "n0", (2, 2)))
    await waiting.expect("joined")
    text = await _metrics(client)
    assert lint(text) == []
    assert _job_state(text, "m") == "waiting"
    assert value(text, "rdzv_job_nodes", job_id="m", state="waiting") == 1
    assert value(text, "rdzv_job_waiting_seconds", job_id="m") >= 0
    assert value(text, "rdzv_jobs", state="waiting") == 1

    other = await connect()
    await other.send(join_msg("m", "n1", (2, 2)))
    await other.expect("joined")
    a = (await waiting.expect("assigned")).assignment
    await other.expect("assigned")
    text = await _metrics(client)
    assert lint(text) == []
    assert _job_state(text, "m") == "running"
    assert {s: value(text, "rdzv_job_nodes", job_id="m", state=s) for s in NODE_STATES} == {
        "waiting": 0,
        "rejoining": 0,
        "running": 2,
        "succeeded": 0,
        "spare": 0,
    }
    assert value(text, "rdzv_job_waiting_seconds", job_id="m") == 0  # running: not waiting
    assert value(text, "rdzv_round_formation_seconds_count") == 1
    assert value(text, "rdzv_round_formation_seconds_bucket", le="+Inf") == 1
    assert value(text, "rdzv_rounds_completed_total", job_id="m") == 1

    # a worker failure: a restart is charged, a round opens and forms again
    await waiting.send(FailedMsg(round=a.round, failures=[ExitRecord(local_rank=0, rank=0, pid=1, exit_code=1)]))
    for agent, node in ((waiting, "n0"), (other, "n1")):
        await _until(agent, "restart")
        await agent.send(join_msg("m", node, (2, 2)))
    for agent in (waiting, other):
        await _until(agent, "assigned")
    text = await _metrics(client)
    assert value(text, "rdzv_restarts_total", job_id="m") == 1
    assert value(text, "rdzv_rounds_opened_total", job_id="m") == 1
    assert value(text, "rdzv_round_formation_seconds_count") == 2

    await post_json(client, "/v1/jobs/m/close")
    text = await _metrics(client)
    assert lint(text) == []
    assert _job_state(text, "m") == "closed"
    assert value(text, "rdzv_jobs", state="closed") == 1 and value(text, "rdzv_jobs", state="running") == 0


async def test_progress_metric_is_in_seconds_and_per_job(client, connect) -> None:
    agents, _ = await form(connect, "p", ["n0", "n1"])
    await agents[0].send(HeartbeatMsg(step=3, rate=1.0))
    for _ in range(200):
        text = await _metrics(client)
        if value(text, "rdzv_job_since_progress_seconds", job_id="p") is not None:
            break
        await asyncio.sleep(0.01)
    assert value(text, "rdzv_job_since_progress_seconds", job_id="p") >= 0
    assert "rdzv_job_max_seconds_since_progress" not in text
    assert lint(text) == []


async def test_cordoned_hosts_are_counted(client) -> None:
    await post_json(client, "/v1/hosts/gpu-1/cordon", {"reason": "bad DIMM"})
    await post_json(client, "/v1/hosts/gpu-2/cordon", {"reason": "bad fan"})
    text = await _metrics(client)
    assert value(text, "rdzv_hosts_cordoned") == 2
    await post_json(client, "/v1/hosts/gpu-1/uncordon")
    assert value(await _metrics(client), "rdzv_hosts_cordoned") == 1


async def test_cooling_down_hosts_are_counted(make_client) -> None:
    from rdzv_server.hosts import HostRules

    client = await make_client(Settings(host_rules=HostRules(failures=1)))
    await post_json(client, "/v1/hosts/gpu-3/health", {"reason": "ecc errors"})
    assert value(await _metrics(client), "rdzv_hosts_cooling_down") == 1


def test_finished_jobs_beyond_the_bound_leave_metrics() -> None:
    """Live jobs always have series; of finished ones only the last N do."""
    from rdzv_server.hosts import Hosts
    from rdzv_server.rounds import Effects
    from rdzv_server.rounds.events import round_opened
    from tests.unit.test_rounds import spec

    m = Metrics(max_finished_jobs=3)
    live = new_job("live", spec(), 0.0)
    jobs = [live]
    for i in range(6):
        job = new_job(f"done{i}", spec(), float(i))
        m.observe(job, Effects(events=[round_opened(job, job.history[-1], [])]))
        job.state = JobState.SUCCEEDED
        m.observe(job, Effects())
        jobs.append(job)
    m.refresh(jobs, Hosts(), 10.0)
    text = m.render().decode()
    jobs = {lab["job_id"] for lab, _ in series(text)["rdzv_job_state"]}
    assert jobs == {"live", "done3", "done4", "done5"}, jobs
    assert all(lab.get("job_id") != "done0" for samples in series(text).values() for lab, _ in samples)
    assert lint(text) == []


async def test_event_streams_stay_out_of_the_request_latency(make_client) -> None:
    """An SSE stream lasts as long as its client reads: its duration is not a
    request's latency (it would sit in +Inf). A ?since= answer is a request."""
    client = await make_client(Settings(event_keepalive_s=0.05))
    streams = [await open_stream(client, "/v1/events"), await open_stream(client, "/v1/jobs/sx/events")]
    client.app[EVENTS].emit("host_cordoned", None, host="h1", reason="r")
    await streams[0].next()
    for stream in streams:
        stream.close()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while client.app[EVENTS].subscribers:  # the server noticed: the handlers returned
        assert loop.time() < deadline, "the streams did not end"
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)
    resp = await client.get("/v1/events", params={"since": "0"})
    assert resp.status == 200
    text = await _metrics(client)
    counts = {lab["route"]: v for lab, v in series(text)["rdzv_request_seconds_count"]}
    assert counts.get("/v1/events") == 1, counts  # the ?since= answer only
    assert "/v1/jobs/{job_id}/events" not in counts, counts


async def test_write_requests_to_storage_are_counted(make_client, connect, tmp_path) -> None:
    """rdzv_storage_write_requests_total (bench/big_job.py reads it per round change):
    a job formed with SQLite writes its record; a memory-only server writes nothing."""
    durable = await make_client(Settings(data_dir=tmp_path))
    assert value(await _metrics(durable), "rdzv_storage_write_requests_total") == 0
    agent = await connect(on=durable)
    await agent.send(join_msg("w", "n0", (1, 1)))
    await agent.expect("joined")
    await agent.expect("assigned")
    written = value(await _metrics(durable), "rdzv_storage_write_requests_total")
    assert written >= 1  # created and formed (one step, one write)
    assert value(await _metrics(durable), "rdzv_storage_write_requests_total") == written  # a scrape writes nothing
    memory = await make_client()
    other = await connect(on=memory)
    await other.send(join_msg("w", "n0", (1, 1)))
    await other.expect("joined")
    await other.expect("assigned")
    assert value(await _metrics(memory), "rdzv_storage_write_requests_total") == 0


def test_a_live_jobs_gauges_are_set_at_the_scrape_not_per_effect() -> None:
    """Issue 24: every join of a 16,384-node formation is an effect; the job's gauges
    (nodes by state, live nodes, round) are set once per scrape (refresh), not per effect."""
    from rdzv_server.hosts import Hosts
    from rdzv_server.rounds import Effects
    from tests.unit.test_rounds import spec

    m = Metrics()
    job = new_job("big", spec(min_nodes=3, max_nodes=3), 0.0)
    m.observe(job, Effects())
    assert series(m.render().decode()).get("rdzv_live_nodes", []) == []  # set at every effect before
    m.refresh([job], Hosts(), 1.0)
    assert value(m.render().decode(), "rdzv_live_nodes", job_id="big") == 0


def test_a_removed_jobs_join_count_comes_back_with_its_next_join() -> None:
    """Joins are counted on a child kept per job (not .labels() per join); a removed
    job's child goes with its series, so a later job of that id is counted where a scrape sees it."""
    m = Metrics()
    m.joined("j")
    m.joined("j")
    m.agent_message("join")
    assert value(m.render().decode(), "rdzv_joins_total", job_id="j") == 2
    m.forget("j")
    assert all(lab.get("job_id") != "j" for lab, _ in series(m.render().decode()).get("rdzv_joins_total", []))
    m.joined("j")
    text = m.render().decode()
    assert value(text, "rdzv_joins_total", job_id="j") == 1
    assert value(text, "rdzv_agent_messages_total", op="join") == 1
