"""``rdzv`` that behaves (issue 13, items 4 and 17): text from the server is
escaped, ``--watch`` waits for a job that does not exist yet, ``--json
--watch`` is one compact document per line and quiet on a closed pipe,
global flags work after the subcommand, ``--version`` on every command.
Real ``rdzv-server`` subprocess, simulated agents, ``rdzv`` subprocesses."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request

import pytest

from rdzv_common.protocol import ExitRecord, FailedMsg

from .test_cli_live import CLI_TIMEOUT_S, ROOT, Server, _env, agents, rdzv, server  # noqa: F401 - fixtures

pytestmark = pytest.mark.timeout(60)

HOSTILE = "x\n\x1b[2J\x1b]0;pwned\x07"


async def test_status_escapes_what_agents_sent(server: Server, agents) -> None:
    """A failure whose signal and message hold a newline and escape sequences:
    ``rdzv status`` prints them escaped, the job line and the WHY column stay
    one line each."""
    a = await agents(server, "hostile", "node1", (2, 2), nproc=1)
    b = await agents(server, "hostile", "node2", (2, 2), nproc=1)
    assigned = await a.wait_for("assigned")
    await b.wait_for("assigned")
    await a.ws.send_str(
        FailedMsg(
            round=assigned.assignment.round,
            failures=[ExitRecord(local_rank=0, rank=0, pid=1, signal="SIG\n\x1b[2J", message="ValueError: " + HOSTILE)],
        ).model_dump_json()
    )
    for job in (None, "hostile"):
        args = ["--endpoint", server.endpoint, "status"] + ([job] if job else [])
        rc, out, err = await rdzv(*args)
        assert rc == 0, err
        assert "\x1b" not in out and "\x07" not in out, repr(out)
    rc, out, _ = await rdzv("--endpoint", server.endpoint, "status", "hostile")
    assert "\\x1b[2J" in out, out
    why = [ln for ln in out.splitlines() if ln.startswith("1 ")]
    assert why and "SIG\\n\\x1b[2J" in why[0], out
    rc, out, _ = await rdzv("--endpoint", server.endpoint, "status", "hostile", "--json")
    assert "\x1b" not in out and json.loads(out)["job_id"] == "hostile"


async def test_watch_waits_for_a_job_that_does_not_exist_yet(server: Server, agents) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "rdzv_client.cli",
        "status",
        "later",
        "--watch",
        "--interval",
        "0.2",
        "--endpoint",
        server.endpoint,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
        start_new_session=True,
    )
    out = b""
    try:
        while b"does not exist yet" not in out:
            out += await asyncio.wait_for(proc.stdout.read(4096), CLI_TIMEOUT_S)
            assert proc.returncode is None, out
        a = await agents(server, "later", "node1", (1, 1))
        await a.wait_for("assigned")
        while b"job later: running" not in out:
            chunk = await asyncio.wait_for(proc.stdout.read(4096), CLI_TIMEOUT_S)
            assert chunk, out
            out += chunk
    finally:
        if proc.returncode is None:
            proc.terminate()
        rest, err = await asyncio.wait_for(proc.communicate(), 10)
    assert b"Traceback" not in err, err


async def test_json_watch_is_one_compact_document_per_line_and_quiet_on_a_closed_pipe(server: Server, agents) -> None:
    a = await agents(server, "piped", "node1", (1, 1))
    await a.wait_for("assigned")
    cmd = (
        f"{sys.executable} -m rdzv_client.cli --endpoint {server.endpoint} status piped --json --watch "
        f"--interval 0.1 | head -3"
    )
    done = subprocess.run(
        ["bash", "-o", "pipefail", "-c", cmd],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=CLI_TIMEOUT_S,
        cwd=ROOT,
    )
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert done.stderr == "", done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 3, done.stdout
    for line in lines:
        doc = json.loads(line)
        assert doc["job_id"] == "piped" and doc["state"] == "running"


async def test_global_flags_after_the_subcommand(server: Server, agents) -> None:
    a = await agents(server, "flags", "node1", (1, 1))
    await a.wait_for("assigned")
    rc, out, err = await rdzv("status", "flags", "--endpoint", server.endpoint)
    assert rc == 0 and out.startswith("job flags: running"), (rc, out, err)
    rc, out, err = await rdzv("close", "flags", "--endpoint", server.endpoint, "--token", "unused")
    assert rc == 0 and "job flags: closed" in out, (rc, out, err)
    # before the subcommand still works, and after it wins
    rc, out, err = await rdzv("--endpoint", "127.0.0.1:1", "status", "flags", "--endpoint", server.endpoint)
    assert rc == 0 and out.startswith("job flags: closed"), (rc, out, err)


async def test_nodes_of_an_ended_job_do_not_read_running(server: Server, agents) -> None:
    a = await agents(server, "ended", "node1", (1, 1))
    await a.wait_for("assigned")
    assert [n["state"] for n in server.get("/v1/jobs/ended")["nodes"]] == ["running"]
    urllib.request.urlopen(
        urllib.request.Request(f"{server.url}/v1/jobs/ended/close", method="POST", data=b""), timeout=5
    ).close()
    await a.wait_for("done")
    view = server.get("/v1/jobs/ended")
    assert view["state"] == "closed" and [n["state"] for n in view["nodes"]] == ["closed"], view["nodes"]


@pytest.mark.parametrize(
    "module,name", [("rdzv_client.cli", "rdzv"), ("rdzv_client.agent", "rdzv-agent"), ("rdzv_server", "rdzv-server")]
)
def test_version_everywhere(module: str, name: str) -> None:
    from rdzv_common import __version__

    done = subprocess.run(
        [sys.executable, "-m", module, "--version"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=CLI_TIMEOUT_S,
        cwd=ROOT,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, f"{name} {__version__}\n", ""), done
    meta = (ROOT / "pyproject.toml").read_text()
    assert 'version = {attr = "rdzv_common.__version__"}' in meta  # one constant
