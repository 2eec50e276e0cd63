"""The agent reads NCCL RAS while its workers run (issue 22 item 4, the
zero-code fallback): a real agent with 2 real gloo workers that time nothing,
and NCCL's RAS port played on loopback (``NCCL_RAS_ADDR``; gloo has no RAS)
answering that local rank 1, by its real pid, launched one collective fewer
than its peers. The agent's log names local rank 1, once, and nothing else;
its heartbeats name it to a real server, whose job view flags the node by it
(slow_rank, rule nccl_lag) and whose host record counts it.

No timed assertions: every wait has a generous deadline.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.cluster import Cluster
from tests.helpers.fake_ras import FakeRas
from tests.helpers.procs import Server, wait_until


def status(pids: dict[int, int]) -> str:
    """RAS's JSON status: the world communicator; ranks 0 and 2 (another node) at 100 all_reduces, rank 1 at 99."""
    ranks = [
        {"rank": r, "host": "127.0.0.1", "pid": pid, "collective_counts": {"AllReduce": 99 if r == 1 else 100}}
        for r, pid in sorted({**pids, 2: 1}.items())
    ]
    comms = [{"hash": "0xfeed", "size": 3, "ranks": ranks, "missing_ranks": []}] if len(pids) == 2 else []
    return json.dumps({"nccl_version": "2.27.3", "communicators": comms})


def flagged(server: Server) -> dict | None:
    """The server's view of the job's one node: its slow_rank when flagged."""
    code, view = server.request("GET", "/v1/jobs/ras")
    nodes = view["nodes"] if code == 200 else []
    return nodes[0]["slow_rank"] if nodes and nodes[0]["straggler"] else None


@pytest.mark.timeout(120)
def test_the_agent_names_its_worker_that_nccl_ras_sees_behind(cluster: Cluster) -> None:
    pids: dict[int, int] = {}
    ras = FakeRas(lambda: status(pids))
    server = cluster.start_server()
    try:
        agent = cluster.start_agent(
            server, "ras", "progress_loop.py", "--steps", "2000", "--interval", "0.02",
            nnodes="1", nproc=2, flags=("--straggler-window-s", "4", "--host-name", "ras-host"),
            env={"NCCL_RAS_ADDR": f"127.0.0.1:{ras.port}"},
        )  # fmt: skip
        agent.wait_log(r"step 1 rank 1 ", timeout=60)
        agent.wait_log(r"step 1 rank 0 ", timeout=60)
        pids.update({s.rank: s.pid for s in agent.steps()})
        line = agent.wait_log(r"local rank \d+ \(pid \d+\) is behind its NCCL communicator .*$", timeout=60)[0]
        said = line.group(0)
        assert said.startswith(f"local rank 1 (pid {pids[1]}) is behind its NCCL communicator 0xfeed in "), said
        # a 4 s window at one reading a second is stretched to 10 readings (nccl_trace.MIN_SAMPLES x 2)
        assert said.endswith("RAS readings over 10s (by up to 1 collectives): a lock-step straggler"), said
        asked = len(ras.seen)  # a few more readings: the rank is not named again
        # the server's view names it: the agent's heartbeats carry it (HeartbeatMsg.nccl_lag)
        wait_until(lambda: flagged(server) is not None, 30, "the server to flag the node")
        slow = flagged(server)
        assert slow is not None and slow["rule"] == "nccl_lag" and slow["local_rank"] == 1, slow
        assert slow["rank"] == 1 and slow["lag_share"] >= 0.3 and slow["collectives_behind"] == 1, slow
        code, host = server.request("GET", "/v1/hosts/ras-host")
        assert code == 200 and host["failures_total"] == 1 and "NCCL RAS" in host["failures"][-1]["reason"], host
        wait_until(lambda: len(ras.seen) >= asked + 3, 30, "3 more RAS readings")
        assert agent.text().count("is behind its NCCL communicator") == 1, agent.text()[-3000:]
        assert flagged(server) is not None  # still lagging: still flagged, once
        assert server.request("GET", "/v1/hosts/ras-host")[1]["failures_total"] == 1
        agent.stop()
    finally:
        ras.close()
    assert ras.seen and all(c[:2] == ["CLIENT PROTOCOL 2", "SET FORMAT json"] for c in ras.seen), ras.seen
