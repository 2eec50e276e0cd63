"""A node whose link just slowed down is not evicted by a peer's suspicion
(issue 23's no-false-eviction target: 300 ms of added delay on one node).

The server's probe of a suspect waits for the suspect's kernel to
acknowledge a WebSocket ping, ``probe_deadline(srtt)``. The kernel's
smoothed RTT only learns a new delay when the server's own data is
acknowledged (a pong every 5 s): seconds after a link slowed, it still reads
the old LAN value. Before the fix the deadline was then 0.3 s and a frozen
agent behind a 450 ms link was evicted, though its kernel answered.

Node 0 is linked to the hub through the userspace netem
(tests/helpers/netem.py); its outgoing packets get DELAY; its agent is
SIGSTOPped (its peer hears no probe answer, suspects it, the server probes);
its kernel acknowledges DELAY later. The server must clear it. The delay is
chosen so that even one RTT sample taken after the impairment began would
not have saved the old deadline (4 x DELAY/8 + 0.2 s < DELAY).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from rdzv_server.rounds.suspicion import probe_deadline
from tests.helpers.cluster import FaultCluster
from tests.helpers.netem import tun_link, tun_unavailable
from tests.helpers.netlab import NetLab

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DELAY = 0.45
HB_TIMEOUT = 30.0  # the heartbeats judge nothing here
STOPPED_S = 1.0  # after the probe began: longer than its deadline


@pytest.mark.parametrize("netlab", [2], indirect=True)
@pytest.mark.timeout(120)
def test_a_frozen_agent_behind_a_link_that_just_slowed_is_cleared_not_evicted(
    netlab: NetLab, fcluster: FaultCluster, tmp_path: Path
) -> None:
    why = tun_unavailable()
    if why:
        pytest.skip(why)
    assert 4 * DELAY / 8 + 0.2 < DELAY  # one sample of the new delay in the kernel's srtt would not cover it
    fwd = tun_link(netlab, 0)
    try:
        server = fcluster.start_hub_server(netlab, tmp_path / "data")
        agents = []
        for i in range(2):
            flags = ("--local-addr", netlab.node_addr(i), "--heartbeat-timeout", f"{HB_TIMEOUT:g}", "--no-python")
            argv = [*fcluster.agent_argv(server.endpoint, "slow", "2", 1, flags), "sleep", "600"]
            agents.append(fcluster.start(f"n{i}", ["ip", "netns", "exec", netlab.node_ns(i), *argv]))
        server.wait_job("slow", lambda v: v["state"] == "running" and len(v["nodes"]) == 2, 60, "both nodes running")
        time.sleep(1.0)  # the peers' probes answered (a peer never heard is never suspected)
        fwd.impair(DELAY, 0.0)
        agents[0].popen.send_signal(signal.SIGSTOP)
        try:
            server.wait_log(r"suspected by a peer; probing", 20)
            time.sleep(STOPPED_S)
        finally:
            agents[0].popen.send_signal(signal.SIGCONT)
        fwd.clear()
        hits = server.wait_log(r"suspicion cleared|no answer to probe", 20)
        view = server.job("slow")
        assert view is not None
        waited = [m for m in server.text().splitlines() if "probing it" in m]
        print(f"delay {DELAY * 1000:.0f} ms: {waited[0] if waited else '?'}; LAN deadline {probe_deadline(0.0001):g} s")
        assert "cleared" in hits[0].group(0), [h.group(0) for h in hits]
        assert view["round"] == 0 and view["restarts"] == 0, view["history"]
        assert fwd.counters()["out"]["delayed"] > 0
    finally:
        fwd.close()
