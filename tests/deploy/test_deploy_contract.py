"""Every deploy file parses, README covers each, and every rdzv-server /
rdzv-agent invocation in them uses only flags of the CLI contract
(deploy_files.CONTRACT_FLAGS), which the real entry points list in --help."""

from __future__ import annotations

import re

import pytest

from tests.deploy.deploy_files import (
    COMPOSE,
    CONTRACT_FLAGS,
    DEPLOY,
    DOCKERFILE,
    ENTRYPOINT,
    ENV_ETCD_EXAMPLE,
    ENV_EXAMPLE,
    ETCD_DROPIN,
    K8S_HA_ETCD,
    K8S_HA_JOB,
    K8S_HA_SERVER,
    K8S_JOB,
    K8S_SECRET,
    K8S_SERVER,
    README,
    REPO,
    SBATCH,
    UNIT,
    UNIT_ETCD,
    all_invocations,
    etcd_dropin_invocation,
    help_text,
    load_yaml,
)


def test_expected_files_exist():
    """Every deployment file the README promises is there."""
    for path in (
        SBATCH,
        ENTRYPOINT,
        UNIT,
        ENV_EXAMPLE,
        DOCKERFILE,
        COMPOSE,
        K8S_SERVER,
        K8S_JOB,
        K8S_SECRET,
        README,
        DEPLOY / "container" / "Dockerfile.dockerignore",
        K8S_HA_SERVER,
        K8S_HA_ETCD,
        K8S_HA_JOB,
        UNIT_ETCD,
        ENV_ETCD_EXAMPLE,
        ETCD_DROPIN,
    ):
        assert path.is_file(), f"{path.relative_to(REPO)} is missing"


@pytest.mark.parametrize("path", sorted(DEPLOY.rglob("*.yaml")), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_parses(path):
    """Every YAML file parses (all documents) and holds at least one mapping."""
    docs = load_yaml(path)
    assert docs and all(isinstance(doc, dict) for doc in docs)


def test_readme_covers_every_file():
    """deploy/README.md names every file under deploy/."""
    text = README.read_text()
    for path in DEPLOY.rglob("*"):
        if path.is_file() and path != README and "__pycache__" not in path.parts:
            assert str(path.relative_to(DEPLOY)) in text, f"README does not mention {path.relative_to(DEPLOY)}"


def test_invocations_found_where_expected():
    """The flag scanner sees the commands of every file (so the contract check below means something)."""
    by_file: dict[str, set[str]] = {}
    for inv in all_invocations():
        by_file.setdefault(inv.where.split(":")[0].split("#")[0], set()).add(inv.program)
    expected = {
        UNIT: {"rdzv-server"},
        DOCKERFILE: {"rdzv-server"},
        ENTRYPOINT: {"rdzv-server"},
        COMPOSE: {"rdzv-server", "rdzv-agent"},
        K8S_SERVER: {"rdzv-server"},
        K8S_JOB: {"rdzv-agent"},
        SBATCH: {"rdzv-server", "rdzv-agent"},
        README: {"rdzv-server", "rdzv-agent"},
        UNIT_ETCD: {"rdzv-server"},
        K8S_HA_SERVER: {"rdzv-server"},
        K8S_HA_JOB: {"rdzv-agent"},
    }
    for path, programs in expected.items():
        assert programs <= by_file.get(str(path.relative_to(REPO)), set()), path.name


def test_invocations_use_only_contract_flags():
    """Every rdzv-server/rdzv-agent command in deploy/ uses only flags of the CLI contract (CONTRACT_FLAGS)."""
    bad = [
        f"{inv.where}: {inv.program} {flag}"
        for inv in all_invocations()
        for flag in inv.flags
        if flag not in CONTRACT_FLAGS[inv.program]
    ]
    assert not bad, "flags outside the contract:\n" + "\n".join(bad)


def test_no_token_on_command_lines():
    """The token travels in the environment (RDZV_TOKEN), never in argv where ps shows it."""
    offenders = [inv.where for inv in all_invocations() if "--token" in inv.flags]
    assert not offenders, offenders


@pytest.mark.parametrize("program, module", [("rdzv-server", "rdzv_server"), ("rdzv-agent", "rdzv_client.agent")])
def test_used_flags_appear_in_help(program, module):
    """Each flag the deploy files pass to a program is listed by that program's --help."""
    used = {flag for inv in all_invocations() if inv.program == program for flag in inv.flags}
    if program == "rdzv-server":
        used |= set(etcd_dropin_invocation().flags)
    assert used, f"no {program} flags found"
    text = help_text(module)
    missing = [flag for flag in sorted(used) if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text)]
    assert not missing, f"{program} --help lacks {missing}"
