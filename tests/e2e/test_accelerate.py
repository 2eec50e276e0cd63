"""Real ``accelerate launch --rdzv_backend rdzv`` (Hugging Face accelerate, which
runs torchrun in its own process, so our handler is found through the
``torchrun.handlers`` entry point) on two "nodes" (two launches on loopback, CPU,
gloo) against a real ``rdzv-server``; the workers run scripts/accel_train.py, a
plain accelerate script. The command lines are docs/torchrun.md's recipe
("accelerate").

What broke before (issue 12, item 2): machine_rank 0 died in accelerate's own
port check when the server listened on localhost at --main_process_port; the
job id was torchrun's default ``none`` (accelerate has no --rdzv_id); the server
recorded one worker per node whatever --num_processes said; ``--same_network``
gave the handler an empty endpoint.
"""

from __future__ import annotations

import re
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("accelerate")

from tests.helpers.cluster import E2E_SCRIPTS
from tests.helpers.procs import Proc, Server, free_port, wait_healthy
from tests.helpers.torchrun import Rig

pytestmark = pytest.mark.e2e

SCRIPT = E2E_SCRIPTS / "accel_train.py"
LINE_RE = re.compile(r"^accel rank (\d+) world (\d+) gathered \[([\d, ]*)\] role (\S+)$", re.M)


def _server_at(rig: Rig, host: str) -> Server:
    """A real rdzv-server listening on ``host`` only (memory only)."""
    for _ in range(3):
        server = rig._server("server", free_port(), "none", (), host=host)
        server.host = host
        if wait_healthy(server, 20):
            rig.server, rig.port = server, server.port
            return server
    raise AssertionError(f"server would not start:\n{server.text()[-3000:]}")


def _launch(rig: Rig, name: str, *flags: str, env: dict[str, str] | None = None) -> Proc:
    """``accelerate launch FLAGS scripts/accel_train.py`` (accelerate's own CLI)."""
    argv = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", *flags, str(SCRIPT)]
    return rig.start(name, argv, env)


def _lines(proc: Proc) -> list[tuple[int, int, list[int], str]]:
    return [
        (int(r), int(w), [int(x) for x in g.split(",") if x.strip()], role)
        for r, w, g, role in LINE_RE.findall(proc.text())
    ]


@pytest.mark.timeout(150)
def test_accelerate_launch_two_nodes_as_the_recipe_says(rig: Rig) -> None:
    """The server listens on the address the nodes are given as --main_process_ip
    (node 0's own address, not localhost), so machine_rank 0's port check on
    localhost passes; the job id comes in --rdzv_conf job_id=...; 2 processes per
    node: the server's job has world size 4 and 2 workers on each node."""
    server = _server_at(rig, "127.0.0.2")
    nodes = [
        _launch(
            rig,
            f"node{r}",
            "--multi_gpu",
            "--num_processes",
            "4",
            "--num_machines",
            "2",
            "--machine_rank",
            str(r),
            "--main_process_ip",
            "127.0.0.2",
            "--main_process_port",
            str(server.port),
            "--rdzv_backend",
            "rdzv",
            "--rdzv_conf",
            "job_id=acc-recipe,last_call_timeout=30",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
        )
        for r in range(2)
    ]
    for n in nodes:
        assert n.wait_exit(120) == 0, n.text()[-4000:]
    lines = [x for n in nodes for x in _lines(n)]
    assert sorted(r for r, *_ in lines) == [0, 1, 2, 3], [n.text()[-3000:] for n in nodes]
    assert all(w == 4 and g == [0, 1, 2, 3] for _, w, g, _ in lines), lines
    view = server.wait_job("acc-recipe", lambda v: v["state"] == "succeeded", 10, "job succeeded")
    assert view["world_size"] == 4, view
    assert sorted(n["local_world_size"] for n in view["nodes"]) == [2, 2], view["nodes"]
    assert [(r["round"], r["world_size"]) for r in view["history"]] == [(0, 4)], view["history"]
    assert server.job("none") is None, "the job id is the one given, not torchrun's default"


@pytest.mark.timeout(150)
def test_accelerate_same_network_with_the_server_on_localhost(rig: Rig) -> None:
    """``--same_network`` (accelerate passes no rendezvous endpoint at all) with the
    server listening on localhost of machine 0: the server is named in
    --rdzv_conf server=HOST:PORT and --main_process_port is any free port (only
    accelerate's port check looks at it); the job id comes from torchrun's own
    PET_RDZV_ID."""
    server = rig.start_server()
    port = free_port()
    nodes = [
        _launch(
            rig,
            f"node{r}",
            "--multi_gpu",
            "--same_network",
            "--num_processes",
            "2",
            "--num_machines",
            "2",
            "--machine_rank",
            str(r),
            "--main_process_ip",
            "127.0.0.1",
            "--main_process_port",
            str(port),
            "--rdzv_backend",
            "rdzv",
            "--rdzv_conf",
            f"server={server.endpoint},last_call_timeout=30",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            env={"PET_RDZV_ID": "acc-same-net"},
        )
        for r in range(2)
    ]
    for n in nodes:
        assert n.wait_exit(120) == 0, n.text()[-4000:]
    lines = [x for n in nodes for x in _lines(n)]
    assert sorted(r for r, *_ in lines) == [0, 1] and all(w == 2 for _, w, _, _ in lines), lines
    view = server.wait_job("acc-same-net", lambda v: v["state"] == "succeeded", 10, "job succeeded")
    assert view["world_size"] == 2 and len(view["nodes"]) == 2, view
