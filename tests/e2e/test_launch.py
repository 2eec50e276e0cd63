"""Launching: the workers' environment, global ranks, standalone mode and
command-line errors, with real agents and real gloo workers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.cluster import Cluster
from tests.helpers.procs import wait_until

pytestmark = pytest.mark.e2e

TORCHRUN_VARS = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
}


def _dumps(out: Path, world: int, timeout: float = 60.0) -> dict[int, dict]:
    """Wait for every rank's env dump of round 0; return them by rank."""
    wait_until(lambda: len(list(out.glob("env_rank*_restart0.json"))) == world, timeout, f"{world} env dumps in {out}")
    return {int(d["env"]["RANK"]): d for d in (json.loads(p.read_text()) for p in out.glob("env_rank*.json"))}


@pytest.mark.timeout(90)
def test_two_nodes_two_workers_get_torchruns_environment(cluster: Cluster, tmp_path: Path) -> None:
    """2 nodes x 2 workers: every worker's environment is docs/design.md's table,
    and a real all_reduce over the 4 ranks sums right."""
    server = cluster.start_server()
    out = tmp_path / "dumps"
    out.mkdir()
    # node b has its own OMP_NUM_THREADS and NCCL setting: they must be kept
    a = cluster.start_agent(server, "envjob", "env_dump.py", str(out), nproc=2, flags=("--max-restarts", "2"))
    b = cluster.start_agent(
        server,
        "envjob",
        "env_dump.py",
        str(out),
        nproc=2,
        flags=("--max-restarts", "2"),
        env={"OMP_NUM_THREADS": "3", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"},
    )
    assert a.wait_exit(60) == 0, a.text()
    assert b.wait_exit(30) == 0, b.text()
    dumps = _dumps(out, 4, timeout=1)
    assert sorted(dumps) == [0, 1, 2, 3]
    envs = {r: d["env"] for r, d in dumps.items()}
    group_of = {r: int(e["GROUP_RANK"]) for r, e in envs.items()}
    master = {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs.values()}
    assert len(master) == 1, master
    ((addr, port),) = master
    assert addr == "127.0.0.1" and 0 < int(port) < 65536
    for rank, e in envs.items():
        assert set(e) >= TORCHRUN_VARS, TORCHRUN_VARS - set(e)
        g = group_of[rank]
        assert g in (0, 1)
        assert e["LOCAL_RANK"] == str(rank - 2 * g), (rank, e["LOCAL_RANK"])
        assert (e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["GROUP_WORLD_SIZE"]) == ("4", "2", "2")
        assert (e["ROLE_RANK"], e["ROLE_WORLD_SIZE"], e["ROLE_NAME"]) == (str(rank), "4", "default")
        assert e["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert e["TORCHELASTIC_MAX_RESTARTS"] == "2"
        assert e["TORCHELASTIC_RUN_ID"] == "envjob"
        assert e["TORCHELASTIC_USE_AGENT_STORE"] == "False"
        assert dumps[rank]["rank"] == rank and dumps[rank]["world"] == 4
        assert dumps[rank]["sum"] == 1 + 2 + 3 + 4
    # which node is which: node b's workers are the ones with its OMP_NUM_THREADS
    b_groups = {group_of[r] for r, e in envs.items() if e["OMP_NUM_THREADS"] == "3"}
    assert len(b_groups) == 1
    for rank, e in envs.items():
        on_b = group_of[rank] in b_groups
        assert e["OMP_NUM_THREADS"] == ("3" if on_b else "1")  # agent's value, else "1" as nproc > 1
        assert e["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == ("0" if on_b else "1")
    error_files = [e["TORCHELASTIC_ERROR_FILE"] for e in envs.values()]
    assert len(set(error_files)) == 4, error_files
    assert all(Path(f).is_absolute() for f in error_files)
    # without --log-dir they live in the agent's private temp dir, gone with the agent
    leaked = [str(Path(f).parents[2]) for f in error_files if Path(f).parents[2].exists()]
    assert not leaked, leaked
    view = server.job("envjob")
    assert view["state"] == "succeeded" and view["round"] == 0 and view["world_size"] == 4


@pytest.mark.timeout(90)
def test_heterogeneous_nproc_gives_prefix_sum_ranks(cluster: Cluster, tmp_path: Path) -> None:
    """Nodes with 1 and 2 workers: global ranks 0..2 are prefix sums of the
    local world sizes in group-rank order, and OMP_NUM_THREADS is set only
    where nproc > 1."""
    server = cluster.start_server()
    out = tmp_path / "dumps"
    out.mkdir()
    one = cluster.start_agent(server, "hetero", "env_dump.py", str(out), nproc=1)
    two = cluster.start_agent(server, "hetero", "env_dump.py", str(out), nproc=2)
    assert one.wait_exit(60) == 0, one.text()
    assert two.wait_exit(30) == 0, two.text()
    envs = {r: d["env"] for r, d in _dumps(out, 3, timeout=1).items()}
    assert sorted(envs) == [0, 1, 2]
    by_group: dict[int, list[dict]] = {}
    for e in envs.values():
        by_group.setdefault(int(e["GROUP_RANK"]), []).append(e)
    assert sorted(by_group) == [0, 1]
    offset = 0
    for g in (0, 1):
        members = sorted(by_group[g], key=lambda e: int(e["LOCAL_RANK"]))
        lws = len(members)
        for lr, e in enumerate(members):
            assert e["LOCAL_WORLD_SIZE"] == str(lws)
            assert e["RANK"] == str(offset + lr) and e["LOCAL_RANK"] == str(lr)
            assert e["WORLD_SIZE"] == "3" and e["GROUP_WORLD_SIZE"] == "2"
            assert ("OMP_NUM_THREADS" in e) == (lws > 1)
        offset += lws
    assert sorted(len(v) for v in by_group.values()) == [1, 2]


@pytest.mark.timeout(60)
def test_standalone_runs_two_workers_without_a_server(cluster: Cluster) -> None:
    """--standalone with 2 workers: an embedded server, a real all_reduce
    over both, exit 0; no rdzv-server process is involved."""
    agent = cluster.start_agent(
        None, "", "loop.py", "--steps", "5", "--interval", "0.02", nproc=2, flags=("--standalone",)
    )
    assert agent.wait_exit(60) == 0, agent.text()
    steps = agent.steps()
    assert {(s.rank, s.world) for s in steps} == {(0, 2), (1, 2)}
    assert max(s.step for s in steps) == 5
    assert "job succeeded" in agent.text() or "done" in agent.text()


@pytest.mark.timeout(30)
def test_slurm_multiple_tasks_per_node_is_refused(cluster: Cluster) -> None:
    """Under SLURM with 2 tasks per node the agent exits 2 and says to use
    one task per node, before contacting anything."""
    r = cluster.run_agent(
        "--endpoint", "127.0.0.1:1", "--job-id", "s", "x.py", env={"SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_ID": "77"}
    )
    assert r.returncode == 2, r
    assert "SLURM_NTASKS_PER_NODE=2" in r.stderr and "--ntasks-per-node=1" in r.stderr, r.stderr


@pytest.mark.timeout(30)
def test_bad_nnodes_is_one_clear_line(cluster: Cluster) -> None:
    """--nnodes 3:2 exits 2 with exactly one line naming the flag."""
    r = cluster.run_agent("--endpoint", "127.0.0.1:1", "--job-id", "s", "--nnodes", "3:2", "x.py")
    assert r.returncode == 2, r
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert "--nnodes" in lines[0] and "3:2" in lines[0], lines
