"""A restarted server (or a new HA leader) gives each node of a big job time
for the reconnect storm on top of the heartbeat timeout: every agent comes back
at once and the server takes their upgrades and resumes one by one."""

from __future__ import annotations

from pathlib import Path

from rdzv_server.store import Store, StoreSettings
from rdzv_server.store_settings import reconnect_grace_s
from tests.unit.test_joblog import form


def test_a_reloaded_job_gives_its_nodes_time_for_the_reconnect_storm(tmp_path: Path) -> None:
    n = 1024
    store = Store(StoreSettings(data_dir=tmp_path), clock=lambda: 1000.0)
    store.open()
    _, spec = form(store, n)
    store.backend.close()

    again = Store(StoreSettings(data_dir=tmp_path), clock=lambda: 2000.0)
    again.open()
    job = again.jobs["j"]
    extra = reconnect_grace_s(n)
    assert extra >= 2.0  # 1,024 nodes: seconds, not the bare heartbeat timeout
    deadlines = {node.lost_deadline for node in job.nodes.values()}
    assert deadlines == {2000.0 + spec.heartbeat_timeout_s + extra}
    again.backend.close()


def test_the_allowance_grows_with_the_nodes_and_is_zero_for_none() -> None:
    assert reconnect_grace_s(0) == 0.0
    assert reconnect_grace_s(-3) == 0.0
    assert reconnect_grace_s(16384) > 30.0 > reconnect_grace_s(8192) > 10.0
