"""Failures that do not crash (issue 15): hung workers and torch's FileTimer,
with real agents, a real server and real gloo workers.

No timed assertions: every wait has a generous deadline; what is checked is
that the hang is detected, the stacks are in the node's log, the failure is
reported as a hang, and the next round runs to the end.
"""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.request

from tests.helpers.cluster import E2E_SCRIPTS as SCRIPTS
from tests.helpers.cluster import Cluster
from tests.helpers.procs import wait_until

SCRIPT = SCRIPTS / "progress_loop.py"
ALL_REDUCE_LINE = next(i for i, line in enumerate(SCRIPT.read_text().splitlines(), 1) if "ALL_REDUCE_LINE" in line)
# faulthandler's frame line for the worker blocked in the step's all_reduce
BLOCKED_FRAME = rf'File "[^"]*progress_loop\.py", line {ALL_REDUCE_LINE} in main'


def _history_reasons(view: dict) -> str:
    return "\n".join(r["reason"] for r in view["history"])


def test_a_stopped_worker_is_detected_its_stack_logged_and_the_next_round_runs(cluster: Cluster) -> None:
    server = cluster.start_server()
    agent = cluster.start_agent(
        server,
        "hang1",
        SCRIPT,
        "--steps",
        "15",
        "--stop-self-at",
        "5",
        nnodes="1",
        flags=("--hang-timeout", "5", "--max-restarts", "2"),
    )
    assert agent.wait_exit(90) == 0, agent.text()[-3000:]
    text = agent.text()
    # detected, as a hang, with the step it stopped after
    assert re.search(
        r"local rank 0 \(rank 0\) pid \d+ hung: no progress\(\) for [\d.]+s \(hang timeout 5s\) "
        r"on host \S+, last step 5",
        text,
    ), text[-3000:]
    # the stopped worker's stack (it writes it once it gets SIGCONT), before round 1
    hang_at = text.index(" hung: ")
    round1_at = text.index("round 1: group rank")
    assert hang_at < round1_at
    dump = text[hang_at:round1_at]
    assert "most recent call first" in dump and "progress_loop.py" in dump, dump[-3000:]
    # the next round ran to the end
    assert "[0]: done rank 0 world 1 restart 1" in text
    view = server.job("hang1")
    assert view["state"] == "succeeded" and view["restarts"] == 1, view
    assert re.search(r"rank 0 \(local rank 0, pid \d+\) hung after step 5", _history_reasons(view)), view["history"]


def test_a_frozen_peer_leaves_the_other_blocked_in_all_reduce_both_detected(cluster: Cluster) -> None:
    server = cluster.start_server()
    # Rank 1 freezes for good (--stay-stopped): its agent's SIGCONT, sent for the stack
    # dump, does not thaw it and its SIGTERM does not end it, so rank 0 stays blocked
    # however late its own agent looks (on a loaded machine it may look seconds after
    # rank 1's agent acted). The test ends the frozen process once both agents said
    # their rank hung; --stop-timeout is only the backstop of rank 1's agent.
    flags = ("--hang-timeout", "6", "--max-restarts", "4", "--stop-timeout", "60")
    args = ("--steps", "20", "--stop-self-at", "5", "--stop-rank", "1", "--stay-stopped")
    agents = [cluster.start_agent(server, "hang2", SCRIPT, *args, nnodes="2", flags=flags) for _ in range(2)]

    def hung(rank: int) -> re.Match[str] | None:
        rx = re.compile(rf"local rank 0 \(rank {rank}\) pid (\d+) hung: ")
        return next((m for m in (rx.search(a.text()) for a in agents) if m), None)

    frozen = wait_until(lambda: hung(1), 90, "rank 1's agent saying its frozen rank hung")
    wait_until(lambda: hung(0), 60, "rank 0's agent saying its rank hung too, blocked in all_reduce")
    os.kill(int(frozen.group(1)), signal.SIGKILL)  # the frozen process ends at last: its agent's stop returns
    for a in agents:
        assert a.wait_exit(110) == 0, a.text()[-3000:]
    texts = [a.text() for a in agents]
    # which agent ran rank 0 in round 0
    r0 = next(t for t in texts if re.search(r"round 0: group rank 0 of 2", t))
    r1 = next(t for t in texts if t is not r0)
    # the healthy rank is hung too: blocked in the all_reduce its frozen peer never joins
    assert re.search(r"local rank 0 \(rank 0\) pid \d+ hung: .* last step 5", r0), r0[-3000:]
    assert re.search(BLOCKED_FRAME, r0[r0.index(" hung: ") :]), r0[-4000:]
    assert re.search(r"local rank 0 \(rank 1\) pid \d+ hung: .* last step 5", r1), r1[-3000:]
    # training resumed: a later round ran every step on both ranks
    for t in texts:
        assert re.search(r"\]: done rank \d world 2 restart [1-9]", t), t[-2000:]
    view = server.job("hang2")
    assert view["state"] == "succeeded", view
    assert "hung after step 5" in _history_reasons(view), view["history"]


def test_an_agent_that_ran_late_does_not_call_its_stepping_worker_hung(cluster: Cluster) -> None:
    """The agent itself gets no CPU for longer than the hang timeout (a loaded
    machine; here SIGSTOP) while its worker keeps stepping: what the worker
    sent meanwhile counts, the worker is not hung and the job goes on."""
    server = cluster.start_server()
    agent = cluster.start_agent(
        server,
        "late",
        SCRIPT,
        "--steps",
        "100000",
        "--interval",
        "0.05",
        nnodes="1",
        # --heartbeat-timeout: the stall must not make the server drop the node
        flags=("--hang-timeout", "3", "--max-restarts", "0", "--heartbeat-timeout", "60"),
    )
    agent.wait_log(r"^\[0\]: step 10 rank 0 ", 90)
    os.kill(agent.pid, signal.SIGSTOP)
    try:
        time.sleep(5)  # the agent's stall, longer than the hang timeout (not a wait for a condition)
        # a stopped agent has nothing in flight: a higher step comes from a check after the stall
        before = server.job("late")["nodes"][0]["step"] or 0
    finally:
        os.kill(agent.pid, signal.SIGCONT)
    # the worker went on meanwhile; the agent's first check after the stall sends its
    # latest step, unless it calls the worker hung (then nothing is sent: it reports)
    view = server.wait_job(
        "late",
        lambda v: v["state"] != "running" or (bool(v["nodes"]) and (v["nodes"][0]["step"] or 0) > before),
        60,
        "the step sent after the agent's stall",
    )
    assert " hung: " not in agent.text(), agent.text()[-3000:]
    assert view["state"] == "running" and view["restarts"] == 0 and agent.popen.poll() is None, view
    server.close_job("late")
    assert agent.wait_exit(60) == 1


def test_torch_file_timer_expiry_kills_the_worker_and_counts_as_a_failure(cluster: Cluster) -> None:
    server = cluster.start_server()
    agent = cluster.start_agent(
        server,
        "ftimer",
        "file_timer.py",
        nnodes="1",
        flags=("--max-restarts", "2"),
        env={"TORCHELASTIC_ENABLE_FILE_TIMER": "1"},
    )
    assert agent.wait_exit(90) == 0, agent.text()[-3000:]
    text = agent.text()
    assert "torch elastic timer 'guarded_step' of worker pid" in text, text[-3000:]
    assert "was killed by SIGKILL (torch elastic timer expired)" in text, text[-3000:]
    assert "out of memory?" not in text, text[-3000:]  # issue 25: the agent knows why it killed it
    assert "[0]: done restart 1" in text and "[0]: done restart 0" not in text
    view = server.job("ftimer")
    assert view["state"] == "succeeded" and view["restarts"] == 1, view
    assert "torch elastic timer expired" in _history_reasons(view), view["history"]


def test_agents_send_their_workers_progress_to_the_server(cluster: Cluster) -> None:
    server = cluster.start_server()
    agent = cluster.start_agent(server, "prog", SCRIPT, "--steps", "100000", "--interval", "0.05", nnodes="1")
    view = server.wait_job(
        "prog",
        lambda v: bool(v["nodes"]) and (v["nodes"][0]["step"] or 0) >= 3 and (v["nodes"][0]["steps_per_s"] or 0) > 0,
        90,
        "the node's progress in the job view",
    )
    node = view["nodes"][0]
    assert node["since_progress_s"] is not None and node["since_progress_s"] >= 0, node
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        metrics = r.read().decode()
    assert 'rdzv_job_since_progress_seconds{job_id="prog"}' in metrics
    # the step keeps advancing
    server.wait_job("prog", lambda v: (v["nodes"][0]["step"] or 0) > node["step"], 60, "a later step")
    server.close_job("prog")
    assert agent.wait_exit(60) == 1


def test_a_worker_that_exited_without_finished_is_not_hung(cluster: Cluster) -> None:
    server = cluster.start_server()
    agent = cluster.start_agent(
        server,
        "early",
        "progress_exit.py",
        "--seconds",  # rank 1 outlives rank 0's exit by over twice the hang timeout
        "7",
        nnodes="1",
        nproc=2,
        flags=("--hang-timeout", "3", "--max-restarts", "2"),
    )
    assert agent.wait_exit(90) == 0, agent.text()[-3000:]
    text = agent.text()
    assert " hung: " not in text, text[-3000:]
    assert "[1]: done local rank 1 restart 0" in text
    view = server.job("early")
    assert view["state"] == "succeeded" and view["restarts"] == 0, view


def test_forged_progress_from_another_process_does_not_hide_a_hang(cluster: Cluster) -> None:
    """A same-user process writes progress datagrams for the hung rank to the
    agent's socket (issue 19 item 9): the agent takes datagrams from its own
    workers only (the kernel's SO_PASSCRED), so the hang is still detected,
    and the forgeries are logged, rate-limited."""
    import socket
    import threading

    server = cluster.start_server()
    agent = cluster.start_agent(
        server,
        "forged",
        SCRIPTS / "progress_then_hang.py",
        nnodes="1",
        flags=("--hang-timeout", "4", "--max-restarts", "0"),
    )
    [m] = agent.wait_log(r"^\[0\]: socket (\S+)$", 60)
    path = m.group(1)
    stop = threading.Event()

    def forge() -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        step = 100
        while not stop.wait(0.2):
            step += 1
            try:
                s.sendto(f"0 0 {step}".encode(), path)
            except OSError:
                pass  # the agent is gone
        s.close()

    forger = threading.Thread(target=forge, daemon=True)
    forger.start()
    try:
        agent.wait_log(r"local rank 0 \(rank 0\) pid \d+ hung: no progress\(\) for [\d.]+s .*last step 3", 60)
    finally:
        stop.set()
        forger.join(5)
    assert agent.wait_exit(60) != 0
    said = re.findall(r"worker channel: ignored a datagram from pid \d+", agent.text())
    assert 1 <= len(said) <= 2, agent.text()[-3000:]
