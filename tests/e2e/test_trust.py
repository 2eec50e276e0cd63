"""Identity and trust with real agents and real gloo workers: an impostor
cannot take a running node's place, a job secret and the job's spec guard a
job id, and workers never see the server token or the job secret."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from rdzv_common.protocol import AGENT_PATH, ExitRecord, FailedMsg, JobSpec, JoinMsg, LeaveMsg
from tests.helpers.cluster import Cluster
from tests.helpers.procs import wait_until
from tests.helpers.torchrun import Rig, TorchrunProc

from .test_elastic import _all_running

pytestmark = pytest.mark.e2e


async def _impostor(url: str, job_id: str, node_id: str) -> list[dict]:
    """A raw WebSocket client that tries to be ``node_id``: a join, a resume
    and reports; returns the server's answers, one per frame sent."""
    spec = JobSpec(min_nodes=2, max_nodes=2)  # the agents' spec exactly: only the node secret is missing
    join = JoinMsg(
        job_id=job_id, node_id=node_id, host="evil", addr="10.66.66.66", local_world_size=1, master_port=4444, spec=spec
    )
    frames = [
        join,
        join.model_copy(update={"resume_round": 0}),
        join.model_copy(update={"node_secret": "guessed-" + "x" * 24}),
        FailedMsg(round=0, failures=[ExitRecord(local_rank=0, rank=0, pid=1, exit_code=1)]),
        LeaveMsg(reason="taking over"),
    ]
    answers = []
    async with aiohttp.ClientSession() as session, session.ws_connect(url + AGENT_PATH) as ws:
        for frame in frames:
            await ws.send_str(frame.model_dump_json())
            msg = await asyncio.wait_for(ws.receive(), 5.0)
            answers.append(json.loads(msg.data))
    return answers


@pytest.mark.timeout(90)
def test_an_impostor_with_a_running_nodes_id_changes_nothing(cluster: Cluster) -> None:
    """A raw WebSocket client names the group-rank-0 node of a running job
    (its id read from GET /v1/jobs/ID) and sends join, resume, failed and
    leave: every one is refused, the victim's workers keep stepping in round 0
    with the same pids, restarts stay 0, the master stays the victim's, and
    the server never logs the victim as reconnected."""
    server = cluster.start_server()
    agents = [
        cluster.start_agent(server, "victim", "loop.py", "--steps", "100000", "--interval", "0.05") for _ in range(2)
    ]
    _all_running(agents, restart=0, world=2, step=3)
    view = server.job("victim")
    rank0 = next(n for n in view["nodes"] if n["group_rank"] == 0)
    pids = {a.name: {s.pid for s in a.steps()} for a in agents}
    answers = asyncio.run(_impostor(server.url, "victim", rank0["node_id"]))
    assert [a.get("code") for a in answers] == ["node_secret_mismatch"] * 3 + ["not_joined"] * 2, answers
    steps_then = {a.name: max(s.step for s in a.steps()) for a in agents}
    wait_until(
        lambda: all(max(s.step for s in a.steps()) >= steps_then[a.name] + 20 for a in agents),
        30,
        "20 more steps on every node after the impostor",
    )
    after = server.job("victim")
    assert (after["state"], after["round"], after["restarts"]) == ("running", 0, 0), after
    assert (after["master_addr"], after["master_port"]) == (view["master_addr"], view["master_port"])
    assert after["master_addr"] == "127.0.0.1"
    assert [(n["node_id"], n["addr"], n["state"]) for n in after["nodes"]] == [
        (n["node_id"], n["addr"], "running") for n in view["nodes"]
    ]
    for a in agents:
        steps = a.steps()
        assert {s.restart for s in steps} == {0} and {s.pid for s in steps} == pids[a.name], a.name
        assert "rejoining" not in a.text() and "evicted" not in a.text()
    log = server.text()
    assert "reconnected" not in log
    assert f"join refused: job victim node {rank0['node_id']} from 127.0.0.1: node_secret_mismatch" in log
    server.close_job("victim")
    for a in agents:
        assert a.wait_exit(30) == 1


@pytest.mark.timeout(120)
def test_job_secret_and_spec_guard_a_job_and_workers_see_neither_secret(cluster: Cluster, tmp_path: Path) -> None:
    """With a server token and a job secret in the agents' environment: an
    agent without the secret, one with another, and one with other
    --max-restarts each exit 2 with one line saying why; the two right agents
    train, and their workers' environment has neither RDZV_TOKEN nor
    RDZV_JOB_SECRET."""
    token, secret = "t0ken-for-the-test", "job-s3cret-for-the-test"
    server = cluster.start_server("--token", token)
    out = tmp_path / "dumps"
    out.mkdir()
    env = {"RDZV_TOKEN": token, "RDZV_JOB_SECRET": secret}
    first = cluster.start_agent(server, "guarded", "env_dump.py", str(out), env=env)
    server.wait_log(r"job guarded created: .*with a job secret", 20)
    base = ["--endpoint", server.endpoint, "--job-id", "guarded", "--local-addr", "127.0.0.1", "--nnodes", "2"]
    script = str(Path(__file__).parent / "scripts" / "env_dump.py")
    refused = {
        "no secret": cluster.run_agent(*base, script, str(out), env={"RDZV_TOKEN": token}),
        "other secret": cluster.run_agent(
            *base, "--job-secret", "guess-0123456789abcdef", script, str(out), env={"RDZV_TOKEN": token}
        ),
        "other max-restarts": cluster.run_agent(*base, "--max-restarts", "0", script, str(out), env=env),
    }
    expected = {
        "no secret": "requires a job secret",
        "other secret": "wrong job secret",
        "other max-restarts": "max_restarts 3, but node",
    }
    for what, proc in refused.items():
        assert proc.returncode == 2, (what, proc.stderr)
        errors = [line for line in proc.stderr.splitlines() if "error" in line]
        assert len(errors) == 1 and expected[what] in errors[0], (what, proc.stderr)
        assert "Traceback" not in proc.stderr and secret not in proc.stderr, (what, proc.stderr)
    second = cluster.start_agent(server, "guarded", "env_dump.py", str(out), env=env)
    assert first.wait_exit(60) == 0, first.text()
    assert second.wait_exit(30) == 0, second.text()
    dumps = [json.loads(p.read_text()) for p in out.glob("env_rank*_restart0.json")]
    assert sorted(d["rank"] for d in dumps) == [0, 1]
    for d in dumps:
        assert "RDZV_TOKEN" not in d["env"] and "RDZV_JOB_SECRET" not in d["env"], sorted(d["env"])
        assert token not in json.dumps(d["env"]) and secret not in json.dumps(d["env"])
    assert secret not in server.text() and secret not in first.text()


def _torchrun(rig: Rig, name: str, job_id: str, env: dict[str, str], script: str, *args: str) -> TorchrunProc:
    """Stock torchrun with our rendezvous backend, with ``env`` on top of the rig's."""
    return rig.torchrun(name, job_id, "2", *args, script=Path(script), max_restarts=0, env=env)


@pytest.mark.timeout(120)
def test_torchrun_plugin_sends_the_job_secret_and_withholds_credentials(rig: Rig, tmp_path: Path) -> None:
    """torchrun nodes with RDZV_JOB_SECRET: one without it is refused (torchrun
    fails saying why), the two with it train, and torchrun's workers see
    neither RDZV_TOKEN nor RDZV_JOB_SECRET."""
    server = rig.start_server()
    out = tmp_path / "dumps"
    out.mkdir()
    secret = "plugin-job-s3cret"
    env = {"RDZV_JOB_SECRET": secret, "RDZV_TOKEN": "unused-token"}
    script = (str(Path(__file__).parent / "scripts" / "env_dump.py"), str(out))
    first = _torchrun(rig, "first", "tguard", env, *script)
    server.wait_log(r"job tguard created: .*with a job secret", 40)
    stranger = _torchrun(rig, "stranger", "tguard", {}, *script)
    assert stranger.wait_exit(60) != 0
    assert "requires a job secret" in stranger.text(), stranger.text()[-3000:]
    second = _torchrun(rig, "second", "tguard", env, *script)
    assert first.wait_exit(60) == 0, first.text()[-3000:]
    assert second.wait_exit(30) == 0, second.text()[-3000:]
    dumps = [json.loads(p.read_text()) for p in out.glob("env_rank*_restart0.json")]
    assert sorted(d["rank"] for d in dumps) == [0, 1]
    for d in dumps:
        assert "RDZV_TOKEN" not in d["env"] and "RDZV_JOB_SECRET" not in d["env"], sorted(d["env"])
