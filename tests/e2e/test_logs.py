"""--log-format json with a real server, real agents and real gloo workers:
every line either process writes is one json object, and the job's events
are there with their job, round and node.

No timed assertions: every wait has a generous deadline.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.helpers.cluster import Cluster


def _rows(path: Path) -> list[dict]:
    rows = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        assert line.isascii(), f"{path.name}:{n} is not ASCII: {line!r}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise AssertionError(f"{path.name}:{n} is not json: {line!r}") from None
        assert isinstance(row, dict), f"{path.name}:{n}: {line!r}"
        for key in ("time", "level", "logger", "job", "round", "node", "event", "message"):
            assert key in row, f"{path.name}:{n} has no {key!r}: {line!r}"
        assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$", row["time"]), row
        rows.append(row)
    assert rows, f"{path.name} is empty"
    return rows


def test_json_logs_of_server_and_agents_parse_and_carry_the_jobs_events(cluster: Cluster) -> None:
    server = cluster.start_server("--log-format", "json")
    marker = cluster.tmp / "failed-once"
    flags = ("--log-format", "json", "--max-restarts", "2", "--redirects", "3", "--log-dir", str(cluster.tmp / "w"))
    script_args = ("--steps", "6", "--fail-once", str(marker), "--fail-rank", "1")
    agents = [
        cluster.start_agent(server, "jl", "loop.py", *script_args, nnodes="2", flags=flags, name=f"node{i}")
        for i in range(2)
    ]
    for agent in agents:
        assert agent.wait_exit(120) == 0, agent.text()[-3000:]
    server.wait_job("jl", lambda v: v["state"] == "succeeded", 30, "job jl succeeded")
    server.stop()

    rows = _rows(server.log_path)
    events: dict[str, list[dict]] = {}
    for row in rows:
        if row["event"] is not None:
            events.setdefault(row["event"], []).append(row)
    assert all(row["job"] == "jl" for evs in events.values() for row in evs), events
    # round 0 formed, a worker failed, round 1 opened and formed, both nodes succeeded, the job too
    assert [r["round"] for r in events["round_completed"]] == [0, 1], events["round_completed"]
    assert all(r["nodes"] == 2 and r["world_size"] == 2 for r in events["round_completed"])
    assert all(r["formation_s"] >= 0 for r in events["round_completed"])
    (failed,) = events["node_failed"]
    assert failed["round"] == 0 and failed["node"] and "worker failure on" in failed["message"], failed
    # the exit record: an exit code, or a signal (a worker that raised can still die of SIGABRT in gloo's teardown
    # when its peer is mid-collective: seen once under load)
    record = failed["exit"]
    assert record["rank"] in (0, 1) and (record["exit_code"] not in (None, 0) or record["signal"]), failed
    (opened,) = events["round_opened"]
    assert opened["round"] == 1 and "restart 1/2" in opened["reason"], opened
    assert sorted(r["round"] for r in events["node_succeeded"]) == [1, 1]
    assert len({r["node"] for r in events["node_succeeded"]}) == 2, events["node_succeeded"]
    # the job's states, as the event stream has them: created, formed, re-forming, formed, succeeded
    states = [r["state"] for r in events["job_state"]]
    assert states == ["waiting", "running", "waiting", "running", "succeeded"], events["job_state"]
    state = events["job_state"][-1]
    assert state["state"] == "succeeded" and state["round"] == 1, state
    (charged,) = events["restart_charged"]
    assert charged["round"] == 1 and charged["restarts"] == 1, charged
    assert len(events["node_joined"]) == 2, events["node_joined"]
    assert any("listening on" in r["message"] for r in rows)

    for agent in agents:
        arows = _rows(agent.log_path)  # stdout and stderr: workers' output went to --log-dir
        mine = [r for r in arows if r["job"] == "jl" and r["node"]]
        assert mine, arows[-5:]
        assert {r["round"] for r in mine} >= {0, 1}, mine
        assert any("all 1 worker(s) exited 0" in r["message"] for r in mine), mine[-5:]


def test_refusals_to_start_are_json_too(cluster: Cluster) -> None:
    """What the programs print instead of log (a refusal to start, a usage error) is json with --log-format json."""
    run = cluster.run_module(
        "rdzv_server", "--log-format", "json", "--host", "10.1.2.3", "--port", "0", "--data-dir", "none"
    )
    assert run.returncode == 2, run
    (row,) = [json.loads(line) for line in run.stderr.splitlines()]
    assert row["level"] == "ERROR" and "refusing to listen on 10.1.2.3 without a token" in row["message"], row
    run = cluster.run_agent("--log-format", "json", "--endpoint", "127.0.0.1:1", "--nnodes", "3:2", "x.py")
    assert run.returncode == 2, run
    rows = [json.loads(line) for line in run.stderr.splitlines()]
    assert rows and rows[-1]["level"] == "ERROR" and "rdzv-agent: error:" in rows[-1]["message"], rows


def test_text_stays_the_default(cluster: Cluster) -> None:
    server = cluster.start_server()
    assert server.request("GET", "/healthz")[0] == 200
    server.stop()
    lines = server.log_path.read_text().splitlines()
    assert lines
    for line in lines:
        assert re.match(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING|ERROR) [\w.]+: ", line), line


def test_workers_output_is_left_alone_with_json(cluster: Cluster) -> None:
    """The agent's own lines are json; a worker's stdout and stderr reach the
    agent's stdout and stderr (separate files here) as the worker wrote them,
    never wrapped in the agent's json."""
    server = cluster.start_server()
    script = cluster.tmp / "talk.py"
    script.write_text(
        "import sys\nprint('worker-out-line', flush=True)\nprint('worker-err-line', file=sys.stderr, flush=True)\n"
    )
    run = cluster.run_agent(
        "--endpoint", server.endpoint, "--job-id", "wo", "--local-addr", "127.0.0.1", "--nnodes", "1",
        "--log-format", "json", str(script), timeout=90,
    )  # fmt: skip
    assert run.returncode == 0, (run.stdout, run.stderr)
    assert "worker-out-line" in run.stdout.splitlines(), run.stdout
    err = run.stderr.splitlines()
    assert "worker-err-line" in err, err
    rows = [json.loads(line) for line in err if line != "worker-err-line"]  # the agent's own: every one json
    assert rows and not any("worker-err-line" in r["message"] for r in rows), rows
