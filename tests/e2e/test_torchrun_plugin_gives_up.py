"""torchrun with ``--rdzv-backend=rdzv`` gives up on an unreachable server
after ``--rdzv-conf server_timeout=S`` (issue 13, item 12), saying so while it
waits, instead of 600 s of silence. Stock torchrun, our handler, real
processes (the ``rig`` fixture, tests/helpers/torchrun.py)."""

from __future__ import annotations

import os
import signal

import pytest

pytest.importorskip("torch")

from tests.helpers.procs import alive, descendants, free_port, wait_until
from tests.helpers.torchrun import Rig

from .test_torchrun_plugin import _at

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(90)
def test_plugin_gives_up_on_an_endpoint_nobody_answers(rig: Rig) -> None:
    rig.port = free_port()  # nothing listens there
    node = rig.torchrun("node0", "nobody", "1:1", "--steps", "5", conf="server_timeout=5")
    rc = node.wait_exit(60)  # the join timeout (600 s) would be much later
    text = node.text()
    assert rc != 0, text[-3000:]
    assert "rdzv server 127.0.0.1:%d unreachable for" % rig.port in text, text[-3000:]
    assert "giving up in" in text, text[-3000:]  # progress while it waited
    assert "RendezvousConnectionError" in text and "server_timeout" in text, text[-3000:]


@pytest.mark.timeout(120)
def test_plugin_gives_up_when_the_server_dies_while_workers_run(rig: Rig) -> None:
    server = rig.start_server()
    node = rig.torchrun("node0", "orphan", "1:1", "--steps", "100000", "--interval", "0.05", conf="server_timeout=5")
    wait_until(lambda: _at(node, world=1, step=2), 60, "the worker at step 2")
    workers = descendants(node.pid)
    assert workers
    os.kill(server.pid, signal.SIGKILL)
    server.wait_exit(10)
    rc = node.wait_exit(60)
    text = node.text()
    assert rc != 0, text[-3000:]
    assert "unreachable for" in text and "server_timeout" in text, text[-3000:]
    wait_until(lambda: not any(alive(pid) for pid in workers), 10, "its workers gone")


@pytest.mark.timeout(90)
def test_plugin_never_reaching_its_endpoint_fails_fast_naming_it(rig: Rig) -> None:
    """A typo'd port with the default server_timeout (300 s): torchrun exits
    after the never-reached deadline (service.NEVER_REACHED_S, 10 s; 3 s here
    through its variable) with what was tried and what to check."""
    rig.port = free_port()  # nothing listens there
    node = rig.torchrun("node0", "typo", "1:1", "--steps", "5", env={"RDZV_NEVER_REACHED_TIMEOUT": "3"})
    rc = node.wait_exit(60)  # bounds a hang: server_timeout would be 300 s
    text = node.text()
    assert rc != 0, text[-3000:]
    assert "no rdzv server ever answered" in text and "127.0.0.1:%d" % rig.port in text, text[-3000:]
    assert "--rdzv-endpoint" in text and "RendezvousConnectionError" in text, text[-3000:]
