"""Load: thousands of simulated nodes on the server while a real job trains.

bench/simagents.py (the benchmark's simulated agents, in a client process
of their own) opens ``RDZV_LOAD_NODES`` WebSocket clients (default 2000) that
join two jobs of half that size each and heartbeat at the ``heartbeat_s`` the
server gives them, as agents do. Next to them one real 2-agent job (gloo
workers, ``--heartbeat-timeout 3``, the strictest the tests use) trains.
Under that load the real job must see no spurious eviction: its round stays
0, its workers are never restarted, and it succeeds; no simulated node is
evicted, told to restart or dropped either.

On a busy 2-core CI runner set ``RDZV_LOAD_NODES=500``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from bench.simagents import Clients, node_specs
from rdzv_common.protocol import AGENT_PATH
from tests.helpers.cluster import FaultCluster, Ticks
from tests.helpers.procs import free_port, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NODES = int(os.environ.get("RDZV_LOAD_NODES", "2000"))
JOBS = 2
HB_TIMEOUT = 3.0
SIM_HB_TIMEOUT = 6.0  # the protocol's default, which the simulated nodes use
BAD = ("evicted", "restart", "dropped", "errors")


@pytest.fixture
def sim(fcluster: FaultCluster):
    """Starts simulated agents: ``sim(url)`` -> one bench/simagents client
    process (no WebSocket pings), stopped at teardown."""
    started: list[Clients] = []

    def start(url: str) -> Clients:
        started.append(Clients(1, url, ws_ping=None))
        return started[-1]

    yield start
    for clients in started:
        clients.stop()


@pytest.mark.timeout(170)
def test_thousands_of_nodes_do_not_disturb_a_real_job(fcluster: FaultCluster, sim, tmp_path: Path) -> None:
    per_job = NODES // JOBS
    # the simulated agents share 127.0.0.1 (as the benchmark's: bench/_common.server_argv)
    server = fcluster.start_server_at(
        free_port(), tmp_path / "data", "--max-connections-per-address", "0", name="server"
    )
    stop = tmp_path / "stop"
    real = [
        fcluster.start_ranks_agent(
            server.endpoint,
            "real",
            f"n{i}",
            stop,
            nnodes="2",
            interval=0.1,
            flags=("--heartbeat-timeout", f"{HB_TIMEOUT:g}"),
        )
        for i in range(2)
    ]
    wait_until(lambda: all(Ticks.last_step(a, 0) >= 2 for a in real), 60, "the real job training")

    started = time.monotonic()
    gen = sim(server.url + AGENT_PATH)
    for j in range(JOBS):  # one job after the other, as the benchmark's live part does
        gen.split("connect", node_specs(f"sim-{j}", per_job, base=j * per_job))
        (joined,) = gen.same({"cmd": "join", "jobs": [f"sim-{j}"]})  # answers once all are assigned (or 60 s)
        assert None not in joined["recv"], f"{joined['recv'].count(None)} of sim-{j}'s nodes got no assignment"
    (s,) = gen.same({"cmd": "stats"})
    assert s["assigned"] == per_job * JOBS and {k: s[k] for k in BAD} == dict.fromkeys(BAD, 0), s
    all_in_s = time.monotonic() - started
    for j in range(JOBS):
        view = server.job(f"sim-{j}")
        assert (view["state"], view["round"], len(view["nodes"])) == ("running", 0, per_job), view["waiting_for"]

    # Hold the load for more than a heartbeat timeout of either kind of node,
    # watching the real job and the server's latency all along.
    latencies, views = [], []

    def watch():
        t0 = time.monotonic()
        assert server.healthy()
        latencies.append(time.monotonic() - t0)
        views.append(server.job("real"))
        return time.monotonic() - started - all_in_s > SIM_HB_TIMEOUT + 2

    wait_until(watch, 60, "the load held", interval=0.25)
    (s,) = gen.same({"cmd": "stats"})
    assert {k: s[k] for k in BAD} == dict.fromkeys(BAD, 0), s
    assert s["hb_sent"] > 0
    for v in views:
        assert (v["state"], v["round"]) == ("running", 0), v
        assert all(n["state"] == "running" for n in v["nodes"]), v["nodes"]

    for j in range(JOBS):
        server.close_job(f"sim-{j}")
    wait_until(
        lambda: gen.same({"cmd": "stats"})[0]["done"] >= per_job * JOBS,
        60,
        "every simulated node told the job closed",
        interval=0.5,
    )
    stop.touch()
    for a in real:
        assert a.wait_exit(40) == 0, a.text()[-3000:]
    view = server.job("real")
    assert (view["state"], view["round"], view["restarts"]) == ("succeeded", 0, 0), view
    for a in real:
        ticks = Ticks.of(a)
        assert {t.round for t in ticks} == {0} and len({t.pid for t in ticks}) == 1, f"{a.name} was restarted"
        assert "evicted" not in a.text() and "stopping workers" not in a.text()
    latencies.sort()
    print(
        f"\nload: {per_job * JOBS} simulated nodes in {JOBS} jobs, all assigned {all_in_s:.1f}s after start; "
        f"{s['hb_sent']} heartbeats; /healthz p50 {latencies[len(latencies) // 2] * 1000:.0f} ms, "
        f"max {latencies[-1] * 1000:.0f} ms over {len(latencies)} probes; real job round 0, no eviction"
    )
