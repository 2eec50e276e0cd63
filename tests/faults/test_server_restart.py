"""The server dies (kill -9) and comes back with the same flags; or it cannot
use its data dir at all.

The contract (docs/design.md, "While a round runs"): state lives in SQLite under
--data-dir and is written before anyone hears of a change; agents reconnect
with backoff and resume their round; workers keep running meanwhile; after a
restart every node gets a full heartbeat timeout to come back. A data dir the
server cannot use makes it refuse to start, saying why, touching nothing; a
write that fails (disk full) refuses the change and keeps the saved state.

Workers run scripts/ranks.py: one gloo all_reduce per tick, printing
``tick round R rank r node N pid P step S world W``, until the test creates
the stop file.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.cluster import FaultCluster, Ticks
from tests.helpers.procs import descendants, free_port, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HB_TIMEOUT = 3.0  # --heartbeat-timeout of every agent here: the grace a restarted server gives
AGENT_FLAGS = ("--heartbeat-timeout", f"{HB_TIMEOUT:g}")


def _ticking(agents, round_no: int | None, world: int, step: int, timeout: float = 60.0) -> None:
    """Every agent's worker reached ``step`` of round ``round_no`` (None: any round) with ``world`` ranks."""
    wait_until(
        lambda: all(
            any(round_no in (None, t.round) and t.world == world and t.step >= step for t in Ticks.of(a))
            for a in agents
        ),
        timeout,
        f"every worker at step {step} of round {round_no} with world {world}",
    )


def _ranks(view: dict) -> dict[str, int]:
    return {n["node_id"]: n["group_rank"] for n in view["nodes"]}


@pytest.mark.timeout(120)
def test_kill9_mid_run_the_job_comes_back_and_workers_never_restart(fcluster: FaultCluster, tmp_path: Path) -> None:
    """3 agents train; the server is SIGKILLed and started again with the same
    --port and --data-dir. While it is gone the workers keep stepping; when it
    is back the job is the same (round 0, same ranks, same master), every agent
    has resumed it, no node is evicted during or after the grace, no worker was
    restarted (same pids, only round 0 ever), and the job succeeds."""
    port, data = free_port(), tmp_path / "data"
    server = fcluster.start_server_at(port, data, name="server")
    stop = tmp_path / "stop"
    agents = [
        fcluster.start_ranks_agent(
            server.endpoint, "restart", f"n{i}", stop, nnodes="3", interval=0.05, flags=AGENT_FLAGS
        )
        for i in range(3)
    ]
    _ticking(agents, 0, 3, step=3)
    before = server.job("restart")
    assert (before["state"], before["round"]) == ("running", 0), before

    fcluster.kill9(server)
    at_kill = {a.name: Ticks.last_step(a) for a in agents}
    # no server: the workers do not need it
    wait_until(
        lambda: all(Ticks.last_step(a) >= at_kill[a.name] + 15 for a in agents),
        30,
        "15 more steps on every node while the server is dead",
    )
    # The notice comes 2 s into the outage; it says "not serving this node" when
    # what answers on the port is not our server (on a shared machine another
    # process may take the freed port for a while).
    try:
        wait_until(
            lambda: all(re.search(r"server (unreachable|not serving this node) for", a.text()) for a in agents),
            30,
            "every agent saying the server is out",
        )
    except AssertionError as e:
        said = {a.name: [ln for ln in a.text().splitlines() if ln.startswith("[rdzv-agent")][-4:] for a in agents}
        raise AssertionError(f"{e}; the agents' last lines: {said}") from None

    server = fcluster.start_server_at(port, data, name="server-restarted")
    restarted = time.monotonic()
    back = server.wait_job(
        "restart",
        lambda v: len(v["nodes"]) == 3 and all(n["state"] == "running" for n in v["nodes"]),
        HB_TIMEOUT + 6,
        "every node reconnected to the restarted server",
    )
    assert back["round"] == 0 and back["restarts"] == 0, back
    assert _ranks(back) == _ranks(before), (before["nodes"], back["nodes"])
    assert (back["master_addr"], back["master_port"]) == (before["master_addr"], before["master_port"])
    assert [h["round"] for h in back["history"]] == [0], back["history"]
    assert "loaded 1 job(s)" in server.text(), server.text()[-2000:]
    for a in agents:
        assert "reconnected" in a.text(), a.text()[-2000:]

    # Watch past the grace a restarted server gives (one heartbeat timeout):
    # nobody is evicted, the round stays 0, everyone keeps training.
    views = []
    at_restart = {a.name: Ticks.last_step(a) for a in agents}
    wait_until(
        lambda: views.append(server.job("restart")) or time.monotonic() - restarted > 1.5 * HB_TIMEOUT,
        4 * HB_TIMEOUT,
        "1.5 heartbeat timeouts after the restart",
        interval=0.2,
    )
    for v in views:
        assert (v["state"], v["round"], _ranks(v)) == ("running", 0, _ranks(before)), v
    assert all(Ticks.last_step(a) > at_restart[a.name] for a in agents)

    stop.touch()
    for a in agents:
        assert a.wait_exit(40) == 0, a.text()[-3000:]
    done = server.job("restart")
    assert (done["state"], done["round"], done["restarts"]) == ("succeeded", 0, 0), done
    for a in agents:
        ticks = Ticks.of(a)
        assert {t.round for t in ticks} == {0}, f"{a.name} ran a round other than 0"
        assert len({t.pid for t in ticks}) == 1, f"{a.name}'s worker was restarted: pids { ({t.pid for t in ticks}) }"
        steps = [t.step for t in ticks]
        assert steps == list(range(1, len(steps) + 1)), f"{a.name}'s worker skipped or repeated steps"
        assert "evicted" not in a.text() and "stopping workers" not in a.text(), a.text()[-3000:]


@pytest.mark.timeout(90)
def test_kill9_while_a_round_forms_the_round_completes_after_restart(fcluster: FaultCluster, tmp_path: Path) -> None:
    """1 of 2 agents has joined when the server is SIGKILLed. Started again, the
    server knows that node (saved at its join), the agent reconnects as the
    same node, the 2nd agent joins, round 0 completes and the job succeeds."""
    port, data = free_port(), tmp_path / "data"
    server = fcluster.start_server_at(port, data, name="server")
    stop = tmp_path / "stop"
    first = fcluster.start_ranks_agent(server.endpoint, "forming", "n0", stop, nnodes="2", flags=AGENT_FLAGS)
    view = server.wait_job("forming", lambda v: len(v["nodes"]) == 1, 30, "the first node joined")
    first_id = view["nodes"][0]["node_id"]
    assert (view["state"], view["round"]) == ("waiting", 0), view

    fcluster.kill9(server)
    server = fcluster.start_server_at(port, data, name="server-restarted")
    view = server.job("forming")
    assert view is not None, "the restarted server forgot the job"
    assert (view["state"], view["round"], [n["node_id"] for n in view["nodes"]]) == ("waiting", 0, [first_id]), view
    server.wait_job(
        "forming",
        lambda v: v["nodes"] and v["nodes"][0]["state"] == "waiting",
        HB_TIMEOUT + 5,
        "the first agent back as the same, waiting node",
    )

    second = fcluster.start_ranks_agent(server.endpoint, "forming", "n1", stop, nnodes="2", flags=AGENT_FLAGS)
    _ticking([first, second], 0, 2, step=2)
    view = server.job("forming")
    assert (view["state"], view["round"]) == ("running", 0), view
    assert first_id in _ranks(view), view
    stop.touch()
    for a in (first, second):
        assert a.wait_exit(40) == 0, a.text()[-3000:]
        assert "evicted" not in a.text(), a.text()[-3000:]
    assert server.job("forming")["state"] == "succeeded"


@pytest.mark.timeout(90)
def test_node_restored_disconnected_gets_its_assignment(fcluster: FaultCluster, tmp_path: Path) -> None:
    """1 of 2 agents has joined; the server is SIGKILLed and restarted, and the
    2nd agent joins before the 1st has reconnected (the 1st is held with
    SIGSTOP to make that order certain). The round completes at once (the
    restored node counts); when the 1st agent reconnects it must get its
    assignment, and the job must run and succeed."""
    port, data = free_port(), tmp_path / "data"
    server = fcluster.start_server_at(port, data, name="server")
    stop = tmp_path / "stop"
    first = fcluster.start_ranks_agent(server.endpoint, "late", "n0", stop, nnodes="2", flags=AGENT_FLAGS)
    server.wait_job("late", lambda v: len(v["nodes"]) == 1, 30, "the first node joined")
    os.kill(first.pid, signal.SIGSTOP)
    try:
        fcluster.kill9(server)
        server = fcluster.start_server_at(port, data, name="server-restarted")
        second = fcluster.start_ranks_agent(server.endpoint, "late", "n1", stop, nnodes="2", flags=AGENT_FLAGS)
        server.wait_job("late", lambda v: v["state"] == "running", 30, "round 0 complete")
    finally:
        os.kill(first.pid, signal.SIGCONT)
    _ticking([first, second], None, 2, step=2, timeout=HB_TIMEOUT + 9)
    stop.touch()
    for a in (first, second):
        assert a.wait_exit(40) == 0, a.text()[-3000:]


@pytest.mark.timeout(90)
def test_worker_failure_right_after_restart_does_not_evict_nodes_still_reconnecting(
    fcluster: FaultCluster, tmp_path: Path
) -> None:
    """3 agents train (heartbeat timeout 10 s). The server is SIGKILLed and
    restarted while one agent is held (SIGSTOP), so it has not reconnected
    when a worker of another node is SIGKILLed. The held node is alive and
    within the grace a restart gives: the failure must be charged (round 1
    'worker failure', restarts 1) and the held node, continued, must rejoin
    round 1 as the same node, never evicted."""
    port, data = free_port(), tmp_path / "data"
    server = fcluster.start_server_at(port, data, name="server")
    stop = tmp_path / "stop"
    agents = [
        fcluster.start_ranks_agent(
            server.endpoint, "echo", f"n{i}", stop, nnodes="2:3", interval=0.05, flags=("--heartbeat-timeout", "10")
        )
        for i in range(3)
    ]
    _ticking(agents, 0, 3, step=3)
    ids = [a.wait_log(r"node (\S+): joining", 5)[0].group(1) for a in agents]
    failing, held = agents[0], agents[2]
    os.kill(held.pid, signal.SIGSTOP)
    try:
        fcluster.kill9(server)
        server = fcluster.start_server_at(port, data, name="server-restarted")
        server.wait_job(
            "echo",
            lambda v: (
                {n["node_id"]: n["state"] for n in v["nodes"]}.get(ids[0]) == "running"
                and {n["node_id"]: n["state"] for n in v["nodes"]}.get(ids[1]) == "running"
            ),
            10,
            "the two running agents reconnected",
        )
        os.kill(descendants(failing.pid)[0], signal.SIGKILL)
        opened = server.wait_job("echo", lambda v: v["round"] >= 1, 15, "round 1 opened")
    finally:
        os.kill(held.pid, signal.SIGCONT)
    view = server.wait_job("echo", lambda v: v["round"] >= 1 and v["state"] == "running", 30, "round 1 running")
    assert "worker failure" in opened["history"][1]["reason"], opened["history"][1]
    assert view["restarts"] == 1 and view["round"] == 1, view
    assert ids[2] in _ranks(view), f"the held node was replaced: {view['nodes']}"
    assert "evicted" not in held.text(), held.text()[-2000:]


# ------------------------------------------------------------------ refusals


def _digest(path: Path) -> dict[str, str]:
    # rdzv.lock is the server's lock on the dir (it holds a pid), not state
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.iterdir())
        if p.is_file() and p.name != "rdzv.lock"
    }


@pytest.mark.timeout(60)
def test_corrupt_database_refuses_to_start_and_is_left_alone(fcluster: FaultCluster, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "rdzv.db").write_bytes(random.Random(7).randbytes(16384))
    before = _digest(data)
    r = fcluster.run_server("--host", "127.0.0.1", "--port", str(free_port()), "--data-dir", str(data))
    assert r.returncode != 0, r
    assert "refusing to start" in r.stderr and str(data / "rdzv.db") in r.stderr, r.stderr
    assert re.search(r"corrupt|not a database", r.stderr), r.stderr
    assert "move it away" in r.stderr, r.stderr  # says what to do
    assert "Traceback" not in r.stderr, r.stderr
    assert _digest(data) == before, "the corrupt database (or its directory) was changed"


@pytest.mark.timeout(60)
def test_data_dir_that_cannot_be_created_refuses_to_start(fcluster: FaultCluster, tmp_path: Path) -> None:
    """--data-dir under a regular file: mkdir fails even for root."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    data = blocker / "sub"
    r = fcluster.run_server("--host", "127.0.0.1", "--port", str(free_port()), "--data-dir", str(data))
    assert r.returncode != 0, r
    assert "refusing to start" in r.stderr and "cannot create data dir" in r.stderr and str(data) in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert blocker.read_text() == "not a directory\n"


@pytest.mark.timeout(60)
def test_data_dir_without_write_permission_refuses_to_start(fcluster: FaultCluster, tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("running as root: chmod 500 does not stop root from writing (see the read-only mount test)")
    data = tmp_path / "data"
    data.mkdir()
    data.chmod(0o500)
    try:
        r = fcluster.run_server("--host", "127.0.0.1", "--port", str(free_port()), "--data-dir", str(data))
    finally:
        data.chmod(0o700)
    assert r.returncode != 0, r
    assert "refusing to start" in r.stderr and "not writable" in r.stderr, r.stderr
    assert list(data.iterdir()) == []


def _mount_tmpfs(where: Path, size: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        timeout=20,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")


def _umount(where: Path) -> None:
    subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=20)


@pytest.mark.timeout(60)
def test_read_only_data_dir_refuses_to_start_and_keeps_the_database(fcluster: FaultCluster, tmp_path: Path) -> None:
    """A data dir on a file system mounted read-only (binds root too): the
    server refuses to start, and the database in it stays as it was."""
    mnt = tmp_path / "ro"
    _mount_tmpfs(mnt, "4m")
    try:
        data = mnt / "data"
        port = free_port()
        server = fcluster.start_server_at(port, data, name="writer")  # creates rdzv.db
        fcluster.kill9(server)
        before = _digest(data)
        r = subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True, text=True, timeout=20)
        if r.returncode != 0:
            pytest.skip(f"cannot remount the tmpfs read-only: {r.stderr.strip()}")
        res = fcluster.run_server("--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data))
        assert res.returncode != 0, res
        assert "refusing to start" in res.stderr and str(data) in res.stderr, res.stderr
        assert "read-only file system" in res.stderr, res.stderr
        assert "Traceback" not in res.stderr, res.stderr
        assert _digest(data) == before
    finally:
        _umount(mnt)


@pytest.mark.timeout(60)
def test_full_disk_at_start_refuses_without_calling_the_database_corrupt(
    fcluster: FaultCluster, tmp_path: Path
) -> None:
    """The disk is full when the server starts over a good database: it refuses
    to start and says the file system refused, and does not tell the
    operator to move the database away (it is not damaged); the database is
    unchanged and a server started after space is freed loads it."""
    mnt = tmp_path / "small"
    _mount_tmpfs(mnt, "1m")
    try:
        port, data = free_port(), mnt / "data"
        # --min-free-disk 0: this test fills the disk itself (the check would refuse the job first)
        server = fcluster.start_server_at(port, data, "--min-free-disk", "0", name="writer")
        stop = tmp_path / "stop"
        agent = fcluster.start_ranks_agent(server.endpoint, "kept", "n0", stop, nnodes="2", flags=AGENT_FLAGS)
        server.wait_job("kept", lambda v: len(v["nodes"]) == 1, 30, "a job saved")
        fcluster.kill9(agent)
        os.kill(server.pid, signal.SIGTERM)  # a clean stop: sqlite removes its -wal and -shm files
        server.wait_exit(15)
        db = hashlib.sha256((data / "rdzv.db").read_bytes()).hexdigest()
        filler = _fill(mnt)
        res = fcluster.run_server("--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data))
        assert res.returncode != 0, res
        assert "refusing to start" in res.stderr and "0 bytes free" in res.stderr, res.stderr
        assert "corrupt" not in res.stderr and "move it away" not in res.stderr, res.stderr
        assert hashlib.sha256((data / "rdzv.db").read_bytes()).hexdigest() == db
        filler.unlink()
        server = fcluster.start_server_at(port, data, name="after")
        assert server.job("kept")["state"] == "waiting"
    finally:
        fcluster.close()
        _umount(mnt)


def _fill(where: Path) -> Path:
    """Fill the file system of ``where`` to the last byte; return the filler file."""
    filler = where / "filler"
    with open(filler, "wb", buffering=0) as f:
        for chunk in (1 << 16, 4096, 512, 1):
            while True:
                try:
                    f.write(b"\0" * chunk)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
    return filler


@pytest.mark.timeout(120)
def test_full_disk_refuses_the_change_and_keeps_the_saved_state(fcluster: FaultCluster, tmp_path: Path) -> None:
    """The data dir is on a tiny tmpfs. One agent has joined (saved). The disk
    fills up; a second agent joins, which would complete the round: the write
    fails, so the server refuses the change, says so, and the job stays as it
    was saved (waiting, one node; nobody ever runs). SIGKILL the server, free
    the disk, start it again: the saved job is back, the second agent (still
    retrying) gets in, and the job succeeds."""
    mnt = tmp_path / "small"
    _mount_tmpfs(mnt, "2m")
    try:
        port, data = free_port(), mnt / "data"
        # --min-free-disk 0: the change that fails is a round's, not a new job's (see tests/faults/test_growth.py)
        server = fcluster.start_server_at(port, data, "--min-free-disk", "0", name="server")
        stop = tmp_path / "stop"
        first = fcluster.start_ranks_agent(server.endpoint, "full", "n0", stop, nnodes="2", flags=AGENT_FLAGS)
        saved = server.wait_job("full", lambda v: len(v["nodes"]) == 1, 30, "the first node joined")
        first_id = saved["nodes"][0]["node_id"]
        filler = _fill(mnt)

        second = fcluster.start_ranks_agent(server.endpoint, "full", "n1", stop, nnodes="2", flags=AGENT_FLAGS)
        server.wait_log(r"cannot save state to .*rdzv\.db.*the change is refused", 30)
        views = []
        wait_until(
            lambda: views.append(server.job("full")) or len(views) >= 20,
            20,
            "views while the disk is full",
            interval=0.1,
        )
        assert all(v["state"] == "waiting" and v["round"] == 0 for v in views), [v["state"] for v in views]
        second.wait_log(r"unavailable.*cannot save state", 15)  # the refused agent is told why
        assert not Ticks.of(first, second), "a worker ran although the round could not be saved"
        assert first.popen.poll() is None and second.popen.poll() is None

        # The second agent waits (stopped) until the first is back: see
        # test_node_restored_disconnected_gets_its_assignment for what
        # happens when it is faster.
        os.kill(second.pid, signal.SIGSTOP)
        try:
            fcluster.kill9(server)
            filler.unlink()
            server = fcluster.start_server_at(port, data, "--min-free-disk", "0", name="server-restarted")
            view = server.wait_job(
                "full",
                lambda v: [n["state"] for n in v["nodes"]] == ["waiting"],
                HB_TIMEOUT + 5,
                "the saved node back and reconnected",
            )
            assert (view["round"], view["nodes"][0]["node_id"]) == (0, first_id), view
        finally:
            os.kill(second.pid, signal.SIGCONT)
        _ticking([first, second], 0, 2, step=2, timeout=60)
        view = server.job("full")
        assert (view["state"], view["round"]) == ("running", 0), view
        assert first_id in _ranks(view), "the node saved before the disk filled up was lost"
        stop.touch()
        for a in (first, second):
            assert a.wait_exit(40) == 0, a.text()[-3000:]
    finally:
        fcluster.close()  # nothing may hold files on the mount when it goes
        _umount(mnt)
