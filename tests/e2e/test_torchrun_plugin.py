"""The stock torchrun with ``--rdzv-backend=rdzv``: our rendezvous handler
(rdzv_client/torch_plugin.py, found through the ``torchrun.handlers`` entry
point) against a real ``rdzv-server`` subprocess, with real gloo workers
(scripts/loop.py: one all_reduce per step, checked against the world size,
one ``step S rank R world W restart C pid P`` line per step), run by the
``rig`` fixture (tests/helpers/torchrun.py). Every wait is on a condition
with a deadline.
"""

from __future__ import annotations

import re
import time

import pytest

pytest.importorskip("torch")

from tests.helpers.procs import alive, descendants, free_port, wait_until
from tests.helpers.torchrun import Rig, TorchrunProc

pytestmark = pytest.mark.e2e


def _at(proc: TorchrunProc, world: int, step: int = 1) -> bool:
    return any(w == world and s >= step for s, _, w, _ in proc.steps())


# --------------------------------------------------------------------- tests


@pytest.mark.timeout(40)
def test_registry_finds_the_handler_and_it_rendezvouses(rig: Rig) -> None:
    """torch's registry creates our handler from the entry point; one
    next_rendezvous against a live server gives rank 0 of 1, a working store
    and a master port; shutdown marks the job succeeded."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from rdzv_client.torch_plugin import RdzvRendezvousHandler

    rig.start_server()
    params = RendezvousParameters(
        backend="rdzv", endpoint=rig.endpoint, run_id="unit", min_nodes=1, max_nodes=1, local_addr="127.0.0.1"
    )
    handler = get_rendezvous_handler(params)
    assert type(handler) is RdzvRendezvousHandler
    assert handler.get_backend() == "rdzv"
    assert handler.use_agent_store is False
    assert handler.get_run_id() == "unit"
    assert handler.is_closed() is False
    assert handler.num_nodes_waiting() == 0
    try:
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        info.store.set("k", b"v")
        assert info.store.get("k") == b"v"
        boot = info.bootstrap_store_info
        assert boot is not None and 0 < boot.master_port < 65536 and boot.master_addr
        assert handler.num_nodes_waiting() == 0
        view = rig.wait_job("unit", lambda v: v["state"] == "running", 5, "job running")
        assert (view["world_size"], len(view["nodes"]), view["nodes"][0]["group_rank"]) == (1, 1, 0)
    finally:
        assert handler.shutdown() is True
    rig.wait_job("unit", lambda v: v["state"] == "succeeded", 5, "job succeeded after shutdown")


@pytest.mark.timeout(60)
def test_two_nodes_form_train_and_succeed(rig: Rig) -> None:
    """(a) two torchrun nodes form one round of world 2, REST shows the job
    running with both; (c) both torchruns exit 0 and the job has succeeded."""
    rig.start_server()
    # a long last call: the two nodes form one round together however slowly torch imports
    nodes = [
        rig.torchrun(f"node{i}", "form", "1:2", "--steps", "30", "--interval", "0.1", conf="last_call_timeout=20")
        for i in range(2)
    ]
    wait_until(lambda: all(_at(n, world=2, step=2) for n in nodes), 40, "both nodes' workers at step 2, world 2")
    view = rig.job("form")
    assert view["state"] == "running", view
    assert (view["round"], view["world_size"], len(view["nodes"])) == (0, 2, 2), view
    assert sorted(n["group_rank"] for n in view["nodes"]) == [0, 1]
    assert {n["state"] for n in view["nodes"]} == {"running"}
    ranks = {r for n in nodes for _, r, _, _ in n.steps()}
    assert ranks == {0, 1}
    for n in nodes:
        assert n.wait_exit(30) == 0, n.text()[-3000:]
        assert all(w == 2 for _, _, w, _ in n.steps())
        assert re.search(r"^done rank \d world 2 restart 0$", n.text(), re.M), n.text()[-2000:]
    view = rig.wait_job("form", lambda v: v["state"] == "succeeded", 5, "job succeeded")
    assert [r["round"] for r in view["history"]] == [0]


@pytest.mark.timeout(60)
def test_an_endpoint_list_goes_past_a_dead_endpoint(rig: Rig) -> None:
    """--rdzv-endpoint DEAD,SERVER (HA replicas, issue 11): torchrun passes the list through, the handler
    goes past the dead one, the job runs and succeeds."""
    rig.start_server()
    node = rig.torchrun(
        "node0", "listed", "1", "--steps", "5", "--interval", "0.05", endpoint=f"127.0.0.1:{free_port()},{rig.endpoint}"
    )
    assert node.wait_exit(45) == 0, node.text()[-3000:]
    assert re.search(r"^done rank 0 world 1 restart 0$", node.text(), re.M), node.text()[-2000:]
    rig.wait_job("listed", lambda v: v["state"] == "succeeded", 5, "job succeeded")


@pytest.mark.timeout(75)
def test_killing_the_store_host_costs_one_round(rig: Rig) -> None:
    """(b) SIGKILL group rank 0 (torchrun, which hosts the round's TCPStore,
    and its worker): torchrun's own c10d backend cannot survive this. Here the
    survivor re-forms alone (nnodes 1:2) with world 1 and trains on; REST
    history shows round 1, opened because that node was lost, and no restart
    spent. (c) the survivor then finishes: exit 0, job succeeded."""
    rig.start_server()
    nodes = [
        rig.torchrun(f"node{i}", "kill", "1:2", "--steps", "40", "--interval", "0.1", conf="last_call_timeout=20")
        for i in range(2)
    ]
    wait_until(lambda: all(_at(n, world=2, step=2) for n in nodes), 40, "both nodes' workers at step 2, world 2")
    view = rig.job("kill")
    assert (view["state"], view["round"], view["world_size"]) == ("running", 0, 2), view
    victim_id = next(n["node_id"] for n in view["nodes"] if n["group_rank"] == 0)
    # the node whose worker is rank 0 is group rank 0 (one worker per node); its id names its pid
    victim = next(n for n in nodes if any(r == 0 for _, r, _, _ in n.steps()))
    assert f"-{victim.pid}-" in victim_id, (victim_id, victim.pid)
    survivor = next(n for n in nodes if n is not victim)
    old_master = (view["master_addr"], view["master_port"])
    killed_at = time.time()
    rig.kill_node(victim)

    view = rig.wait_job("kill", lambda v: v["round"] >= 1 and v["state"] == "running", 20, "round 1 running")
    assert view["round"] == 1, view["history"]
    opened = view["history"][-1]
    assert victim_id in opened["reason"] and "lost" in opened["reason"], opened["reason"]
    assert opened["started_at"] - killed_at < 5, f"round 1 opened {opened['started_at'] - killed_at:.2f}s after"
    assert (view["world_size"], len(view["nodes"])) == (1, 1), view
    assert view["nodes"][0]["group_rank"] == 0 and view["nodes"][0]["node_id"] != victim_id
    assert view["restarts"] == 0, "losing a node is not a worker failure"
    assert (view["master_addr"], view["master_port"]) != old_master
    wait_until(lambda: _at(survivor, world=1, step=3), 30, "the survivor's worker at step 3 with world 1")

    assert survivor.wait_exit(30) == 0, survivor.text()[-3000:]
    assert re.search(r"^done rank 0 world 1 restart \d+$", survivor.text(), re.M), survivor.text()[-2000:]
    view = rig.wait_job("kill", lambda v: v["state"] == "succeeded", 5, "job succeeded")
    assert [r["round"] for r in view["history"]] == [0, 1]


@pytest.mark.timeout(45)
def test_closing_the_job_stops_torchrun(rig: Rig) -> None:
    """``POST /v1/jobs/{id}/close`` (``rdzv close``) while torchrun trains:
    torchrun stops its worker and exits non-zero, naming the closed job."""
    rig.start_server()
    node = rig.torchrun("node0", "closing", "1:1", "--steps", "1000", "--interval", "0.05")
    wait_until(lambda: _at(node, world=1, step=2), 40, "the worker at step 2")
    workers = descendants(node.pid)
    assert workers
    status, body = rig.post("/v1/jobs/closing/close")
    assert (status, body["state"]) == (200, "closed"), body
    rc = node.wait_exit(20)
    assert rc != 0, node.text()[-3000:]
    assert "RendezvousClosedError: job closing closed: " in node.text(), node.text()[-3000:]
    wait_until(lambda: not any(alive(pid) for pid in workers), 10, "its worker gone")
    assert rig.job("closing")["state"] == "closed"
