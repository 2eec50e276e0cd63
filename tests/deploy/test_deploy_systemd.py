"""The systemd units and their environment files (SQLite and etcd servers):
the settings that make them work and the hardening, checked by systemd-analyze
when present."""

from __future__ import annotations

import configparser
import re
import shlex
import shutil
from pathlib import Path

import pytest

from tests.deploy.deploy_files import (
    CONTRACT_FLAGS,
    DATA_DIR,
    ENV_ETCD_EXAMPLE,
    ENV_EXAMPLE,
    ETCD_DROPIN,
    PORT,
    README,
    UNIT,
    UNIT_ETCD,
    etcd_dropin_invocation,
    invocations_in_tokens,
    parse_unit,
    run,
    unit_values,
)


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
