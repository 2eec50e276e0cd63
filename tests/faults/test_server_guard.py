"""What a server refuses at start, on real server processes.

* Without a token it listens on loopback only; a non-loopback ``--host``
  without a token (and without ``--insecure``) is refused in one line, exit 2,
  before anything listens.
* One server per data dir: a second server on the same ``--data-dir``
  refuses in one line naming the first (its pid) and exits 2; the first serves on.
* The database and its -wal/-shm (and the lock file) are created 0600.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from tests.helpers.cluster import FaultCluster
from tests.helpers.procs import Server, free_port, wait_until

from .rawnet import listening, ws_frame, ws_open

pytestmark = [pytest.mark.e2e]

LOOPBACK_HEX = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it


@pytest.mark.timeout(60)
def test_without_a_token_the_server_listens_on_loopback_only(fcluster: FaultCluster, tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "rdzv_server", "--port", str(port), "--data-dir", "none"]
    server = Server("default", fcluster._spawn("default", argv, fcluster.env()), tmp_path / "default.log", port=port)
    fcluster.procs.append(server)
    wait_until(server.healthy, 20, "the server answering on 127.0.0.1")
    assert listening(port) == {LOOPBACK_HEX}, listening(port)
    line = server.wait_log(r"listening on .*", 5)[0].group(0)
    assert "127.0.0.1" in line and "auth: none" in line and "--token" in line, line


@pytest.mark.timeout(60)
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "example.invalid"])
def test_a_non_loopback_host_without_a_token_is_refused(fcluster: FaultCluster, host: str) -> None:
    port = free_port()
    r = fcluster.run_server("--host", host, "--port", str(port), "--data-dir", "none", timeout=15)
    assert r.returncode == 2, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert host in lines[0] and "--token" in lines[0] and "--insecure" in lines[0], lines[0]
    assert not listening(port)


@pytest.mark.timeout(60)
def test_a_second_server_on_the_same_data_dir_is_refused(fcluster: FaultCluster, tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = fcluster.start_server_at(free_port(), data, name="first")
    s = ws_open(first.port)  # a job on disk, so there is something to split
    s.sendall(
        ws_frame(
            '{"op":"join","job_id":"j","node_id":"n0","host":"h","addr":"127.0.0.1",'
            '"local_world_size":1,"master_port":29500,"spec":{"min_nodes":2,"max_nodes":2}}'
        )
    )
    first.wait_job("j", lambda v: len(v["nodes"]) == 1, 10, "the job on disk")
    port = free_port()
    r = fcluster.run_server("--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data), timeout=15)
    assert r.returncode == 2, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert f"pid {first.pid}" in lines[0] and str(data) in lines[0], lines[0]
    assert not listening(port)
    assert first.healthy() and len(first.job("j")["nodes"]) == 1
    s.close()
    # once the first is gone, the dir is free again
    fcluster.kill9(first)
    again = fcluster.start_server_at(free_port(), data, name="again")
    assert again.job("j")["state"] == "waiting"


@pytest.mark.timeout(60)
def test_database_files_are_private(fcluster: FaultCluster, tmp_path: Path) -> None:
    data = tmp_path / "data"
    old = os.umask(0o022)  # the usual umask: files would be world-readable
    try:
        server = fcluster.start_server_at(free_port(), data, name="server")
    finally:
        os.umask(old)
    s = ws_open(server.port)
    s.sendall(
        ws_frame(
            '{"op":"join","job_id":"j","node_id":"n0","host":"h","addr":"127.0.0.1",'
            '"local_world_size":1,"master_port":29500,"spec":{"min_nodes":2,"max_nodes":2}}'
        )
    )
    server.wait_job("j", lambda v: len(v["nodes"]) == 1, 10, "the job on disk")
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in data.iterdir()}
    assert {"rdzv.db", "rdzv.db-wal", "rdzv.db-shm", "rdzv.lock"} <= modes.keys(), modes
    assert all(mode == 0o600 for mode in modes.values()), {k: oct(v) for k, v in modes.items()}
    s.close()
