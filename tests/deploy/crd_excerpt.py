"""Writes tests/deploy/data/crd-excerpts.json: the parts of the published CRD schemas
(Kubeflow Trainer's TrainJob and TrainingRuntime, JobSet's JobSet) that the manifests in
deploy/kubernetes/trainjob/ use, so that tests/deploy/test_trainjob.py validates them offline.

Run by hand when a manifest there gains a field, or to move to newer CRDs:

    python tests/deploy/crd_excerpt.py SOURCE_JSON CRD.yaml [CRD.yaml ...]

SOURCE_JSON is a JSON object saying where the CRD files come from (repository, commit,
release, path of each); it is stored as the excerpt's "source". For each CRD, the served
version's openAPIV3Schema is kept only along the paths the manifests use, with every
constraint there (type, enum, required, pattern, bounds, int-or-string, preserve-unknown-
fields) and without descriptions, defaults and CEL rules (x-kubernetes-validations, which
the test cannot evaluate). An object keeps the properties the manifests use: a field the
excerpt lacks is an unknown field to the test (as to `kubectl apply --validate=strict`)
until this script is run again.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "deploy" / "kubernetes" / "trainjob"
OUT = Path(__file__).resolve().parent / "data" / "crd-excerpts.json"
KEPT = (
    "type",
    "enum",
    "required",
    "format",
    "pattern",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "minProperties",
    "maxProperties",
    "nullable",
    "anyOf",
    "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields",
)


def prune(schema: dict[str, Any], values: list[Any]) -> dict[str, Any]:
    """``schema`` cut down to what ``values`` (instances at this place) use."""
    out = {key: schema[key] for key in KEPT if key in schema}
    dicts = [v for v in values if isinstance(v, dict)]
    lists = [v for v in values if isinstance(v, list)]
    if "properties" in schema:
        used = sorted({key for d in dicts for key in d if key in schema["properties"]})
        out["properties"] = {key: prune(schema["properties"][key], [d[key] for d in dicts if key in d]) for key in used}
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = prune(schema["additionalProperties"], [x for d in dicts for x in d.values()])
    if isinstance(schema.get("items"), dict):
        out["items"] = prune(schema["items"], [x for item in lists for x in item])
    return out


def main(argv: list[str]) -> None:
    source = json.loads(Path(argv[0]).read_text())
    docs = [d for path in sorted(MANIFESTS.glob("*.yaml")) for d in yaml.safe_load_all(path.read_text()) if d]
    kinds: dict[str, Any] = {}
    for crd_path in argv[1:]:
        crd = yaml.safe_load(Path(crd_path).read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
        instances = [d for d in docs if d.get("kind") == kind and d.get("apiVersion") == f"{group}/{version['name']}"]
        kinds[kind] = {
            "apiVersion": f"{group}/{version['name']}",
            "scope": crd["spec"]["scope"],
            "schema": prune(version["schema"]["openAPIV3Schema"], instances),
        }
    OUT.write_text(json.dumps({"source": source, "kinds": kinds}, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
