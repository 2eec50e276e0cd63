"""rdzv_client.inplace for DDP (issue 20): the round's group is a real
``torch.distributed.ProcessGroup``, DDP's gradient all-reduce goes through a
comm hook whose futures the worker channel's thread fails on the agent's
word, and abandoned rounds do not pile up memory. Ranks are threads of one
worker process (gloo on loopback), so the agent's word reaches both; the
multi-rank tests run in a subprocess of their own (a process gets one default
group and keeps every group it made)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from rdzv_client import inplace
from rdzv_client.worker import MembershipChanged

ROOT = Path(__file__).resolve().parents[2]

COMMON = r"""
import ctypes, gc, os, socket, sys, threading
os.environ["RDZV_AGENT_PID"] = str(os.getpid())  # this process plays its own agent (before the import)
import torch, torch.distributed as dist
from torch import nn
from rdzv_client import inplace, worker
from rdzv_client.worker import MembershipChanged, World

def world(rnd, rank, port):
    return World(round=rnd, rank=rank, world_size=2, local_rank=0, local_world_size=1, group_rank=rank,
                 group_world_size=2, master_addr="127.0.0.1", master_port=port, fresh=False)

def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close(); return port

def checksum(m):
    return sum(float(p.detach().double().sum()) for p in m.parameters())

def run_ranks(fn):
    errors = []
    def body(r):
        try:
            fn(r)
        except BaseException as e:
            errors.append(f"rank {r}: {e!r}")
    threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join(90) for t in threads]
    assert not errors and not any(t.is_alive() for t in threads), errors
"""

WORD = (
    COMMON
    + r"""
gen = worker.rounds()
next(gen)
inbox = os.path.join(os.path.dirname(os.environ["RDZV_AGENT_SOCKET"]), "w0")
agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
models = []
for r in range(2):
    torch.manual_seed(r)  # different weights: DDP's construction makes them equal
    m = nn.Sequential(nn.Linear(20, 30), nn.ReLU(), nn.Linear(30, 2))
    models.append((m, torch.optim.SGD(m.parameters(), lr=0.1)))
x = torch.randn(8, 20)
port0, port1 = free_port(), free_port()
release, out = threading.Event(), {}

def round0(r):
    m, opt = models[r]
    pg = inplace.process_group(world(0, r, port0), timeout_s=60)
    assert isinstance(pg, dist.ProcessGroup), type(pg)
    t = torch.ones(1)
    dist.all_reduce(t, group=pg)  # torch's own API takes it
    b = torch.tensor([float(r)])
    dist.broadcast(b, src=1, group=pg)  # a global rank: the group's rank table is registered
    assert (t.item(), b.item(), dist.get_world_size(pg)) == (2.0, 1.0, 2)
    ddp = inplace.ddp(m, pg)
    out[r, "ddp"] = ddp
    opt.zero_grad(); ddp(x).sum().backward(); opt.step()
    out[r, "sum0"] = checksum(m)
    opt.zero_grad()
    loss = ddp(x).sum()  # the second forward: DDP rebuilds its buckets, a broadcast both join
    if r == 1:
        release.wait(60)  # takes no part in the all-reduce: rank 0 blocks in it
        return
    before = checksum(m)
    threading.Timer(0.3, agent.sendto, args=(b"stop 1", inbox)).start()  # the agent's word, mid-backward
    try:
        loss.backward(); opt.step()
        out["raised"] = "nothing"
    except MembershipChanged as e:
        out["raised"] = str(e)
    out["unchanged"] = checksum(m) == before
    release.set()

run_ranks(round0)
assert out[0, "sum0"] == out[1, "sum0"], out
assert out["raised"] == "round 1 replaces round 0", out  # the word, not gloo's timeout
assert out["unchanged"], "an optimizer step was taken"
agent.sendto(b"assign 1 RANK=0 WORLD_SIZE=2", inbox)
assert next(gen).round == 1

def round1(r):
    m, opt = models[r]
    if r == 1:
        with torch.no_grad():
            m[0].weight.add_(1.0)  # behind: sync_state must bring rank 0's weights
    pg = inplace.process_group(world(1, r, port1), timeout_s=60)
    # rank 0 passes its DDP of round 0 (a loop's `ddp` variable), rank 1 the bare
    # model (a newcomer's): the state sent is the module's either way
    top = inplace.sync_state(pg, world(1, r, port1), out[0, "ddp"] if r == 0 else m, opt, 1 - r)
    assert top == 1 and checksum(m) == out[0, "sum0"], (top, checksum(m))
    ddp = inplace.ddp(m, pg)  # the same model: the old DDP's hooks must be gone
    for _ in range(3):
        opt.zero_grad(); ddp(x + r).sum().backward(); opt.step()
    out[r, "sum1"] = checksum(m)

run_ranks(round1)
assert out[0, "sum1"] == out[1, "sum1"], out
print("ok", flush=True)
os._exit(0)  # as inplace.exit: an abandoned group's threads must not be torn down (terminate, SIGABRT)
"""
)

MEMORY = (
    COMMON
    + r"""
def rss_mb():
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what malloc caches is not what is kept
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

models = []
for r in range(2):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(1000, 1000), nn.ReLU(), nn.Linear(1000, 10))  # 1M parameters: 4 MB
    models.append((m, torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)))
x = torch.randn(4, 1000)
steps, marks = [0, 0], {}
for rnd in range(21):
    port, both = free_port(), threading.Barrier(2)

    def one(r):
        m, opt = models[r]
        pg = inplace.process_group(world(rnd, r, port), timeout_s=60)
        steps[r] = inplace.sync_state(pg, world(rnd, r, port), m, opt, steps[r])
        ddp = inplace.ddp(m, pg)
        for _ in range(2):
            opt.zero_grad(); ddp(x).sum().backward(); opt.step(); steps[r] += 1
        both.wait(60)
        if r == 0:
            inplace._end_rounds("the word")  # between two steps: nothing pending
        both.wait(60)
        try:
            opt.zero_grad(); ddp(x).sum().backward()
            raise AssertionError("a backward after the word went through")
        except MembershipChanged:
            pass

    run_ranks(one)
    marks[rnd] = rss_mb()
print("rss", " ".join(f"{marks[r]:.1f}" for r in (0, 5, 10, 15, 20)))
print("per-round", (marks[20] - marks[5]) / 15, flush=True)
os._exit(0)  # as inplace.exit
"""
)


def _run(code: str, tmp_path: Path, in_place: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RDZV_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = str(ROOT)
    # one malloc arena: the ranks are threads made anew each round, and the
    # arenas of dead threads keep freed memory (5 MB a round measured) that a
    # worker, training on its main thread, never leaves behind
    env["MALLOC_ARENA_MAX"] = "1"
    agent = None
    if in_place:
        agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # the agent's end: takes "parked"
        agent.bind(str(tmp_path / "sock"))
        env.update(RDZV_AGENT_SOCKET=str(tmp_path / "sock"), RDZV_RESTART_MODE="in-place", LOCAL_RANK="0")
        env["TORCHELASTIC_RESTART_COUNT"] = "0"
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=110)
    finally:
        if agent is not None:
            agent.close()


def test_the_agents_word_fails_a_pending_ddp_allreduce_and_a_new_ddp_trains(tmp_path: Path) -> None:
    """Rank 0 blocks in ``loss.backward()`` (rank 1 never joins the all-reduce);
    the agent's ``stop`` arrives on the worker channel: the channel's thread
    fails the comm hook's future, backward raises MembershipChanged with the
    word's reason (not gloo's timeout), no optimizer step is taken; in the
    next round ``sync_state`` takes the old DDP for its model, and a new group
    and a new DDP on the same model train in lock-step."""
    res = _run(WORD, tmp_path, in_place=True)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]


def test_memory_of_abandoned_rounds_is_bounded(tmp_path: Path) -> None:
    """20 round changes in one process with a 1M-parameter DDP on 2 ranks:
    each abandoned round keeps its gloo group and store (about 0.2 MB each,
    measured), never its DDP, buckets or gradients (8 MB a round here: a
    failed backward's exception kept the old DDP alive through its traceback
    until the hook raised a fresh one)."""
    res = _run(MEMORY, tmp_path, in_place=False)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    per_round = float(res.stdout.split("per-round")[1].split()[0])
    print(res.stdout)
    assert per_round < 2.0, res.stdout


def test_a_future_completed_before_the_round_ends_stays_completed() -> None:
    """The word after a collective completed is harmless: its future keeps its
    value (no second completion, no error); a collective completing after the
    word is ignored; a future issued after the word fails at once."""
    rnd = inplace._Round(pg=None, round_no=0)
    done, pending = torch.futures.Future(), torch.futures.Future()
    assert rnd.track(done) and rnd.track(pending)
    rnd.settle(done, torch.ones(2), None)
    rnd.end("round 1 replaces round 0")
    rnd.end("again")  # a second word changes nothing
    assert torch.equal(done.value(), torch.ones(2))
    rnd.settle(pending, torch.zeros(2), None)  # gloo finished after the word: ignored
    try:
        pending.wait()
        raise AssertionError("the pending future was not failed")
    except MembershipChanged as e:
        assert str(e) == "round 1 replaces round 0"
    late = torch.futures.Future()
    assert not rnd.track(late) and late.done()


def test_a_failed_backward_raises_a_fresh_membership_changed() -> None:
    """finish() raises a new exception and strips the stored one's traceback
    (the reducer keeps the future: a traceback would keep the training loop's
    frames, and the old DDP, alive)."""
    state = inplace._HookState.__new__(inplace._HookState)
    ok, failed = torch.futures.Future(), torch.futures.Future()
    ok.set_result(torch.ones(1))
    stored = MembershipChanged("round 2 replaces round 1")
    failed.set_exception(stored)
    state.batch = [ok, failed]
    try:
        state.finish()
        raise AssertionError("finish() did not raise")
    except MembershipChanged as e:
        assert e is not stored and str(e) == "round 2 replaces round 1"
    assert stored.__traceback__ is None and state.batch == []
    state.batch = [ok]
    state.finish()  # all completed: nothing raised


def test_group_ends_its_block_on_a_round_change_even_one_during_formation(monkeypatch) -> None:
    """``with inplace.group(world) as pg:`` swallows MembershipChanged (the
    enclosing ``for world in worker.rounds()`` goes on); a round that ends
    while the group forms cannot skip the block, so its first use of ``pg``
    raises and ends it; a block that ends normally ends the rounds."""
    from rdzv_client import worker

    world = worker.World(0, 0, 1, 0, 1, 0, 1, "127.0.0.1", 1, True)

    def forming(*_: object) -> None:
        raise MembershipChanged("round 1 replaces round 0")

    monkeypatch.setattr(inplace, "process_group", forming)
    monkeypatch.setattr(worker, "_done", False)
    reached = []
    with inplace.group(world) as pg:
        reached.append("body")
        inplace.sync_state(pg, world, torch.nn.Linear(1, 1), None, 0)
        reached.append("after sync_state")
    assert reached == ["body"] and not worker._done
    monkeypatch.setattr(inplace, "process_group", lambda *_: "a group")
    with inplace.group(world) as pg:
        assert pg == "a group"
    assert worker._done
