"""Fixtures for the high-availability tests (issue 11): real etcd clusters.

``etcd_cluster``: a started 3-member :class:`tests.helpers.etcd.EtcdCluster`
on loopback ports, under the test's tmp dir; stopped at teardown (every
member, by pid), its data dirs removed (each holds a 64 MB preallocated WAL;
the logs stay), and the members' log tails printed when the test failed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.etcd import EtcdCluster, etcd_binary


@pytest.fixture
def etcd_cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(tmp=tmp_path / "etcd", size=3, binary=etcd_binary())
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        rep = getattr(request.node, "rep_call", None)
        if rep is not None and rep.failed:
            print(f"\n{cluster.log_tails()}")
        cluster.remove_data()
