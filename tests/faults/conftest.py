"""Fixtures for fault-injection tests: real server, agents and gloo workers,
killed, restarted, cut off and loaded on purpose.

``fcluster``: a :class:`tests.helpers.cluster.FaultCluster` (the e2e Cluster
plus servers on given ports, restartable after ``kill -9``, and agents in
network namespaces); ``netlab``: a :class:`tests.helpers.netlab.NetLab`
(namespaces joined by a bridge, for partitions). The machinery lives in
``tests/helpers``; ``Ticks`` there parses the ``tick ...`` lines of
``scripts/ranks.py`` workers.

Everything started is stopped by pid, and every namespace created is
deleted, on failure too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.cluster import FaultCluster, managed
from tests.helpers.netlab import netlab_or_skip


@pytest.fixture
def fcluster(tmp_path: Path, request: pytest.FixtureRequest):
    yield from managed(FaultCluster(tmp=tmp_path), request)


@pytest.fixture
def netlab(request: pytest.FixtureRequest):
    """A NetLab with ``request.param`` nodes (default 3); skipped where namespaces cannot be made.
    Ask for it before ``fcluster``, so that the processes in the namespaces are
    stopped before the namespaces are deleted."""
    with netlab_or_skip(getattr(request, "param", 3)) as lab:
        yield lab
