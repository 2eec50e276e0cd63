"""Workers' output under rdzv-agent against stock torchrun on the same script
(issue 12 items 4 and 5): in a pseudo-terminal the workers see a terminal and
a tqdm bar arrives intact, with no ``[RANK]: `` prefix unless asked for; on a
failure under ``@record`` the agent prints torchrun's summary block with the
traceback from the error file, which stays under ``--log-dir``."""

from __future__ import annotations

import fcntl
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from tests.helpers.cluster import E2E_SCRIPTS, Cluster
from tests.helpers.procs import Proc

pytestmark = pytest.mark.e2e

SCRIPT = str(E2E_SCRIPTS / "tty_bar.py")
AGENT = [sys.executable, "-m", "rdzv_client.agent", "--standalone", "--nproc-per-node", "1"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
FRAME_RE = re.compile(r"^bar0: +(\d+)%\|[^|]*\| (\d+)/(\d+) \[[^\]]*\]$")


def run_in_pty(
    cluster: Cluster, name: str, argv: list[str], timeout: float = 90.0, env: dict[str, str] | None = None
) -> tuple[int, str]:
    """Run ``argv`` with a fresh pseudo-terminal (100x30) as its stdin, stdout
    and stderr, to its end; its exit status and everything it wrote there."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    log_path = cluster.tmp / f"{name}.log"
    try:
        popen = subprocess.Popen(
            argv, stdin=slave, stdout=slave, stderr=slave, env=cluster.env(env), cwd=cluster.tmp, start_new_session=True
        )
    finally:
        os.close(slave)
    cluster.procs.append(Proc(name, popen, log_path))  # teardown kills it and its workers
    out = bytearray()
    deadline = time.monotonic() + timeout
    exited_at: float | None = None
    try:
        with open(log_path, "wb") as log:
            while True:
                now = time.monotonic()
                if now > deadline:
                    raise AssertionError(f"{name} did not finish within {timeout:g}s:\n{out.decode(errors='replace')}")
                if popen.poll() is not None:
                    exited_at = exited_at or now
                    if now - exited_at > 10:  # something still holds the terminal
                        break
                ready, _, _ = select.select([master], [], [], 0.1)
                if not ready:
                    continue
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every end of the terminal is closed
                    data = b""
                if not data:
                    break
                out += data
                log.write(data)
                log.flush()
    finally:
        os.close(master)
    return popen.wait(10), out.decode(errors="replace").replace("\r\n", "\n")


def bar_frames(text: str) -> list[str]:
    """Every frame tqdm drew for rank 0: what lies between carriage returns and newlines."""
    return [seg for seg in re.split(r"[\r\n]", text) if "bar0" in seg]


def counts(frames: list[str]) -> list[int]:
    out = []
    for f in frames:
        m = FRAME_RE.match(f)
        assert m, f"a torn progress-bar frame: {f!r}"
        out.append(int(m.group(2)))
    return out


@pytest.mark.timeout(240)
def test_workers_get_the_terminal_and_tqdm_draws_as_under_torchrun(cluster: Cluster) -> None:
    """In a pty, a worker's stdout and stderr are terminals under rdzv-agent as
    under torchrun, no line gets a prefix, and tqdm's carriage-return frames
    arrive whole and the same ones as under torchrun."""
    rc, agent = run_in_pty(cluster, "agent-pty", [*AGENT, SCRIPT])
    assert rc == 0, agent
    rc_t, torchrun = run_in_pty(cluster, "torchrun-pty", [*TORCHRUN, SCRIPT])
    assert rc_t == 0, torchrun
    for text in (agent, torchrun):
        assert "isatty stdout=True stderr=True rank=0\n" in text, text
        assert "bar done rank=0\n" in text, text
    assert "[0]:" not in agent, agent
    agent_counts, torchrun_counts = counts(bar_frames(agent)), counts(bar_frames(torchrun))
    assert agent_counts == torchrun_counts, (agent, torchrun)
    assert agent_counts[0] == 0 and agent_counts[-1] == 8 and set(agent_counts) == set(range(9)), agent_counts


@pytest.mark.timeout(120)
def test_line_prefix_copies_output_with_rank_prefixes(cluster: Cluster) -> None:
    """--line-prefix: output goes through the agent, every line prefixed with
    ``[RANK]: `` (workers then write to pipes, not the terminal), or with
    torchrun's ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``."""
    rc, agent = run_in_pty(cluster, "agent-prefix", [*AGENT, "--line-prefix", SCRIPT, "--steps", "2"])
    assert rc == 0, agent
    assert "[0]: isatty stdout=False stderr=False rank=0\n" in agent, agent
    assert "[0]: bar done rank=0\n" in agent, agent
    # torchrun's template for prefixed lines
    template = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "<${role_name}:${rank}/${local_rank}> "}
    rc, agent = run_in_pty(cluster, "agent-template", [*AGENT, "--line-prefix", SCRIPT, "--steps", "2"], env=template)
    assert rc == 0, agent
    assert "<default:0/0> bar done rank=0\n" in agent, agent


BLOCK_RE = re.compile(
    r"^(?P<border>=+)\n(?P<title>\S+ FAILED)\n-+\nFailures:\n(?P<others>.*?)\n-+\n"
    r"Root Cause \(first observed failure\):\n(?P<root>\[0\]:\n.*?)\n(?P=border)$",
    re.S | re.M,
)
FIELD_RE = re.compile(r"^  (time|host|rank|exitcode|error_file|traceback)\s*: ?(.*)$")


def summary(text: str) -> dict[str, str]:
    """torchrun's failure summary block in ``text``, as its fields."""
    m = BLOCK_RE.search(text)
    assert m, f"no failure summary block in:\n{text[-4000:]}"
    fields = {"title": m["title"], "others": m["others"], "border": m["border"]}
    key = ""
    for line in m["root"].splitlines()[1:]:
        f = FIELD_RE.match(line)
        if f and key != "traceback":
            key = f.group(1)
            fields[key] = f.group(2)
        else:
            fields[key] += "\n" + line
    return fields


@pytest.mark.timeout(240)
def test_a_failure_prints_torchruns_summary_block_and_keeps_the_error_file(cluster: Cluster) -> None:
    """A worker raising under @record: the agent prints torchrun's summary
    block (root cause, rank, host, time, exit code, error file, traceback from
    the error file), field for field as torchrun does on the same script; the
    error file stays under --log-dir and its path is printed."""
    agent_logs, torchrun_logs = cluster.tmp / "agent-logs", cluster.tmp / "torchrun-logs"
    flags = ["--max-restarts", "0"]
    agent = cluster.start(
        "agent-fail", [*AGENT, *flags, "--log-dir", str(agent_logs), SCRIPT, "--steps", "1", "--fail"]
    )
    assert agent.wait_exit(90) == 1, agent.text()
    torchrun = cluster.start(
        "torchrun-fail", [*TORCHRUN, *flags, "--log-dir", str(torchrun_logs), SCRIPT, "--steps", "1", "--fail"]
    )
    assert torchrun.wait_exit(90) == 1, torchrun.text()
    ours, theirs = summary(agent.text()), summary(torchrun.text())
    for key in ("border", "title", "others", "host", "rank"):
        assert ours[key] == theirs[key], (key, ours, theirs)
    assert ours["traceback"] == theirs["traceback"], (ours, theirs)
    assert "ValueError: tty_bar failed on rank 0" in ours["traceback"]
    assert re.fullmatch(r"1 \(pid: \d+\) ", ours["exitcode"]) and re.fullmatch(r"1 \(pid: \d+\) ", theirs["exitcode"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d:\d\d:\d\d", ours["time"]), ours
    error_file = Path(ours["error_file"])
    assert error_file.is_file() and error_file.is_relative_to(agent_logs), ours
    assert "tty_bar failed on rank 0" in error_file.read_text()
    assert Path(theirs["error_file"]).is_file()
    # torchrun's layout, LOG_DIR/<run id>_<random>/attempt_N/LOCAL_RANK/error.json: a re-run never replaces it
    ours_rel, theirs_rel = error_file.relative_to(agent_logs), Path(theirs["error_file"]).relative_to(torchrun_logs)
    assert ours_rel.parts[1:] == theirs_rel.parts[1:] == ("attempt_0", "0", "error.json"), (ours_rel, theirs_rel)
    assert ours_rel.parts[0].startswith("standalone_"), ours_rel
