"""Host records over the real app: a failing host cooled down while a spare
takes over, cordon and drain, health reports, and hostile input to the host
endpoints."""

from __future__ import annotations

import asyncio
import logging

import pytest

from rdzv_common.protocol import ExitRecord, FailedMsg
from rdzv_server.app import Settings
from rdzv_server.hosts import HostRules

from .conftest import form, join_msg


def failure(rank: int = 0) -> list[ExitRecord]:
    return [ExitRecord(local_rank=0, rank=rank, pid=1234, exit_code=1, message="ECC error")]


async def get_json(client, path: str, status: int = 200):
    resp = await client.get(path)
    assert resp.status == status, await resp.text()
    return await resp.json()


async def post_json(client, path: str, body=None, status: int = 200, **kw):
    resp = await client.post(path, json=body, **kw) if body is not None else await client.post(path, **kw)
    assert resp.status == status, await resp.text()
    return await resp.json()


async def until(agent, op: str):
    """The next ``op`` message, past spare notices of earlier rounds."""
    while True:
        msg = await agent.recv()
        if msg.op == op:
            return msg
        assert msg.op in ("spare", "joined"), msg


async def spare_in_2_of_2(connect, job_id: str, max_restarts: int = 5, on=None):
    """node a and b run a 2:2 job, node c waits as a spare."""
    from rdzv_common.protocol import JobSpec

    spec = JobSpec(min_nodes=2, max_nodes=2, max_restarts=max_restarts)
    agents = {n: await connect(on) for n in ("a", "b", "c")}
    for n in ("a", "b"):
        await agents[n].send(join_msg(job_id, n, spec=spec))
    for n in ("a", "b"):
        await agents[n].expect("joined")
        await agents[n].expect("assigned")
    await agents["c"].send(join_msg(job_id, "c", spec=spec))
    await agents["c"].expect("joined")
    assert (await agents["c"].expect("spare")).reason is None
    return agents, spec


async def test_a_host_that_fails_three_times_is_cooled_down_and_a_spare_takes_over(make_client, connect):
    client = await make_client(Settings(host_rules=HostRules(failures=3, window_s=600, cooldown_s=60)))
    agents, spec = await spare_in_2_of_2(connect, "cool", on=client)
    a, b, c = agents["a"], agents["b"], agents["c"]
    for round_no in range(3):
        await a.send(FailedMsg(round=round_no, failures=failure()))
        for agent in (a, b):
            await agent.expect("restart")
        await a.expect("ack")
        if round_no < 2:  # a and b rejoin and run the next round; c stays a spare
            for n, agent in (("a", a), ("b", b)):
                await agent.send(join_msg("cool", n, spec=spec))
            for agent in (a, b):
                await agent.expect("joined")
                assert (await agent.expect("assigned")).assignment.round == round_no + 1
    # the third failure cooled host a down: it waits as a spare, told why; c takes its place
    await b.send(join_msg("cool", "b", spec=spec))
    await a.send(join_msg("cool", "a", spec=spec))
    await a.expect("joined")
    spare = await a.expect("spare")
    assert spare.reason is not None and "cooled down" in spare.reason and "3 failures" in spare.reason
    for agent in (b, c):
        assigned = (await until(agent, "assigned")).assignment
        assert assigned.round == 3 and assigned.group_world_size == 2
    view = await get_json(client, "/v1/jobs/cool")
    assert view["state"] == "running" and [n["node_id"] for n in view["nodes"]] == ["b", "c"]
    assert [s["node_id"] for s in view["spares"]] == ["a"] and "cooled down" in view["spares"][0]["host_blocked"]
    host = await get_json(client, "/v1/hosts/a")
    assert host["state"] == "cooled_down" and host["failures_total"] == 3 and host["cooldowns"] == 1
    assert all(f["job_id"] == "cool" and "ECC error" in f["reason"] for f in host["failures"])
    listing = await get_json(client, "/v1/hosts")
    assert [h["host"] for h in listing["hosts"]] == ["a"]  # b and c never failed: no record


async def test_cordon_keeps_a_host_out_drain_replaces_its_node_uncordon_lets_it_back(client, connect, caplog):
    agents, spec = await spare_in_2_of_2(connect, "drain")
    a, b, c = agents["a"], agents["b"], agents["c"]
    caplog.set_level(logging.INFO, logger="rdzv_server.audit")
    view = await post_json(client, "/v1/hosts/b/cordon", {"reason": "bad DIMM", "ttl_s": 7200, "drain": True})
    assert view["state"] == "cordoned" and view["drain"] and "bad DIMM" in view["reason"]
    for agent in (a, b):  # a new round opens at once, saying why
        restart = await agent.expect("restart")
        assert "drain" in restart.reason and "bad DIMM" in restart.reason
    await a.send(join_msg("drain", "a", spec=spec))
    await b.send(join_msg("drain", "b", spec=spec))
    await b.expect("joined")
    held = await b.expect("spare")
    assert held.reason is not None and "cordoned" in held.reason and "bad DIMM" in held.reason
    await a.expect("joined")
    for agent in (a, c):
        assigned = (await until(agent, "assigned")).assignment
        assert assigned.round == 1
    job = await get_json(client, "/v1/jobs/drain")
    assert [n["node_id"] for n in job["nodes"]] == ["a", "c"] and job["restarts"] == 0  # a drain is not charged
    assert "bad DIMM" in job["spares"][0]["host_blocked"]
    assert any("cordoned" in r.getMessage() and "bad DIMM" in r.getMessage() for r in caplog.records)
    back = await post_json(client, "/v1/hosts/b/uncordon")
    assert back["state"] == "ok" and back["reason"] is None
    again = await b.expect("spare")  # a plain spare now: the job is at max_nodes
    assert again.reason is None
    job = await get_json(client, "/v1/jobs/drain")
    assert job["spares"][0]["host_blocked"] is None
    assert any("uncordoned" in r.getMessage() for r in caplog.records)


async def test_cordon_without_drain_leaves_running_nodes_and_holds_new_joins(client, connect):
    (a1, a2), _ = await form(connect, "keep", ["n1", "n2"], nnodes=(1, 3))
    await post_json(client, "/v1/hosts/n3/cordon", {"reason": "maintenance"})
    newcomer = await connect()
    await newcomer.send(join_msg("keep", "n3", (1, 3)))
    await newcomer.expect("joined")
    held = await newcomer.expect("spare")
    assert "maintenance" in held.reason
    await asyncio.sleep(0.8)  # longer than the scale-up window: no round opens for it
    job = await get_json(client, "/v1/jobs/keep")
    assert job["round"] == 0 and job["state"] == "running" and len(job["nodes"]) == 2
    await post_json(client, "/v1/hosts/n3/uncordon")
    for agent in (a1, a2):  # admitted below max_nodes: a scale-up round
        restart = await agent.expect("restart")
        assert "scale-up" in restart.reason


async def test_health_report_goes_into_the_host_record(client):
    view = await post_json(client, "/v1/hosts/gpu7/health", {"job_id": "j", "reason": "GPU 3: matmul failed"})
    assert view["failures_total"] == 1 and "health check failed: GPU 3: matmul failed" in view["failures"][0]["reason"]


async def test_host_records_survive_a_server_restart(make_client, tmp_path):
    first = await make_client(Settings(data_dir=tmp_path))
    await post_json(first, "/v1/hosts/h1/cordon", {"reason": "r", "ttl_s": 3600})
    await post_json(first, "/v1/hosts/h2/health", {"reason": "disk full"})
    await first.close()
    second = await make_client(Settings(data_dir=tmp_path))
    listing = await get_json(second, "/v1/hosts")
    assert [(h["host"], h["state"]) for h in listing["hosts"]] == [("h1", "cordoned"), ("h2", "ok")]


async def test_hosts_are_paged(client):
    for i in range(5):
        await post_json(client, f"/v1/hosts/h{i}/cordon", {"reason": "r"})
    seen, cursor = [], None
    while True:
        page = await get_json(client, "/v1/hosts?limit=2" + (f"&cursor={cursor}" if cursor else ""))
        seen += [h["host"] for h in page["hosts"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == [f"h{i}" for i in range(5)]


@pytest.mark.parametrize(
    "method,path,body,status,code",
    [
        ("get", "/v1/hosts/nobody", None, 404, "not_found"),
        ("post", "/v1/hosts/nobody/uncordon", None, 404, "not_found"),
        ("get", "/v1/hosts/bad%20host", None, 422, "validation_error"),
        ("get", "/v1/hosts/" + "h" * 300, None, 422, "validation_error"),
        ("post", "/v1/hosts/bad%0Ahost/cordon", {"reason": "r"}, 422, "validation_error"),
        ("post", "/v1/hosts/h/cordon", {}, 422, "validation_error"),
        ("post", "/v1/hosts/h/cordon", {"reason": ""}, 422, "validation_error"),
        ("post", "/v1/hosts/h/cordon", {"reason": "x" * 301}, 422, "validation_error"),
        ("post", "/v1/hosts/h/cordon", {"reason": "r", "ttl_s": -1}, 422, "validation_error"),
        ("post", "/v1/hosts/h/cordon", {"reason": "r", "ttl_s": 1e30}, 422, "validation_error"),
        ("post", "/v1/hosts/h/cordon", {"reason": "r", "drain": "yes"}, 422, "validation_error"),
        ("post", "/v1/hosts/h/cordon", {"reason": "r", "extra": 1}, 422, "validation_error"),
        ("post", "/v1/hosts/h/cordon", "not json", 422, "validation_error"),
        ("post", "/v1/hosts/h/cordon", [1, 2], 422, "validation_error"),
        ("post", "/v1/hosts/h/uncordon", {"reason": "r"}, 422, "validation_error"),
        ("post", "/v1/hosts/h/health", {"reason": "r", "job_id": "bad id"}, 422, "validation_error"),
        ("get", "/v1/hosts?limit=0", None, 422, "validation_error"),
        ("get", "/v1/hosts?limit=abc", None, 422, "validation_error"),
        ("get", "/v1/hosts?cursor=!!!", None, 422, "validation_error"),
        ("get", "/v1/hosts?cursor=" + "A" * 600, None, 422, "validation_error"),
        ("get", "/v1/hosts?cursor=_-8", None, 422, "validation_error"),
    ],
)
async def test_hostile_input_to_host_endpoints_is_refused_and_changes_nothing(client, method, path, body, status, code):
    kw = {"data": body} if isinstance(body, str) else {"json": body} if body is not None else {}
    resp = await getattr(client, method)(path, **kw)
    assert resp.status == status, await resp.text()
    err = await resp.json()
    assert set(err) == {"code", "message"} and err["code"] == code and "\n" not in err["message"]
    listing = await get_json(client, "/v1/hosts")
    assert listing["hosts"] == []


async def test_host_table_is_capped_against_invented_host_names(make_client):
    client = await make_client(Settings(host_rules=HostRules(max_hosts=3)))
    for i in range(10):
        await post_json(client, f"/v1/hosts/invented{i}/health", {"reason": "x"})
    listing = await get_json(client, "/v1/hosts")
    assert [h["host"] for h in listing["hosts"]] == ["invented7", "invented8", "invented9"]


async def test_a_table_full_of_blocked_hosts_refuses_new_records_and_changes_nothing(make_client):
    client = await make_client(Settings(host_rules=HostRules(max_hosts=2)))
    for host in ("c1", "c2"):
        await post_json(client, f"/v1/hosts/{host}/cordon", {"reason": "r"})
    for path, body in (("/v1/hosts/c3/cordon", {"reason": "r"}), ("/v1/hosts/c3/health", {"reason": "x"})):
        err = await post_json(client, path, body, status=503)
        assert err["code"] == "unavailable" and "full" in err["message"]
    listing = await get_json(client, "/v1/hosts")
    assert [h["host"] for h in listing["hosts"]] == ["c1", "c2"]


def test_cli_refuses_a_host_name_that_is_not_one(capsys):
    from rdzv_client.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--endpoint", "127.0.0.1:1", "cordon", "a/b", "--reason", "r"])
    assert e.value.code == 2 and "is not a host name" in capsys.readouterr().err


async def test_openapi_lists_the_host_endpoints(client):
    doc = await get_json(client, "/openapi.json")
    assert {"/v1/hosts", "/v1/hosts/{host}", "/v1/hosts/{host}/cordon", "/v1/hosts/{host}/uncordon"} <= set(
        doc["paths"]
    )


async def test_health_clock_check_reads_the_servers_date_header(client):
    from rdzv_client.health import check_clock

    endpoint = f"127.0.0.1:{client.port}"
    assert await asyncio.to_thread(check_clock, endpoint, 5.0) is None
    failed = await asyncio.to_thread(check_clock, endpoint, -1.0)  # any skew is too much
    assert failed is not None and failed.startswith("clock: ") and "off the server's" in failed
