"""What the deploy/ tests share: the files' paths, the CLI contract (the flags
deploy files may use), and the readers that find every rdzv-server / rdzv-agent
invocation in them. Not a test module."""

from __future__ import annotations

import functools
import json
import re
import shlex
import shutil
import stat
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]

DEPLOY = REPO / "deploy"

SBATCH = DEPLOY / "slurm" / "train.sbatch"

ENTRYPOINT = DEPLOY / "container" / "entrypoint.sh"

UNIT = DEPLOY / "systemd" / "rdzv-server.service"

ENV_EXAMPLE = DEPLOY / "systemd" / "server.env.example"

DOCKERFILE = DEPLOY / "container" / "Dockerfile"

COMPOSE = DEPLOY / "container" / "compose.yaml"

K8S_SERVER = DEPLOY / "kubernetes" / "server.yaml"

K8S_JOB = DEPLOY / "kubernetes" / "training-job.yaml"

K8S_SECRET = DEPLOY / "kubernetes" / "secret.example.yaml"


# High availability (issue 11): replicas on etcd.
K8S_HA = DEPLOY / "kubernetes" / "ha"

K8S_HA_SERVER = K8S_HA / "server.yaml"

K8S_HA_ETCD = K8S_HA / "etcd.yaml"

K8S_HA_JOB = K8S_HA / "training-job.yaml"

UNIT_ETCD = DEPLOY / "systemd" / "rdzv-server-etcd.service"

ENV_ETCD_EXAMPLE = DEPLOY / "systemd" / "server-etcd.env.example"

ETCD_DROPIN = DEPLOY / "systemd" / "etcd-tls.conf.example"

README = DEPLOY / "README.md"

BASH = shutil.which("bash") or "/bin/bash"


# The command-line flags deploy files may use: the CLI contract they rely on (no DESIGN.md
# section lists it; docs/design.md has the exit codes). A new flag here is a deliberate choice.
CONTRACT_FLAGS = {
    "rdzv-server": {
        "--host",
        "--port",
        "--data-dir",
        "--token",
        "--tls-cert",
        "--tls-key",
        # replicas on etcd (issue 11); the etcd password comes from RDZV_ETCD_PASSWORD or a file, never argv
        "--etcd",
        "--etcd-prefix",
        "--etcd-cacert",
        "--etcd-cert",
        "--etcd-key",
        "--etcd-user",
        "--etcd-password-file",
        "--etcd-lease-ttl",
        "--advertise-url",
        "--help",
        "-h",
    },
    "rdzv-agent": {
        "--endpoint",
        "--job-id",
        "--nnodes",
        "--nproc-per-node",
        "--max-restarts",
        "--node-rank",
        "--local-addr",
        "--token",
        "--log-dir",
        "--redirects",
        "--tee",
        "--standalone",
        "-m",
        "--no-python",
        "--no-new-run",  # a pod started after its run ended must not start the job id's next run
        "--help",
        "-h",
    },
}


# Flags that take no value.
SWITCHES = {"--standalone", "-m", "--no-python", "--no-new-run", "--help", "-h"}

PROGRAM_RE = re.compile(r"(?:.*[=/])?(rdzv-server|rdzv-agent)")

DATA_DIR = "/var/lib/rdzv"

PORT = 29400


@dataclass(frozen=True)
class Invocation:
    """One rdzv-server/rdzv-agent command found in a deploy file."""

    where: str
    program: str
    options: tuple[tuple[str, str | None], ...]  # (flag, value or None)
    rest: tuple[str, ...]  # the script and its arguments (agent), or whatever follows

    @property
    def flags(self) -> list[str]:
        return [flag for flag, _ in self.options]

    def value(self, flag: str) -> str | None:
        values = [v for f, v in self.options if f == flag]
        assert len(values) <= 1, f"{self.where}: {flag} given twice"
        return values[0] if values else None


def parse_invocation(where: str, program: str, tokens: list[str]) -> Invocation:
    """Splits the tokens after a program name into its options and the rest."""
    options: list[tuple[str, str | None]] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "--" or not token.startswith("-") or token == "-":
            break
        name, eq, inline = token.partition("=")
        if eq:
            options.append((name, inline))
            i += 1
        elif name in SWITCHES:
            options.append((name, None))
            i += 1
        else:
            options.append((name, tokens[i + 1] if i + 1 < len(tokens) else None))
            i += 2
    return Invocation(where, program, tuple(options), tuple(tokens[i:]))


def invocations_in_tokens(where: str, tokens: list[str]) -> list[Invocation]:
    found = []
    for i, token in enumerate(tokens):
        match = PROGRAM_RE.fullmatch(token)
        if match:
            found.append(parse_invocation(where, match.group(1), tokens[i + 1 :]))
    return found


def logical_lines(text: str) -> list[tuple[int, str]]:
    """Lines with backslash continuations joined, numbered by their first line."""
    out: list[tuple[int, str]] = []
    buffer, start = "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if not buffer:
            start = number
        if line.endswith("\\"):
            buffer += line[:-1] + " "
            continue
        out.append((start, buffer + line))
        buffer = ""
    if buffer:
        out.append((start, buffer))
    return out


def shell_words(line: str) -> list[str]:
    line = line.replace("`", " ")
    try:
        return shlex.split(line, posix=True)
    except ValueError:  # prose with an apostrophe, say
        return line.split()


def invocations_in_text(path: Path) -> list[Invocation]:
    """Invocations written as shell text: scripts, ExecStart=, comments, docs."""
    found = []
    for number, line in logical_lines(path.read_text()):
        found += invocations_in_tokens(f"{path.relative_to(REPO)}:{number}", shell_words(line))
    return found


def string_lists(node, trail: str = ""):
    """Yields (trail, list) for every list of strings inside a YAML document."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from string_lists(value, f"{trail}.{key}")
    elif isinstance(node, list):
        if node and all(isinstance(item, (str, int, float)) for item in node):
            yield trail, [str(item) for item in node]
        for index, item in enumerate(node):
            yield from string_lists(item, f"{trail}[{index}]")


def invocations_in_yaml(path: Path) -> list[Invocation]:
    found = []
    for index, doc in enumerate(load_yaml(path)):
        for trail, items in string_lists(doc):
            where = f"{path.relative_to(REPO)}#{index}{trail}"
            found += invocations_in_tokens(where, items)
            if items[:2] == ["sh", "-c"] and len(items) > 2:  # a command run by sh: its words
                found += invocations_in_tokens(where, shell_words(items[2].replace("$$", "$")))
    return found


def invocations_in_dockerfile(path: Path) -> list[Invocation]:
    found = []
    for number, line in logical_lines(path.read_text()):
        match = re.match(r"\s*(?:CMD|ENTRYPOINT)\s+(\[.*\])\s*$", line)
        if match:
            found += invocations_in_tokens(f"{path.relative_to(REPO)}:{number}", json.loads(match.group(1)))
    return found


@functools.cache
def all_invocations() -> tuple[Invocation, ...]:
    """Every invocation in every file under deploy/ (read once per test session)."""
    found: list[Invocation] = []
    for path in sorted(p for p in DEPLOY.rglob("*") if p.is_file()):
        found += invocations_in_text(path)
        if path.suffix in (".yaml", ".yml"):
            found += invocations_in_yaml(path)
        if path.name == "Dockerfile":
            found += invocations_in_dockerfile(path)
    return tuple(found)


def load_yaml(path: Path) -> list:
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def k8s_objects(path: Path) -> dict[tuple[str, str], dict]:
    objects = {}
    for doc in load_yaml(path):
        key = (doc["kind"], doc["metadata"]["name"])
        assert key not in objects, f"{path.name}: {key} defined twice"
        objects[key] = doc
    return objects


def one_of_kind(objects: dict, kind: str) -> dict:
    matches = [obj for (k, _), obj in objects.items() if k == kind]
    assert len(matches) == 1, f"expected one {kind}, found {len(matches)}"
    return matches[0]


def container_invocation(container: dict, program: str, where: str) -> Invocation:
    argv = [str(x) for x in container.get("command", []) + container.get("args", [])]
    found = [inv for inv in invocations_in_tokens(where, argv) if inv.program == program]
    assert len(found) == 1, f"{where}: expected one {program} in {argv}"
    return found[0]


def env_var(container: dict, name: str) -> dict:
    entries = [e for e in container.get("env", []) if e["name"] == name]
    assert len(entries) == 1, f"container {container['name']}: env {name} missing"
    return entries[0]


def write_script(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text).lstrip())
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def run(argv: list[str], timeout: float = 20, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)


IMPORT_FAILED = 97

HELP_CODE = (
    """
import runpy, sys, traceback
sys.argv = [sys.argv[1], "--help"]
try:
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
except ImportError:
    traceback.print_exc()
    sys.exit(%d)
"""
    % IMPORT_FAILED
)


@functools.cache
def _help(module: str) -> subprocess.CompletedProcess:
    # One process, as `python -m <module> --help`; an ImportError while loading
    # the entry point exits with IMPORT_FAILED instead of a traceback exit 1.
    return run([sys.executable, "-c", HELP_CODE, module], cwd=REPO)


def help_text(module: str) -> str:
    """`python -m <module> --help`, or a skip while the entry point cannot be imported yet."""
    result = _help(module)
    if result.returncode == IMPORT_FAILED:
        last = (result.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"entry point not importable yet ({module}: {last})")
    assert result.returncode == 0, result.stderr
    return result.stdout


def parse_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """A systemd unit as {section: [(key, value), ...]} (keys may repeat)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for number, line in logical_lines(path.read_text()):
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        assert current is not None, f"{path.name}:{number}: setting outside a section"
        key, eq, value = line.partition("=")
        assert eq and re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", key.strip()), f"{path.name}:{number}: {line!r}"
        current.append((key.strip(), value.strip()))
    return sections


def unit_values(unit: dict, section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def etcd_dropin_invocation() -> Invocation:
    """The rdzv-server flags that etcd-tls.conf.example adds (its RDZV_SERVER_ARGS)."""
    (environment,) = unit_values(parse_unit(ETCD_DROPIN), "Service", "Environment")
    name, _, args = shlex.split(environment)[0].partition("=")
    assert name == "RDZV_SERVER_ARGS"
    return parse_invocation(ETCD_DROPIN.name, "rdzv-server", shlex.split(args))


def wait_healthy(url: str, timeout: float = 10) -> None:
    import time
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
