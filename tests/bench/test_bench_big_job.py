"""bench/big_job.py must not rot: one tiny job (8 nodes) through formation,
heartbeats, a node loss and a scale-up. No timing assertions: only that every
step completed, the job ends at round 2 with all 8 nodes again, and storage
writes were counted for each round change. On SQLite and on etcd (3 replicas);
on etcd also the leader kill: every node follows the new leader and resumes
its round there (the nodes' links walk the replicas and their not_leader
hints), and the largest request sent to etcd is shown."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


@pytest.mark.parametrize("medium", [[], ["--etcd"]], ids=["sqlite", "etcd"])
def test_big_job_bench_smoke(tmp_path, medium):
    out = tmp_path / "big.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.big_job", "--nodes", "8", "--live-s", "1", "--out", str(out), *medium],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
        start_new_session=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| N=8 node loss: connection cut -> all survivors reassigned" in proc.stdout
    (r,) = json.loads(out.read_text())
    assert r["formation_s"] > 0 and r["node_loss_s"] > 0 and r["scale_up_s"] > 0, r
    assert r["formation_behind"] == r["node_loss_behind"] == r["scale_up_behind"] == 0, r
    assert (r["final_round"], r["final_world"]) == (2, 8), r
    assert r["node_loss_storage"]["requests"] >= 1 and r["scale_up_storage"]["requests"] >= 1, r
    assert r["server_rss_mb"] > 0 and r["hb_server_cpu"] >= 0, r
    assert r["storage"] == ("etcd, 3 replica(s)" if medium else "SQLite")
    assert r["node_loss_storage"]["bytes"] > 0, r  # what the server (SQLite) or the etcd members wrote
    if not medium:
        assert "leader_kill" not in r and "max_request_bytes" not in r, r
        return
    lk = r["leader_kill"]
    assert "| N=8 leader kill -9 -> every node back on the new leader and the round complete" in proc.stdout
    # every node resumed its round on the new leader, no node lost: the same round, all 8 in it
    assert lk["behind"] == 0 and lk["round_complete"] and lk["all_s"] is not None, lk
    assert (lk["round_before"], lk["round_after"], lk["world_after"], lk["resumed_rounds"]) == (2, 2, 8, [2]), lk
    assert lk["srv_first_s"] is not None and lk["elected_s"] is not None and lk["loaded_s"] is not None, lk
    assert 0 < r["max_request_bytes"] < 1_572_864, r
