"""``rdzv events`` and ``rdzv status --watch`` on the event stream: ``python -m
rdzv_client.cli`` subprocesses against a real ``rdzv-server`` subprocess, jobs
made by agents simulated over the WebSocket (as in test_cli_live)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from tests.api.test_cli_live import (  # noqa: F401  (fixtures)
    CLI_TIMEOUT_S,
    TOKEN,
    WATCH_HEADER,
    _env,
    _one_error_line,
    agents,
    rdzv,
    server,
    token_server,
)

pytestmark = pytest.mark.timeout(60)


async def _start(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "rdzv_client.cli",
        *args,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
        start_new_session=True,
    )


async def _read_until(proc: asyncio.subprocess.Process, needle: bytes, out: bytes = b"") -> bytes:
    while needle not in out:
        chunk = await asyncio.wait_for(proc.stdout.read(4096), CLI_TIMEOUT_S)
        assert chunk, f"it exited ({proc.returncode}) before printing {needle!r}: {out.decode()}"
        out += chunk
    return out


async def _stop(proc: asyncio.subprocess.Process) -> bytes:
    if proc.returncode is None:
        proc.terminate()
    _, err = await asyncio.wait_for(proc.communicate(), 10)
    return err


async def test_events_prints_a_jobs_events_live(server, agents) -> None:
    # --since 0: what happens before their streams open is replayed first
    text = await _start("--endpoint", server.endpoint, "events", "evc", "--since", "0")
    js = await _start("--endpoint", server.endpoint, "events", "--json", "--since", "0")
    try:
        a = await agents(server, "evc", "nodeA", (2, 2))
        b = await agents(server, "evc", "nodeB", (2, 2))
        await a.wait_for("assigned")
        await b.wait_for("assigned")
        out = await _read_until(text, b"round_completed")
        jout = await _read_until(js, b'"round_completed"')
    finally:
        err = await _stop(text)
        jerr = await _stop(js)
    assert b"Traceback" not in err + jerr, (err + jerr).decode()
    lines = out.decode().splitlines()
    joined = [ln for ln in lines if "  node_joined  " in ln]
    assert len(joined) == 2 and "host=nodeA" in joined[0] + joined[1] and "  evc  r0  " in joined[0]
    done = next(ln for ln in lines if "round_completed" in ln)
    assert "world_size=4" in done and "nodes=2" in done
    events = [json.loads(ln) for ln in jout.decode().splitlines() if ln.strip()]
    assert [e["type"] for e in events if e["job"] == "evc"][:4] == [
        "job_state",
        "node_joined",
        "node_joined",
        "round_completed",
    ]
    ids = [e["id"] for e in events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)


async def test_events_since_replays_what_the_server_holds(server, agents) -> None:
    a = await agents(server, "evs", "nodeS", (1, 1))
    await a.wait_for("assigned")
    proc = await _start("--endpoint", server.endpoint, "events", "evs", "--json", "--since", "0")
    try:
        out = await _read_until(proc, b'"round_completed"')
    finally:
        await _stop(proc)
    types = [json.loads(ln)["type"] for ln in out.decode().splitlines() if ln.strip()]
    assert types[:3] == ["job_state", "node_joined", "round_completed"]


async def test_watch_redraws_on_an_event_not_on_a_timer(server, agents) -> None:
    """--interval 600: any redraw within the test's deadline came from an event."""
    proc = await _start("--endpoint", server.endpoint, "status", "evw", "--watch", "--interval", "600")
    try:
        out = await _read_until(proc, b"does not exist yet")
        a = await agents(server, "evw", "nodeW", (1, 1))
        await a.wait_for("assigned")
        out = await _read_until(proc, b"job evw: running", out)
        assert len(WATCH_HEADER.findall(out.decode())) >= 2
    finally:
        err = await _stop(proc)
    assert b"Traceback" not in err, err.decode()


async def test_events_without_the_token_is_one_error_line(token_server) -> None:
    rc, out, err = await rdzv("--endpoint", token_server.endpoint, "events")
    _one_error_line(rc, out, err, "token")
    proc = await _start("--endpoint", token_server.endpoint, "--token", TOKEN, "events", "--json", "--since", "0")
    try:
        await asyncio.sleep(1.0)
        assert proc.returncode is None  # it streams (nothing happened on this server yet)
    finally:
        await _stop(proc)


async def test_events_text_escapes_what_came_over_the_network(server) -> None:
    import urllib.request

    req = urllib.request.Request(
        f"{server.url}/v1/hosts/evil-host/cordon",
        method="POST",
        data=json.dumps({"reason": "disk\x1b[2J\nfake line"}).encode(),
        headers={"Content-Type": "application/json"},
    )
    urllib.request.urlopen(req, timeout=5).close()
    proc = await _start("--endpoint", server.endpoint, "events", "--since", "0")
    try:
        out = await _read_until(proc, b"host_cordoned")
        out = await _read_until(proc, b"\n", out[out.index(b"host_cordoned") :])
    finally:
        await _stop(proc)
    line = next(ln for ln in out.decode().splitlines() if "host_cordoned" in ln)
    assert "\x1b" not in out.decode() and "reason=disk\\x1b[2J\\nfake line" in line, line


async def test_events_on_an_ended_job_says_so_and_exits(server, agents) -> None:
    """Nothing more comes for a job whose run has ended: ``rdzv events JOB``
    says so and exits 0 (it waited forever before); with ``--since`` it
    prints the held events first; a job ending while watched ends it too."""
    a = await agents(server, "evf", "nodeF", (1, 1))
    await a.wait_for("assigned")
    live = await _start("--endpoint", server.endpoint, "events", "evf")
    try:
        await asyncio.sleep(0.5)  # its stream open before the end
        rc, _, err = await rdzv("--endpoint", server.endpoint, "close", "evf")
        assert rc == 0, err
        out, err_b = await asyncio.wait_for(live.communicate(), CLI_TIMEOUT_S)
    finally:
        if live.returncode is None:
            await _stop(live)
    assert live.returncode == 0, err_b.decode()
    assert "job_state" in out.decode() and "state=closed" in out.decode(), out.decode()
    assert "rdzv: job evf has ended (closed" in err_b.decode() and "no more events" in err_b.decode(), err_b.decode()

    rc, out_s, err_s = await rdzv("--endpoint", server.endpoint, "events", "evf")
    assert rc == 0 and out_s == "", (rc, out_s, err_s)
    assert err_s.count("\n") == 1 and "has ended (closed" in err_s and "--since 0" in err_s, err_s
    rc, out_s, err_s = await rdzv("--endpoint", server.endpoint, "events", "evf", "--json", "--since", "0")
    assert rc == 0, err_s
    types = [json.loads(ln)["type"] for ln in out_s.splitlines() if ln.strip()]
    assert types[:3] == ["job_state", "node_joined", "round_completed"] and types[-1] == "job_state", types
    assert "has ended (closed" in err_s and "--since 0" not in err_s, err_s
