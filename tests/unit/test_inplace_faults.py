"""Faults around in-place DDP (issue 20): a rank waiting on a frozen peer is
not hung; what the worker tells its agent while it waits."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

WAITS = r"""
import time
from rdzv_client import worker
worker.waiting()  # before any progress(): never watched, nothing to say
worker.progress(5)
time.sleep(0.1)
worker.waiting()  # blocked in a collective of the library: alive, still at step 5
time.sleep(0.1)
worker.waiting()
print("ok")
"""


def _run(code: str, tmp_path: Path, mode: str, *argv: str) -> tuple[subprocess.CompletedProcess[str], list[bytes]]:
    agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    agent.bind(str(tmp_path / "sock"))
    agent.setblocking(False)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RDZV_", "TORCHELASTIC_"))}
    env.update(PYTHONPATH=str(ROOT), RDZV_AGENT_SOCKET=str(tmp_path / "sock"), RDZV_RESTART_MODE=mode)
    env.update(LOCAL_RANK="0", TORCHELASTIC_RESTART_COUNT="3")
    try:
        res = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=60)
        got = []
        while True:
            try:
                got.append(agent.recv(4096))
            except BlockingIOError:
                return res, got
    finally:
        agent.close()


@pytest.mark.parametrize("mode", ["in-place", "process"])
def test_a_rank_waiting_on_its_peers_tells_its_agent_it_is_alive_in_place_mode(tmp_path: Path, mode: str) -> None:
    """``worker.waiting()`` (what the library's waits call in slices) re-sends
    the last step in in-place mode: the agent's hang watch sees the rank alive
    while a frozen peer holds the collective, and judges only the frozen one.
    Outside in-place mode it says nothing (a collective that never completes
    is a hang there, as before)."""
    res, got = _run(WAITS, tmp_path, mode)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
    assert got == [b"3 0 5"] * (3 if mode == "in-place" else 1) + [b"3 0 end"], got  # end: finished() at exit


BLOCKED = r"""
import os, sys, time
from rdzv_client import worker
gen = worker.rounds()
next(gen)
worker.progress(1)

def stuck_in_user_code():
    time.sleep(30)  # outside the library: nothing checks the agent's word

print("ready", flush=True)
stuck_in_user_code()
"""


def test_an_escalated_worker_says_which_call_it_is_blocked_in(tmp_path: Path) -> None:
    """The agent's ``where`` (sent when --in-place-timeout runs out) is answered
    by the worker's channel thread with its main thread's innermost frames,
    however the main thread is blocked; the agent's channel keeps the answer
    for the escalation's log line, and SIGUSR1 (sent with it) dumps every
    thread's stack into the worker's stderr."""
    import asyncio
    import signal

    from rdzv_client.channel import WorkerChannel
    from rdzv_client.watch import WorkerWatch

    class Group:
        def __init__(self, pids: list[int]) -> None:
            self.pids = pids

    ch = WorkerChannel(nproc=1, dir=tmp_path)
    watch = WorkerWatch.__new__(WorkerWatch)
    watch.channel = ch

    async def run() -> tuple[str, str]:
        await ch.start()
        ch.new_round(0)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RDZV_", "TORCHELASTIC_"))}
        env.update(PYTHONPATH=str(ROOT), RDZV_AGENT_SOCKET=ch.path, RDZV_RESTART_MODE="in-place")
        env.update(LOCAL_RANK="0", TORCHELASTIC_RESTART_COUNT="0", RDZV_AGENT_PID=str(os.getpid()))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", BLOCKED, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        try:
            assert proc.stdout is not None and proc.stderr is not None
            assert (await asyncio.wait_for(proc.stdout.readline(), 30)).strip() == b"ready"
            await asyncio.sleep(0.2)  # into the sleep
            said = await watch.where(Group([proc.pid]), 1, [0])  # type: ignore[arg-type]
            await asyncio.sleep(0.3)  # faulthandler's dump
            proc.send_signal(signal.SIGKILL)
            _, err = await asyncio.wait_for(proc.communicate(), 30)
            return said, err.decode()
        finally:
            if proc.returncode is None:
                proc.kill()
            ch.close()

    said, err = asyncio.run(run())
    assert said.startswith("local rank 0 blocked in <string>:9 in stuck_in_user_code <- <string>:12 in <module>"), said
    assert "in stuck_in_user_code" in err and "most recent call first" in err, err


def test_a_where_answer_is_bounded_and_a_stale_or_foreign_one_dropped() -> None:
    from rdzv_client.channel import WorkerChannel
    from rdzv_client.where import MAX_WHERE

    ch = WorkerChannel(nproc=2)
    try:
        ch.new_round(4)
        ch.received(b"4 1 where a.py:3 in f <- b.py:9 in \x1b[2Jg", 0.0)
        assert ch.where == {1: "a.py:3 in f <- b.py:9 in \\x1b[2Jg"}  # escaped: one log line, no cursor moves
        ch.received(b"5 0 where x.py:1 in h", 0.0)  # a round not run yet
        ch.received(b"4 2 where x.py:1 in h", 0.0)  # no such local rank
        ch.received(b"4 0 where " + b"x" * (MAX_WHERE + 64), 0.0)  # too long
        assert set(ch.where) == {1} and ch.dropped == 3
        ch.new_round(5)
        assert ch.where == {}
    finally:
        ch.close()


FAULTS = r"""
import os, signal, socket, subprocess, sys, threading, time
os.environ["RDZV_AGENT_PID"] = str(os.getpid())  # this process plays its own agent (before the import)
os.environ["TORCHELASTIC_RESTART_COUNT"] = "0"
import torch
from torch import nn
from rdzv_client import inplace, worker
from rdzv_client.worker import MembershipChanged, World

gen = worker.rounds()
next(gen)
inbox = os.path.join(os.path.dirname(os.environ["RDZV_AGENT_SOCKET"]), "w0")
agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

def world(rnd, rank, port):
    return World(round=rnd, rank=rank, world_size=2, local_rank=0, local_world_size=1, group_rank=rank,
                 group_world_size=2, master_addr="127.0.0.1", master_port=port, fresh=False)

def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close(); return port

def word(rnd, after=0.3):
    threading.Timer(after, agent.sendto, args=(f"stop {rnd}".encode(), inbox)).start()

def next_round(rnd):
    agent.sendto(f"assign {rnd} RANK=0 WORLD_SIZE=2".encode(), inbox)
    assert next(gen).round == rnd

case = sys.argv[1]
if case == "forming":
    # round 0's peer never comes (its node was lost as the round formed); the next round change
    # must end the formation now, not after the group's timeout (which is past --in-place-timeout)
    word(1)
    try:
        inplace.process_group(world(0, 0, free_port()), timeout_s=40)
        print("formed")
    except MembershipChanged as e:
        print("raised", e)
elif case == "sync":
    # both ranks form the group; rank 1 never enters sync_state (a second round change under way)
    port, out, release = free_port(), {}, threading.Event()
    def rank(r):
        pg = inplace.process_group(world(0, r, port), timeout_s=40)
        if r == 1:
            release.wait(40)
            return
        m = nn.Linear(4, 2)
        word(1)
        try:
            inplace.sync_state(pg, world(0, 0, port), m, torch.optim.SGD(m.parameters(), lr=0.1), 3)
            out["r"] = "synced"
        except MembershipChanged as e:
            out["r"] = f"raised {e}"
        release.set()
    ts = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    print(out.get("r"))
elif case == "ddp-silent":
    # rank 1 formed the group and went silent (frozen) before DDP's construction: the agent's
    # word (the frozen rank's node was judged hung) ends rank 0's inplace.ddp() in place
    port, out, release = free_port(), {}, threading.Event()
    def rank(r):
        pg = inplace.process_group(world(0, r, port), timeout_s=40)
        if r == 1:
            release.wait(40)
            return
        word(1)
        try:
            inplace.ddp(nn.Linear(4, 2), pg)
            out["r"] = "constructed"
        except MembershipChanged as e:
            out["r"] = f"raised {e}"
        release.set()
    ts = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    print(out.get("r"))
elif case == "ddp-kill":
    # rank 1 (a process of its own) forms the group and is SIGKILLed before DDP's construction
    # broadcast: rank 0's construction fails on the dead peer and says so as MembershipChanged
    port = free_port()
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(port)], env={**os.environ, "RDZV_AGENT_SOCKET": ""})
    pg = inplace.process_group(world(0, 0, port), timeout_s=40)
    peer.wait(40)
    try:
        inplace.ddp(nn.Linear(4, 2), pg)
        print("constructed")
    except MembershipChanged as e:
        print("raised", str(e)[:60])
os._exit(0)
"""

PEER = r"""
import os, signal, sys
from rdzv_client import inplace
from rdzv_client.worker import World
w = World(round=0, rank=1, world_size=2, local_rank=0, local_world_size=1, group_rank=1, group_world_size=2,
          master_addr="127.0.0.1", master_port=int(sys.argv[1]), fresh=False)
inplace.process_group(w, timeout_s=40)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _fault(case: str, tmp_path: Path) -> str:
    code = FAULTS.replace("PEER, ", repr(PEER) + ", ")
    res, _ = _run(code, tmp_path, "in-place", case)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return res.stdout.strip().splitlines()[-1]


def test_a_round_change_while_the_group_forms_ends_the_formation_at_once(tmp_path: Path) -> None:
    """A peer lost as the round forms (it never checks in): ProcessGroupGloo's
    constructor would wait in C++ for its address until the group's timeout,
    past --in-place-timeout, and the survivor would be escalated (restarted).
    Every rank checks in on the store first, waiting in slices that take the
    agent's word: the next round change raises MembershipChanged now."""
    assert _fault("forming", tmp_path) == "raised round 1 replaces round 0"


def test_a_round_change_during_sync_state_raises_membership_changed(tmp_path: Path) -> None:
    """A peer that formed the group but never joins sync_state's collectives
    (a second round change under way): the agent's word ends sync_state."""
    assert _fault("sync", tmp_path) == "raised round 1 replaces round 0"


def test_a_round_change_while_a_peer_is_silent_before_ddp_construction_ends_it(tmp_path: Path) -> None:
    """A peer frozen before DDP's construction (whose parameter check and
    broadcast wait in C++ until the group's timeout, past --in-place-timeout):
    inplace.ddp() first meets every rank in a sliced all-reduce, so the
    agent's word ends it with MembershipChanged and the rank stays in place."""
    assert _fault("ddp-silent", tmp_path) == "raised round 1 replaces round 0"


def test_a_peer_killed_before_ddp_construction_fails_it_as_membership_changed(tmp_path: Path) -> None:
    """DDP's construction (parameter check, broadcast) is a blocking C++
    collective: a dead peer fails it at once, and inplace.ddp says so as
    MembershipChanged (never a hang; a silent peer is the escalation's)."""
    said = _fault("ddp-kill", tmp_path)
    assert said.startswith("raised a collective failed: [") and "gloo" in said, said


RAISES = r"""
import os, socket, sys
os.environ["RDZV_AGENT_PID"] = str(os.getpid())
os.environ["TORCHELASTIC_RESTART_COUNT"] = "0"
import torch
from torch import nn
from rdzv_client import inplace, worker

s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
model = nn.Linear(4, 2)
for world in worker.rounds():
    with inplace.group(world) as pg:
        ddp = inplace.ddp(model, pg)
        ddp(torch.randn(3, 4)).sum().backward()
        print("stepped", flush=True)
        raise ValueError("the script's own bug")
print("went on to the next round")
"""


def test_a_worker_that_raises_its_own_error_fails_as_in_process_mode(tmp_path: Path) -> None:
    """An exception of the script's own inside ``with inplace.group()`` (DDP
    made, a step taken) is not a changed membership: it is not swallowed, the
    process exits 1 at once with the traceback (the agent reports a failure,
    charged as in process mode) and never parks for a next round."""
    res, got = _run(RAISES, tmp_path, "in-place")
    assert res.returncode == 1, res.stdout + res.stderr[-3000:]
    assert res.stdout.strip() == "stepped", res.stdout
    assert "ValueError: the script's own bug" in res.stderr, res.stderr[-3000:]
    assert not any(d.endswith(b"parked") for d in got), got
