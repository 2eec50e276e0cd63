"""The container image (Dockerfile, entrypoint) and compose: the dispatch, and
the per-run job id (next-job-id) against a real server."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.deploy.deploy_files import (
    COMPOSE,
    DATA_DIR,
    DEPLOY,
    DOCKERFILE,
    ENTRYPOINT,
    PORT,
    README,
    REPO,
    container_invocation,
    help_text,
    invocations_in_tokens,
    load_yaml,
    logical_lines,
    parse_invocation,
    run,
    shell_words,
    wait_healthy,
    write_script,
)
from tests.helpers.procs import free_port


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
