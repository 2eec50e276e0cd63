"""Per-rank step timing (issue 20 item 6, the signal of issue 22): the
bookkeeping (rdzv_client.steptime), the worker's datagram and the agent's
windows (rdzv_client.channel) over a real Unix socket, the CUDA-event path
with fake events (rdzv_client.inplace_wait.DeviceTimer), and real gloo ranks
whose DDP waits the library's group times."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from itertools import pairwise
from pathlib import Path

import pytest
from pydantic import ValidationError

from rdzv_client import steptime
from rdzv_client.channel import WorkerChannel
from rdzv_common.protocol import AGENT_MESSAGE, MAX_BODY_BYTES, MAX_TIMINGS, HeartbeatMsg, RankTiming

ROOT = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000_000

    def __call__(self) -> int:
        return self.t

    def tick(self, seconds: float) -> None:
        self.t += int(seconds * 1e9)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(steptime, "_now", c)
    for name in ("compute_ns", "wait_ns", "_mark", "_open", "_depth"):
        monkeypatch.setattr(steptime, name, 0)
    monkeypatch.setattr(steptime, "_measured", False)
    return c


def test_waits_and_the_compute_between_them(clock: Clock) -> None:
    assert steptime.totals_us() is None  # nothing timed: the datagram stays as it was
    t = steptime.wait_begin()  # the first wait: no compute before it (no previous wait)
    clock.tick(0.5)
    steptime.wait_end(t)
    clock.tick(2.0)  # compute
    t = steptime.wait_begin()
    clock.tick(0.25)
    steptime.wait_end(t)
    assert steptime.totals_us() == (2_000_000, 750_000)
    steptime.new_window()  # a round ends: the time until the next wait is not compute
    clock.tick(30.0)
    t = steptime.wait_begin()
    clock.tick(0.25)
    steptime.wait_end(t)
    assert steptime.totals_us() == (2_000_000, 1_000_000)


def test_the_totals_include_what_is_in_progress_and_never_go_back(clock: Clock) -> None:
    """A heartbeat window that falls inside one long wait (a peer 5x slower)
    or one long step still says where its time went."""
    seen: list[tuple[int, int]] = []

    def totals() -> tuple[int, int]:
        t = steptime.totals_us()
        assert t is not None
        seen.append(t)
        return t

    t = steptime.wait_begin()
    clock.tick(1.0)
    assert totals() == (0, 1_000_000)  # inside a long wait
    steptime.wait_end(t)
    clock.tick(0.5)
    assert totals() == (500_000, 1_000_000)  # computing since the wait's end
    t = steptime.wait_begin()
    clock.tick(0.25)
    assert totals() == (500_000, 1_250_000)
    steptime.wait_end(t)
    with steptime.compute():
        clock.tick(2.0)
        assert totals() == (2_500_000, 1_250_000)  # inside a compute() block
    clock.tick(3.0)  # once compute() is used, a gap is not compute
    assert totals() == (2_500_000, 1_250_000)
    assert all(a[0] <= b[0] and a[1] <= b[1] for a, b in pairwise(seen))


def test_measured_compute_replaces_the_gaps_and_counts_nested_blocks_once(clock: Clock) -> None:
    from rdzv_client import worker  # the stdlib API a loop without the library's group uses

    t = steptime.wait_begin()
    steptime.wait_end(t)
    clock.tick(5.0)  # not compute once compute() is used
    with worker.compute():
        clock.tick(1.0)
        with worker.compute():  # a helper timing its own part: counted once
            clock.tick(1.0)
        clock.tick(1.0)
    t = steptime.wait_begin()
    clock.tick(0.5)
    steptime.wait_end(t)
    worker.collective_wait(0.25)
    for bad in (-1.0, float("nan"), float("inf"), 1e12):
        worker.collective_wait(bad)  # ignored
    assert steptime.totals_us() == (3_000_000, 750_000)
    with pytest.raises(KeyError), worker.compute():  # an error in the block still ends it
        clock.tick(1.0)
        raise KeyError("x")
    assert steptime.totals_us() == (4_000_000, 750_000) and steptime._depth == 0


class FakeEvent:
    """torch.cuda.Event's surface: the device passes it at ``t`` (None: not yet)."""

    device_now = 0.0

    def __init__(self) -> None:
        self.t: float | None = None
        self.recorded = 0

    def record(self) -> None:
        self.recorded += 1
        self.t = None

    def at(self, t: float) -> None:
        self.t = t

    def query(self) -> bool:
        return self.t is not None

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.t is not None and end.t is not None
        return (end.t - self.t) * 1000.0  # milliseconds, as CUDA says


def test_device_times_come_from_the_events_and_replace_the_hosts(clock: Clock) -> None:
    from rdzv_client.inplace_wait import MAX_PENDING, DeviceTimer

    made: list[FakeEvent] = []

    def new() -> FakeEvent:
        made.append(FakeEvent())
        return made[-1]

    dev = DeviceTimer(new)
    a = dev.begin()
    dev.end(a)
    b = dev.begin()  # the first pair is not done on the device yet: nothing read
    dev.end(b)
    assert steptime.totals_us() is None and len(dev.pending) == 2
    made[0].at(1.0)
    made[1].at(1.5)  # waited 0.5 s on the device
    made[2].at(3.5)  # computed 2 s after it
    made[3].at(3.75)
    clock.tick(100.0)  # the host's time is not what counts
    dev.read()
    assert steptime.totals_us() == (2_000_000, 750_000) and not dev.pending
    assert steptime._measured  # host gaps between waits are no longer compute
    assert len(made) == 4 and len(dev.free) == 3  # read events are reused (the last end is kept)
    steptime.new_window()  # a round ended: no compute across it
    c = dev.begin()
    dev.end(c)
    assert len(made) == 4  # reused
    c.at(50.0)
    dev.pending[0][1].at(50.5)
    dev.read()
    assert steptime.totals_us() == (2_000_000, 1_250_000)
    # never more than MAX_PENDING pairs unread: the oldest go (counted)
    for _ in range(MAX_PENDING + 5):
        dev.end(dev.begin())
    assert len(dev.pending) == MAX_PENDING and dev.dropped == 5

    class Broken(FakeEvent):
        def query(self) -> bool:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    dev.pending[0] = (Broken(), Broken(), steptime.window)
    dev.read()  # a broken context: nothing more to read, never an error in the training loop
    assert not dev.pending


def test_a_heartbeats_timings_are_bounded_and_one_per_rank() -> None:
    ok = {"local_rank": 0, "window_s": 2.0, "steps": 10, "compute_s": 1.5, "wait_s": 0.4}
    msg = AGENT_MESSAGE.validate_json(json.dumps({"op": "hb", "step": 10, "rate": 5.0, "timings": [ok]}))
    assert isinstance(msg, HeartbeatMsg) and msg.timings == [RankTiming(**ok)]
    assert json.loads(msg.model_dump_json())["timings"] == [ok]
    assert "timings" not in HeartbeatMsg(step=1).model_dump_json()  # the frame it was without them
    bad = [
        [{**ok, "compute_s": -1.0}],
        [{**ok, "wait_s": 1e12}],
        [{**ok, "window_s": 0.0}],
        [{**ok, "local_rank": 1024}],
        [{**ok, "steps": -1}],
        [{**ok, "extra": 1}],
        [ok, ok],  # twice the same rank
        [{**ok, "local_rank": 1}, ok],  # out of order
        [],
        [{**ok, "local_rank": i} for i in range(MAX_TIMINGS + 1)],
    ]
    for timings in bad:
        with pytest.raises(ValidationError):
            AGENT_MESSAGE.validate_json(json.dumps({"op": "hb", "step": 10, "timings": timings}))
    with pytest.raises(ValidationError, match="timings come with a step"):
        AGENT_MESSAGE.validate_json(json.dumps({"op": "hb", "timings": [ok]}))
    with pytest.raises(ValidationError):  # NaN is not a number of seconds
        AGENT_MESSAGE.validate_json('{"op":"hb","step":1,"timings":[{"local_rank":0,"window_s":1,"steps":1,'
                                    '"compute_s":NaN,"wait_s":0}]}')  # fmt: skip


def test_the_agent_makes_windows_from_each_ranks_totals() -> None:
    ch = WorkerChannel(nproc=2)
    try:
        ch.new_round(3)
        ch.received(b"3 0 5", 10.0)  # not timed (yet)
        assert ch.timings() == []
        ch.received(b"3 0 6 1000000 500000", 11.0)  # timed from here: its first window starts
        ch.received(b"3 1 6 2000000 0", 11.0)
        assert ch.timings() == []
        ch.received(b"3 0 10 2500000 1000000", 13.0)
        ch.received(b"3 1 10 4000000 50000", 13.0)
        assert ch.timings() == [
            {"local_rank": 0, "window_s": 2.0, "steps": 4, "compute_s": 1.5, "wait_s": 0.5},
            {"local_rank": 1, "window_s": 2.0, "steps": 4, "compute_s": 2.0, "wait_s": 0.05},
        ]
        assert ch.timings() == []  # nothing new since: no window
        ch.received(b"3 0 12 100 100", 14.0)  # totals that went back (a new process): a new window starts
        assert ch.timings() == []
        ch.received(b"3 0 13 1100 200", 15.0)
        assert ch.timings() == [{"local_rank": 0, "window_s": 1.0, "steps": 1, "compute_s": 0.001, "wait_s": 0.0001}]
        before = ch.dropped
        for bad in (b"3 0 14 -1 0", b"3 0 14 1 x", b"3 0 14 1", b"3 0 14 1 2 3", b"3 0 14 %d 0" % (2**53 + 1)):
            ch.received(bad, 16.0)
        assert ch.dropped == before + 5 and ch.ranks[0].step == 13
        assert all(RankTiming.model_validate(t) for t in ch.timings())  # within the wire's bounds
        ch.new_round(4)
        assert ch.timings() == []
    finally:
        ch.close()


def test_the_agents_heartbeat_stays_within_a_frame_however_many_ranks_time() -> None:
    """A node of more local ranks than MAX_TIMINGS, each at the widest numbers:
    the agent sends the first MAX_TIMINGS, and the frame fits the server's limit."""
    n = MAX_TIMINGS + 8
    ch = WorkerChannel(nproc=n)
    try:
        ch.new_round(2**40)
        big = 2**53
        for lr in range(n):
            ch.received(b"%d %d %d 0 0" % (2**40, lr, big - 10**9), 1.0)
            ch.received(b"%d %d %d %d %d" % (2**40, lr, big, big, big), 1.0 + 7 * 24 * 3600.0 + 5.0)
        timings = ch.timings()
        assert [t["local_rank"] for t in timings] == list(range(MAX_TIMINGS))
        msg = HeartbeatMsg(step=big, rate=1e9, timings=[RankTiming.model_validate(t) for t in timings])
        frame = msg.model_dump_json()
        assert len(frame.encode()) < MAX_BODY_BYTES // 2, len(frame)
        assert AGENT_MESSAGE.validate_json(frame) == msg
    finally:
        ch.close()


async def test_a_workers_progress_carries_its_totals_to_the_agent() -> None:
    """A real worker process: worker.compute() and collective_wait() totals
    ride on its progress datagrams; the agent's window sees them."""
    ch = WorkerChannel(nproc=1)
    await ch.start()
    try:
        ch.new_round(0)
        code = (
            "import time\nfrom rdzv_client import worker\n"
            "for s in range(1, 5):\n"
            "    with worker.compute():\n        time.sleep(0.03)\n"
            "    worker.collective_wait(0.5)\n"
            "    worker.progress(s)\n    time.sleep(0.06)\n"
        )
        env = {**os.environ, "PYTHONPATH": str(ROOT), "RDZV_AGENT_SOCKET": ch.path, "TORCHELASTIC_RESTART_COUNT": "0"}
        p = await asyncio.create_subprocess_exec(sys.executable, "-c", code, env=env)
        assert await asyncio.wait_for(p.wait(), 60) == 0
        deadline = time.monotonic() + 30
        while not (0 in ch.ranks and ch.ranks[0].step == 4):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        (t,) = ch.timings()
        assert t["steps"] == 3 and t["wait_s"] == pytest.approx(1.5)  # the sum it was told
        assert t["compute_s"] > 0
    finally:
        ch.close()


RANK = r"""
import os, sys, time
os.environ.pop("RDZV_AGENT_SOCKET", None)
import torch
from torch import nn
from rdzv_client import inplace, steptime
from rdzv_client.worker import World

rank, port = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
pg = inplace.process_group(World(round=0, rank=rank, world_size=2, local_rank=0, local_world_size=1, group_rank=rank,
                                 group_world_size=2, master_addr="127.0.0.1", master_port=port, fresh=True))
ddp = inplace.ddp(model, pg)
x = torch.randn(8, 64)
for step in range(6):
    if step == 1:
        c0, w0 = steptime.compute_ns, steptime.wait_ns  # after DDP's first step (bucket rebuild)
    if rank == 1:
        time.sleep(0.3)  # the slow rank: its compute is long, its peer waits for it
    opt.zero_grad()
    ddp(x).sum().backward()
    opt.step()
print("TIMES", steptime.compute_ns - c0, steptime.wait_ns - w0, flush=True)
inplace.exit(0)
"""


def test_lock_step_ranks_the_slow_one_computes_longest_and_waits_least() -> None:
    """Two real ranks (gloo, inplace.ddp): the group times DDP's gradient
    wait and the compute between waits; a rank 0.3 s slower per step shows it."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RDZV_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = str(ROOT)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(r), str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env,
        )
        for r in range(2)
    ]  # fmt: skip
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
    times = []
    for out, err in outs:
        line = next((ln for ln in out.splitlines() if ln.startswith("TIMES")), None)
        assert line is not None, err[-2000:]
        times.append([int(v) for v in line.split()[1:]])
    (fast_compute, fast_wait), (slow_compute, slow_wait) = times
    assert slow_compute > fast_compute and fast_wait > slow_wait, times
    assert slow_compute > 5 * 0.3e9, times  # its five sleeps at least: they are between its waits
