"""Fixtures for end-to-end tests: a real ``rdzv-server``, real ``rdzv-agent``
processes and real torch gloo workers (scripts in ``tests/e2e/scripts``).

``cluster``: a :class:`tests.helpers.cluster.Cluster` (the process machinery
lives in ``tests/helpers``: how processes start, are waited on and are
killed, by pid); ``rig``: a :class:`tests.helpers.torchrun.Rig` (a server and
stock torchrun nodes with our rendezvous backend).

Waiting is always on a condition with a deadline (``wait_until``, a log
line, an exit, a REST field), polled every few tens of milliseconds.

Network isolation is best effort. torch's TCPStore (hosted by rank 0's worker
on MASTER_PORT) listens on every interface, so two jobs on one host could only
meet through a port collision; ports here are free ports picked by the kernel,
and every test has its own server and job ids, which is enough. A private
network namespace per test would also need the test process itself (its REST
calls) inside that namespace, which costs more machinery than it buys. To run
the whole e2e tree in one private namespace anyway::

    unshare -rn sh -c 'ip link set lo up && RDZV_TEST_NETNS=1 exec .venv/bin/pytest tests/e2e'

(``unshare -n`` as root.) The session fixture below only records which way the
suite runs; it never re-executes anything.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.cluster import Cluster, managed
from tests.helpers.torchrun import Rig


@pytest.fixture(scope="session", autouse=True)
def _network_isolation() -> str:
    """Say whether the suite runs in a private network namespace (see the
    module docstring); loopback with free ports otherwise."""
    return "netns" if os.environ.get("RDZV_TEST_NETNS") else "loopback"


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest):
    yield from managed(Cluster(tmp=tmp_path), request)


@pytest.fixture
def rig(tmp_path: Path, request: pytest.FixtureRequest):
    yield from managed(Rig(tmp=tmp_path), request)
