"""The SLURM batch script and the shell scripts: syntax (shellcheck when
present), the nodelist parser, and the sbatch flow with stub and real servers,
node failures and fast failures."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.deploy_files import (
    BASH,
    ENTRYPOINT,
    README,
    REPO,
    SBATCH,
    help_text,
    parse_invocation,
    run,
    wait_healthy,
    write_script,
)
from tests.helpers.procs import free_port


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
