"""In-place re-formation's pieces without processes: the spec fields in job
records, the agent side of the worker channel (parked datagrams, messages to a
worker), and the worker side's reading of them (a real socket pair of the
channel's kind, in one process)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

import pytest

from rdzv_client.channel import WorkerChannel
from rdzv_common.protocol import JobSpec
from rdzv_server import rounds


def test_in_place_spec_fields_survive_a_record_and_are_left_out_at_defaults() -> None:
    job = rounds.new_job("j", JobSpec(min_nodes=1, max_nodes=2, restart_mode="in-place", in_place_timeout_s=3), 0.0)
    back = rounds.from_record(rounds.to_record(job))
    assert (back.spec.restart_mode, back.spec.in_place_timeout_s) == ("in-place", 3.0)
    plain = rounds.new_job("k", JobSpec(min_nodes=1, max_nodes=2), 0.0)
    rec = rounds.to_record(plain)
    assert not {"restart_mode", "in_place_timeout_s"} & rec["spec"].keys()
    assert rounds.from_record(rec).spec == plain.spec


def test_parked_datagrams_are_recorded_and_bad_ones_dropped() -> None:
    ch = WorkerChannel(nproc=2)
    try:
        ch.new_round(3)
        seen: list[tuple[int, int]] = []
        ch.on_parked = lambda lr, r: seen.append((lr, r))
        ch.received(b"3 1 parked", 0.0)
        ch.received(b"2 0 parked", 0.0)  # a worker still in an earlier round: fine
        for bad in (b"4 0 parked", b"3 2 parked", b"x 0 parked", b"3 -1 parked", b"3 0 parked " + b"x" * 64):
            ch.received(bad, 0.0)
        assert ch.parked == {1: 3, 0: 2} and seen == [(1, 3), (0, 2)]
        assert ch.dropped == 5
    finally:
        ch.close()


def test_tell_reaches_a_bound_worker_and_says_false_when_none_listens() -> None:
    ch = WorkerChannel(nproc=1)
    try:
        assert not ch.tell(0, "stop 1")  # nothing bound: the worker does not use rounds()
        inbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        inbox.bind(str(ch.dir / "w0"))
        inbox.settimeout(5)
        assert ch.tell(0, "stop 1")
        assert inbox.recv(4096) == b"stop 1"
        inbox.close()
        assert not ch.tell(0, "stop 2")  # the socket file is left, nobody reads it
    finally:
        ch.close()


WORKER_SIDE = r"""
import os, socket, sys
os.environ["RDZV_AGENT_PID"] = str(os.getpid())  # this process plays its own agent (before the import)
from rdzv_client import worker
assert worker.in_place()
gen = worker.rounds()
first = next(gen)
assert (first.round, first.rank, first.fresh) == (0, 1, True), first
agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
inbox = os.path.join(os.path.dirname(os.environ["RDZV_AGENT_SOCKET"]), "w0")
agent.sendto(b"stop 0", inbox)  # a round that is not newer: ignored
worker.progress(1)
agent.sendto(b"stop 1", inbox)
try:
    worker.progress(2)
    raise SystemExit("no MembershipChanged")
except worker.MembershipChanged:
    pass
agent.sendto(b"assign 1 RANK=0 WORLD_SIZE=3 MASTER_PORT=4242 PATH=/evil", inbox)  # PATH: refused whole
agent.sendto(b"assign 1 RANK=0 WORLD_SIZE=3 MASTER_PORT=4242", inbox)
second = next(gen)
assert (second.round, second.rank, second.world_size, second.master_port, second.fresh) == (1, 0, 3, 4242, False)
assert os.environ["RANK"] == "0" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "1"
# two round changes read at once: round 2 is taken, and round 3's stop is not lost
for m in (b"stop 2", b"assign 2 RANK=1 WORLD_SIZE=2 MASTER_PORT=4343", b"stop 3"):
    agent.sendto(m, inbox)
try:
    worker.progress(3)
    raise SystemExit("no MembershipChanged for round 2")
except worker.MembershipChanged:
    pass
third = next(gen)
assert (third.round, third.rank, third.world_size) == (2, 1, 2), third
try:
    worker.check()
    raise SystemExit("round 3's stop was lost")
except worker.MembershipChanged:
    pass
assert "torch" not in sys.modules
print("ok")
"""


def test_worker_side_takes_a_round_in_place(tmp_path) -> None:
    """The worker module in a process of its own (it reads its environment at
    import): stop -> MembershipChanged from progress(); parked sent; a valid
    assignment updates os.environ; an assignment naming other variables is
    refused; torch is never imported."""
    ch = WorkerChannel(nproc=1)

    async def run() -> subprocess.CompletedProcess[str]:
        await ch.start()
        ch.new_round(0)
        env = {
            **os.environ,
            "RDZV_AGENT_SOCKET": ch.path,
            "RDZV_RESTART_MODE": "in-place",
            "RANK": "1",
            "LOCAL_RANK": "0",
            "TORCHELASTIC_RESTART_COUNT": "0",
        }
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", WORKER_SIDE, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            out, err = await asyncio.wait_for(proc.communicate(), 60)
            await asyncio.sleep(0.05)  # the parked datagram, if it is still in flight
            return subprocess.CompletedProcess([], proc.returncode or 0, out.decode(), err.decode())
        finally:
            ch.close()

    res = asyncio.run(run())
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
    assert ch.parked == {0: 0} and ch.dropped == 2  # parks out of rounds 1 and 2: newer than the channel's round


@pytest.mark.parametrize("mode", [None, "process"])
def test_rounds_yields_once_outside_in_place_mode(mode: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RDZV_RESTART_MODE", "RDZV_AGENT_SOCKET")}
    if mode:
        env["RDZV_RESTART_MODE"] = mode
    code = "from rdzv_client import worker; print(len(list(worker.rounds())))"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert res.stdout.strip() == "1", res.stderr


def _formed(ids: list[str]) -> rounds.Job:
    from rdzv_common.protocol import JoinMsg

    job = rounds.new_job("j", JobSpec(min_nodes=1, max_nodes=len(ids), restart_mode="in-place"), 0.0)
    for i, n in enumerate(ids):
        rounds.join(
            job,
            JoinMsg(job_id="j", node_id=n, host=n, addr="127.0.0.1", local_world_size=1, master_port=1000 + i,
                    spec=job.spec),
            0.1,
        )  # fmt: skip
    assert job.state.value == "running", job.state
    return job


def _echo(rank: int):
    from rdzv_common.protocol import ExitRecord

    return [ExitRecord(local_rank=0, rank=rank, pid=9, reason="collective", message="a collective failed", timestamp=1)]


def test_a_collective_echo_with_no_dropped_member_changes_nothing() -> None:
    """An in-place worker whose collective failed parks; its agent says so at
    once (reason "collective"). With no member's connection down the cause is
    not known yet (the failed peer's own report follows): nothing changes,
    nothing is charged, no host is blamed."""
    job = _formed(["a", "b"])
    fx = rounds.fail(job, "a", 0, _echo(0), 1.0)
    assert job.round == 0 and job.state.value == "running" and job.restarts == 0
    assert not fx.host_failures and not fx.restarts and not fx.persist


def test_a_collective_echo_loses_a_dropped_member_at_once() -> None:
    job = _formed(["a", "b", "c"])
    rounds.disconnect(job, "c", 1.0, grace_s=0.5)
    rounds.fail(job, "a", 0, _echo(0), 1.05)
    assert job.round == 1 and job.restarts == 0 and "c" not in job.nodes


def test_the_agent_sends_exactly_what_a_worker_takes() -> None:
    """The agent's IN_PLACE_VARS and the worker's ASSIGNED_VARS are two copies
    (the worker module registers a signal handler on import, so the agent does
    not import it): a name on one side only would be dropped by every worker."""
    code = (
        "from rdzv_client.reform import IN_PLACE_VARS\n"
        "from rdzv_client.worker import ASSIGNED_VARS\n"
        "print(sorted(set(IN_PLACE_VARS) ^ ASSIGNED_VARS), len(IN_PLACE_VARS) == len(set(IN_PLACE_VARS)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]", "True"]
