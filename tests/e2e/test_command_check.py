"""A script or command that does not exist is one line and exit 2 before the agent joins
(issue 25, item 5): no job is created on the server, nothing is charged, the host collects no
failure and is not cooled down. Before, the agent joined, its workers failed at every start, the
job restarted until its budget was spent (~40 lines) and the host was cooled down.
Real server, real agents (each run to its end with a deadline)."""

from __future__ import annotations

import pytest

from tests.helpers.cluster import Cluster

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(90)
def test_a_missing_script_or_command_is_one_line_before_joining(cluster: Cluster) -> None:
    server = cluster.start_server("--host-failures", "1")
    cases = {
        "missing-script": (("nosuch.py", "--lr", "1"), "training script 'nosuch.py' not found (working directory "),
        "missing-module": (("-m", "nosuch_pkg.train"), "-m 'nosuch_pkg.train': no module 'nosuch_pkg' found"),
        "missing-command": (("--no-python", "nosuch-cmd"), "--no-python command 'nosuch-cmd' not found on PATH"),
    }
    tmpdir = cluster.tmp / "agent-tmp"
    tmpdir.mkdir()
    for job_id, (argv, said) in cases.items():
        host = f"host-{job_id}"
        # --max-restarts 0 and one failure per cool-down: had it joined, one failed start would end the
        # job and cool the host down
        result = cluster.run_agent(
            "--endpoint",
            server.endpoint,
            "--job-id",
            job_id,
            "--host-name",
            host,
            "--nnodes",
            "1",
            "--max-restarts",
            "0",
            *argv,
            env={"TMPDIR": str(tmpdir)},  # its own: no sweep of other tests' agent directories to report
            timeout=30,
        )
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2, (job_id, result.returncode, result.stderr)
        assert len(lines) == 1 and lines[0].startswith(f"rdzv-agent: error: {said}"), (job_id, result.stderr)
        assert result.stdout == "", result.stdout
        assert server.job(job_id) is None, f"{job_id}: the server heard of the job"
        assert server.request("GET", f"/v1/hosts/{host}")[0] == 404, f"{host}: the host has a record"
        assert not [p for p in tmpdir.rglob("*") if p.is_file()], "the agent left files behind"
    status, body = server.request("GET", "/v1/jobs")
    assert status == 200 and body["jobs"] == [], body
