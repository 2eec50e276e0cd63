"""The commands of deploy/kubernetes/trainjob/ run for real (issue 25, item 3): processes stand
in for the pods of the Kubeflow TrainJob and of the JobSet, each started with the command line and
env taken from the manifest itself, plus, for the TrainJob, the five PET_* variables exactly as
Kubeflow Trainer's torch plugin sets them (PET_NNODES = numNodes, PET_NPROC_PER_NODE, PET_NODE_RANK
= the pod's index, PET_MASTER_ADDR = <trainjob>-node-0-0.<trainjob>, a name that resolves nowhere
here, PET_MASTER_PORT = 29500). Real torchrun (--rdzv-backend from PET_RDZV_BACKEND alone), real
rdzv server, real gloo workers training examples/train_ddp.py.

What each stand-in changes, and only this: PET_RDZV_ENDPOINT is the test's server (not the Service
rdzv-server:29400), the script path is absolute (the image's working directory holds examples/),
--steps and --ckpt-dir are small and under the test's tmp dir, and one CPU worker stands in for the
pod's GPUs (PET_NPROC_PER_NODE "auto", or --nproc-per-node=gpu, would mean every GPU). MIN pods of
MAX start: the job forms at MIN, which proves --nnodes=MIN:MAX on the command line wins over
PET_NNODES=MAX.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("torch")

from tests.helpers.cluster import TRAIN
from tests.helpers.procs import ROOT
from tests.helpers.torchrun import Rig

pytestmark = pytest.mark.e2e

TRAINJOB_DIR = ROOT / "deploy" / "kubernetes" / "trainjob"
STEPS = 20


def _one(path: Path, kind: str) -> dict[str, Any]:
    (found,) = [d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == kind]
    return found


def _values(env: list[dict[str, Any]]) -> dict[str, str]:
    """The literal env values (the token comes from a Secret: the test's server has none)."""
    return {e["name"]: str(e["value"]) for e in env if "value" in e}


def trainjob_pods() -> tuple[str, list[str], int, list[dict[str, str]]]:
    """The TrainJob's job id, command, MIN and each pod's env as Trainer builds it (runtime's env,
    then the TrainJob's, then the torch plugin's five), for MIN pods."""
    job = _one(TRAINJOB_DIR / "trainjob.yaml", "TrainJob")
    runtime = _one(TRAINJOB_DIR / "runtime.yaml", "TrainingRuntime")
    name, trainer = job["metadata"]["name"], job["spec"]["trainer"]
    (step,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    (container,) = step["template"]["spec"]["template"]["spec"]["containers"]
    command = trainer["command"] + trainer.get("args", [])
    low = int(next(a for a in command if a.startswith("--nnodes=")).split("=")[1].split(":")[0])
    pods = [
        {
            **_values(container.get("env", [])),
            **_values(trainer["env"]),
            "PET_NNODES": str(trainer["numNodes"]),
            "PET_NPROC_PER_NODE": str(trainer.get("numProcPerNode", "auto")),
            "PET_NODE_RANK": str(index),
            "PET_MASTER_ADDR": f"{name}-node-0-0.{name}",
            "PET_MASTER_PORT": "29500",
        }
        for index in range(low)
    ]
    return name, command, low, pods


def jobset_pods() -> tuple[str, list[str], int, list[dict[str, str]]]:
    jobset = _one(TRAINJOB_DIR / "jobset.yaml", "JobSet")
    (replicated,) = jobset["spec"]["replicatedJobs"]
    (container,) = replicated["template"]["spec"]["template"]["spec"]["containers"]
    command = container["command"] + container.get("args", [])
    low = int(next(a for a in command if a.startswith("--nnodes=")).split("=")[1].split(":")[0])
    return jobset["metadata"]["name"], command, low, [_values(container["env"]) for _ in range(low)]


def stand_in(command: list[str], ckpt_dir: Path) -> list[str]:
    """The manifest's command as this machine runs it (the changes the module docstring lists)."""
    assert command[0] == "torchrun", command
    argv = [sys.executable, "-m", "torch.distributed.run"]
    for arg in command[1:]:
        if arg.startswith("--nproc-per-node="):
            arg = "--nproc-per-node=1"
        elif arg == "examples/train_ddp.py":
            arg = str(TRAIN)
        elif arg.startswith("--steps="):
            arg = f"--steps={STEPS}"
        elif arg.startswith("--ckpt-dir="):
            arg = f"--ckpt-dir={ckpt_dir}"
        argv.append(arg)
    assert str(TRAIN) in argv, command
    return argv


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pods", [trainjob_pods, jobset_pods], ids=["trainjob", "jobset"])
def test_the_manifest_command_forms_a_job_through_rdzv_and_trains(rig: Rig, tmp_path: Path, pods) -> None:
    server = rig.start_server()
    job_id, command, low, envs = pods()
    argv = stand_in(command, tmp_path / "ckpt")
    procs = []
    for index, env in enumerate(envs):
        assert env["PET_RDZV_BACKEND"] == "rdzv" and env["PET_RDZV_ID"] == job_id, env
        env = {**env, "PET_RDZV_ENDPOINT": server.endpoint}
        if env.get("PET_NPROC_PER_NODE") == "auto":
            env["PET_NPROC_PER_NODE"] = "1"
        procs.append(rig.start(f"pod{index}", argv, env))
    for proc in procs:
        assert proc.wait_exit(90) == 0, proc.text()[-4000:]
    assert sum(f"done step {STEPS}" in p.text() for p in procs) == 1, [p.text()[-2000:] for p in procs]
    view = server.wait_job(job_id, lambda v: v["state"] == "succeeded", 10, "the job succeeded")
    assert view["world_size"] == low and len(view["nodes"]) == low, view
    assert [r["world_size"] for r in view["history"]] == [low], view["history"]
