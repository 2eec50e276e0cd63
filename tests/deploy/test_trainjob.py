"""Checks of deploy/kubernetes/trainjob/ (issue 25, item 3): a Kubeflow Trainer v2 TrainJob and
its TrainingRuntime, and a plain JobSet, that run elastic torchrun through rdzv.

Offline, as the other manifests: each custom resource is validated against the published CRD
schema (an excerpt of it, tests/deploy/data/crd-excerpts.json, written by
tests/deploy/crd_excerpt.py from the CRDs of kubeflow/trainer and kubernetes-sigs/jobset, whose
commits it names), unknown fields refused as `kubectl apply --validate=strict` refuses them; then
what makes them work with rdzv: PET_RDZV_* in the trainer's env, --nnodes=MIN:MAX on the command
line (parsed by torchrun's own parser), none of the five variables Trainer injects and refuses, and
a failed pod replaced alone. tests/e2e/test_trainjob.py runs their commands for real.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
TRAINJOB_DIR = REPO / "deploy" / "kubernetes" / "trainjob"
RUNTIME = TRAINJOB_DIR / "runtime.yaml"
TRAINJOB = TRAINJOB_DIR / "trainjob.yaml"
JOBSET = TRAINJOB_DIR / "jobset.yaml"
SERVER = REPO / "deploy" / "kubernetes" / "server.yaml"
SECRET = REPO / "deploy" / "kubernetes" / "secret.example.yaml"
EXCERPTS = Path(__file__).resolve().parent / "data" / "crd-excerpts.json"
# What Kubeflow Trainer's torch plugin injects into the trainer container and refuses in a TrainJob's
# env (kubeflow/trainer pkg/constants/constants.go, TorchRunReservedEnvNames, v2.3).
TRAINER_INJECTED = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
# Trainer finds the trainer step by this label and its container by this name (constants.go).
ANCESTOR_LABEL = ("trainer.kubeflow.org/trainjob-ancestor-step", "trainer")
TRAINER_CONTAINER = "node"
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def one(path: Path, kind: str) -> dict[str, Any]:
    (found,) = [d for d in docs(path) if d["kind"] == kind]
    return found


def excerpts() -> dict[str, Any]:
    return json.loads(EXCERPTS.read_text())


def unknown_fields(schema: dict[str, Any], value: Any, trail: str = "") -> list[str]:
    """Fields of ``value`` the schema does not know (structural schemas: ``properties`` lists them all,
    unless x-kubernetes-preserve-unknown-fields)."""
    out: list[str] = []
    if isinstance(value, dict) and not schema.get("x-kubernetes-preserve-unknown-fields"):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if props is not None and key in props:
                out += unknown_fields(props[key], item, f"{trail}.{key}")
            elif isinstance(extra, dict):
                out += unknown_fields(extra, item, f"{trail}.{key}")
            elif props is not None and trail != ".metadata":
                out.append(f"{trail}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            out += unknown_fields(schema["items"], item, f"{trail}[{i}]")
    return out


def schema_problems(doc: dict[str, Any]) -> list[str]:
    """What the API server (with strict field validation) would refuse in ``doc``, by the CRD excerpt."""
    kind = excerpts()["kinds"].get(doc.get("kind"))
    if kind is None:
        return [f"no CRD excerpt for kind {doc.get('kind')!r}"]
    problems = []
    if doc.get("apiVersion") != kind["apiVersion"]:
        problems.append(f"apiVersion {doc.get('apiVersion')!r}, the CRD serves {kind['apiVersion']!r}")
    name = doc.get("metadata", {}).get("name", "")
    if not DNS_LABEL.fullmatch(name) or len(name) > 63:
        problems.append(f"metadata.name {name!r} is not a DNS label")
    validator = jsonschema.Draft4Validator(kind["schema"])
    problems += [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]
    problems += [f"unknown field {f}" for f in unknown_fields(kind["schema"], doc)]
    return problems


def custom_resources() -> list[tuple[str, dict[str, Any]]]:
    kinds = excerpts()["kinds"]
    return [
        (f"{p.name}:{d['kind']}", d)
        for p in sorted(TRAINJOB_DIR.glob("*.yaml"))
        for d in docs(p)
        if "." in d["apiVersion"].split("/")[0] or d["kind"] in kinds
    ]


# ---------------------------------------------------------------- the schemas


def test_excerpt_names_its_sources():
    """The excerpt says which repository and commit each CRD came from, and covers the three kinds."""
    data = excerpts()
    assert set(data["kinds"]) == {"TrainJob", "TrainingRuntime", "JobSet"}
    sources = [s for s in data["source"].values() if isinstance(s, dict)]
    assert {s["repository"] for s in sources} == {
        "https://github.com/kubeflow/trainer",
        "https://github.com/kubernetes-sigs/jobset",
    }
    assert all(re.fullmatch(r"[0-9a-f]{40}", s["commit"]) and s["path"] for s in sources)


def test_every_custom_resource_is_checked():
    """Each non-core object under trainjob/ is one of the kinds with a schema (nothing slips past)."""
    found = sorted(d["kind"] for _, d in custom_resources())
    assert found == ["JobSet", "TrainJob", "TrainingRuntime"], found


@pytest.mark.parametrize("where, doc", custom_resources(), ids=lambda x: x if isinstance(x, str) else "")
def test_custom_resources_match_the_published_crd_schemas(where, doc):
    assert schema_problems(doc) == [], where


@pytest.mark.parametrize(
    "path, kind, edit, said",
    [
        (TRAINJOB, "TrainJob", lambda d: d["spec"]["trainer"].__setitem__("numNodes", "4"), "is not of type 'integer'"),
        (TRAINJOB, "TrainJob", lambda d: d["spec"].pop("runtimeRef"), "'runtimeRef' is a required property"),
        (TRAINJOB, "TrainJob", lambda d: d["spec"]["trainer"].__setitem__("numNode", 4), "unknown field .spec.trainer"),
        (
            JOBSET,
            "JobSet",
            lambda d: d["spec"]["replicatedJobs"][0]["template"]["spec"].__setitem__("podReplacmentPolicy", "Failed"),
            "unknown field .spec.replicatedJobs[0].template.spec.podReplacmentPolicy",
        ),
        (JOBSET, "JobSet", lambda d: d["spec"]["replicatedJobs"][0].__setitem__("replicas", -1), "less than"),
        (RUNTIME, "TrainingRuntime", lambda d: d.__setitem__("apiVersion", "kubeflow.org/v1"), "the CRD serves"),
    ],
)
def test_the_schema_check_refuses_a_broken_manifest(path, kind, edit, said):
    """The check fails on a wrong type, a missing required field, a misspelt field, a value out of
    bounds and a wrong apiVersion (so that its passing above means something)."""
    doc = copy.deepcopy(one(path, kind))
    edit(doc)
    problems = schema_problems(doc)
    assert any(said in p for p in problems), problems


# ---------------------------------------------------------------- what makes them work with rdzv


def torchrun_args(command: list[str]):
    """The command parsed by torchrun's own argument parser (torch.distributed.run)."""
    run = pytest.importorskip("torch.distributed.run")
    assert command[0] == "torchrun", command
    return run.get_args_parser().parse_args(command[1:])


def env_of(container_env: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    names = [e["name"] for e in container_env]
    assert len(names) == len(set(names)), names
    return {e["name"]: e for e in container_env}


def assert_rdzv_env(env: dict[str, dict[str, Any]], job_name: str) -> None:
    """PET_RDZV_* select rdzv's plugin and name the server Service and this run's job id."""
    assert env["PET_RDZV_BACKEND"]["value"] == "rdzv"
    host, _, port = env["PET_RDZV_ENDPOINT"]["value"].partition(":")
    service = one(SERVER, "Service")
    assert host == service["metadata"]["name"] and int(port) == service["spec"]["ports"][0]["port"]
    assert env["PET_RDZV_ID"]["value"] == job_name
    for name in TRAINER_INJECTED:
        assert name not in env, f"{name}: Trainer injects it and refuses a TrainJob that sets it"


def assert_token_from_secret(env: dict[str, dict[str, Any]]) -> None:
    secret = one(SECRET, "Secret")
    ref = env["RDZV_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == (secret["metadata"]["name"], "token")


def assert_elastic_command(command: list[str], max_nodes: int, job_name: str) -> None:
    args = torchrun_args(command)
    low, _, high = args.nnodes.partition(":")
    assert 1 <= int(low) < int(high) == max_nodes, args.nnodes
    assert args.max_restarts >= 1, "torchrun's default 0 gives up on the first worker failure"
    assert "new_run=0" in args.rdzv_conf.split(","), "a late pod must not start the job id's next run"
    assert args.training_script == "examples/train_ddp.py"
    assert f"--ckpt-dir=/checkpoints/{job_name}" in args.training_script_args


def assert_lost_pod_replaced_alone(job_spec: dict[str, Any]) -> None:
    """The child Job replaces a failed pod itself (high backoffLimit, once the old pod ended), so
    JobSet never sees a failed Job for one lost pod; disruptions are not even counted."""
    assert job_spec["backoffLimit"] >= 10
    assert job_spec["podReplacementPolicy"] == "Failed"  # required with podFailurePolicy
    rules = job_spec["podFailurePolicy"]["rules"]
    assert {"type": "DisruptionTarget", "status": "True"} in rules[0]["onPodConditions"]
    assert rules[0]["action"] == "Ignore"
    assert not any(r["action"] == "FailJob" for r in rules), "torchrun exits 1 for any failure: no code means 'give up'"
    assert job_spec["template"]["spec"]["restartPolicy"] == "Never"


def test_trainjob_runs_torchrun_through_rdzv():
    """The TrainJob: torchrun with --nnodes=MIN:numNodes, PET_RDZV_* in the trainer's env and none of
    the five variables Trainer injects; its runtime is the TrainingRuntime of runtime.yaml."""
    job = one(TRAINJOB, "TrainJob")
    runtime = one(RUNTIME, "TrainingRuntime")
    trainer = job["spec"]["trainer"]
    ref = job["spec"]["runtimeRef"]
    assert (ref["kind"], ref["name"]) == ("TrainingRuntime", runtime["metadata"]["name"])
    assert_rdzv_env(env_of(trainer["env"]), job["metadata"]["name"])
    assert_elastic_command(trainer["command"] + trainer.get("args", []), trainer["numNodes"], job["metadata"]["name"])
    assert "args" not in trainer, "one command line, as the e2e runs it"


def test_training_runtime_replaces_only_the_lost_pod():
    """The runtime: the trainer step (its label, its container "node") with the token from the Secret,
    the checkpoint volume, and a child Job that replaces a failed pod alone; torch's mlPolicy so that
    Trainer injects the PET_* variables torchrun reads."""
    runtime = one(RUNTIME, "TrainingRuntime")
    assert "torch" in runtime["spec"]["mlPolicy"]
    (step,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    assert step["template"]["metadata"]["labels"][ANCESTOR_LABEL[0]] == ANCESTOR_LABEL[1]
    assert_lost_pod_replaced_alone(step["template"]["spec"])
    assert "failurePolicy" not in runtime["spec"]["template"]["spec"], "a failed Job fails the JobSet, no restart"
    pod = step["template"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == TRAINER_CONTAINER
    assert_token_from_secret(env_of(container["env"]))
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {one(RUNTIME, "PersistentVolumeClaim")["metadata"]["name"]}


def test_jobset_runs_torchrun_through_rdzv_and_replaces_only_the_lost_pod():
    """The JobSet: one child Job of MAX pods (no completions: an elastic run may end on fewer nodes), a
    failed pod replaced by the Job alone, no restart of the whole set; torchrun as in the TrainJob, with
    --nproc-per-node on its command line (no Trainer sets PET_NPROC_PER_NODE here)."""
    jobset = one(JOBSET, "JobSet")
    name = jobset["metadata"]["name"]
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] == 0
    (replicated,) = jobset["spec"]["replicatedJobs"]
    assert replicated["replicas"] == 1
    spec = replicated["template"]["spec"]
    assert spec["completionMode"] == "NonIndexed" and "completions" not in spec
    assert_lost_pod_replaced_alone(spec)
    (container,) = spec["template"]["spec"]["containers"]
    env = env_of(container["env"])
    assert_rdzv_env(env, name)
    assert_token_from_secret(env)
    assert_elastic_command(container["command"] + container.get("args", []), spec["parallelism"], name)
    assert torchrun_args(container["command"]).nproc_per_node == "gpu"
    volumes = spec["template"]["spec"]["volumes"]
    claims = {v["persistentVolumeClaim"]["claimName"] for v in volumes if "persistentVolumeClaim" in v}
    assert claims == {one(JOBSET, "PersistentVolumeClaim")["metadata"]["name"]}
