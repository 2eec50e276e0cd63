"""rdzv_client.inplace_backend and inplace_fsdp (issue 20): the round's group
as a Python ``ProcessGroup`` whose Work objects rdzv controls. Torch's own
``dist.*`` calls on it (FSDP2's all-gather and reduce-scatter among them)
return, or raise ``MembershipChanged`` the moment the agent says the round is
over; a Work completed before stays completed. Ranks are threads of one
worker process (gloo on loopback) where the collectives alone are at stake,
two processes for FSDP2 (a ``DeviceMesh`` takes its coordinates from the
process's default group)."""

from __future__ import annotations

import ast
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rdzv_client import inplace, inplace_backend
from rdzv_client.worker import MembershipChanged
from tests.unit.test_inplace_ddp import COMMON, _run

ROOT = Path(__file__).resolve().parents[2]

WORD = (
    COMMON
    + r"""
import time
from rdzv_client import inplace_backend
gen = worker.rounds()
next(gen)
inbox = os.path.join(os.path.dirname(os.environ["RDZV_AGENT_SOCKET"]), "w0")
agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
port0 = free_port()
release, out = threading.Event(), {}

def round0(r):
    pg = inplace.process_group(world(0, r, port0), timeout_s=60)
    g = inplace_backend.interruptible(pg)
    assert isinstance(g, dist.ProcessGroup) and inplace_backend.interruptible(pg) is g
    t = torch.ones(2) * (r + 1)
    dist.all_reduce(t, group=g)
    gathered = torch.empty(4)
    dist.all_gather_into_tensor(gathered, torch.full((2,), float(r)), group=g)
    scattered = torch.empty(1)
    dist.reduce_scatter_tensor(scattered, torch.tensor([1.0, 2.0]), group=g)
    b = torch.tensor([float(r)])
    dist.broadcast(b, src=1, group=g)
    dist.barrier(group=g)
    objs = [None, None]
    dist.all_gather_object(objs, f"rank{r}", group=g)
    assert (t.tolist(), gathered.tolist(), scattered.item(), b.item(), objs) == (
        [3.0, 3.0], [0.0, 0.0, 1.0, 1.0], 2.0 * (r + 1), 1.0, ["rank0", "rank1"]), (t, gathered, scattered, b, objs)
    done = dist.all_reduce(torch.ones(1), group=g, async_op=True)
    done.wait()  # completed before the word
    if r == 1:
        release.wait(60)  # takes no part in the next all-gather: rank 0 blocks in it
        return
    threading.Timer(0.3, agent.sendto, args=(b"stop 1", inbox)).start()  # the agent's word
    try:
        dist.all_gather_into_tensor(torch.empty(4), torch.ones(2), group=g)  # synchronous, as FSDP2's
        out["raised"] = "nothing"
    except MembershipChanged as e:
        out["raised"] = str(e)
    out["done"] = (done.is_completed(), done.is_success(), done.wait(), done.get_future().done())
    try:
        dist.all_reduce(torch.ones(1), group=g)
        out["after"] = "nothing"
    except MembershipChanged as e:
        out["after"] = str(e)  # a collective on a finished round fails at once
    release.set()

run_ranks(round0)
assert out["raised"] == "round 1 replaces round 0", out  # the word, not gloo's timeout
assert out["done"] == (True, True, True, True), out
assert out["after"] == "round 1 replaces round 0", out
print("ok", flush=True)
os._exit(0)
"""
)


def test_the_agents_word_fails_a_pending_all_gather_and_a_completed_work_stays_completed(tmp_path: Path) -> None:
    """Torch's own API on the interruptible group: all-reduce, all-gather,
    reduce-scatter, broadcast, barrier, an object collective. Rank 0 then
    blocks in a synchronous all-gather rank 1 never joins; the agent's
    ``stop`` fails it with MembershipChanged carrying the word (not gloo's
    timeout); a Work completed before the word stays completed and
    successful; a collective issued after the word fails at once."""
    res = _run(WORD, tmp_path, in_place=True)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]


DDP_BUILD = (
    COMMON
    + r"""
gen = worker.rounds()
next(gen)
inbox = os.path.join(os.path.dirname(os.environ["RDZV_AGENT_SOCKET"]), "w0")
agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
port0 = free_port()
release, out = threading.Event(), {}

def round0(r):
    pg = inplace.process_group(world(0, r, port0), timeout_s=60)
    if r == 1:
        inplace.all_reduce(torch.zeros(1), pg)  # inplace.ddp's own check-in, then never DDP's construction
        release.wait(60)
        return
    threading.Timer(0.5, agent.sendto, args=(b"stop 1", inbox)).start()  # the agent's word
    try:
        inplace.ddp(nn.Linear(4, 2), pg)  # blocks in DDP's construction (its C++ parameter check)
        out["raised"] = "nothing"
    except MembershipChanged as e:
        out["raised"] = str(e)
    release.set()

run_ranks(round0)
assert out["raised"] == "round 1 replaces round 0", out  # the word, not gloo's timeout
print("ok", flush=True)
os._exit(0)
"""
)


def test_ddp_construction_blocked_on_a_silent_peer_ends_on_the_agents_word(tmp_path: Path) -> None:
    """A peer that checked in before DDP's construction and then went
    silent: DDP's own blocking collectives (the C++ parameter check and
    broadcast) run on the interruptible group, so the survivor's
    ``inplace.ddp`` raises MembershipChanged with the agent's word, not
    after gloo's timeout (60 s) or ``--in-place-timeout``."""
    res = _run(DDP_BUILD, tmp_path, in_place=True)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]


class _Inner:
    """A gloo Work's stand-in: its future is completed by the test."""

    def __init__(self) -> None:
        self.fut: torch.futures.Future[object] = torch.futures.Future()

    def get_future(self) -> torch.futures.Future[object]:
        return self.fut


def test_a_work_is_completed_once_by_its_collective_or_by_the_round_end() -> None:
    """The Work's future belongs to the round: completed by the collective
    (then the word changes nothing), or failed by the word (then a late
    completion is ignored); a failed collective raises outside in-place mode
    as torch's RuntimeError."""
    rnd = inplace._Round(pg=None, round_no=0)
    done, pending, failed = _Inner(), _Inner(), _Inner()
    w_done = inplace_backend._Work(rnd, done)
    w_pending = inplace_backend._Work(rnd, pending)
    w_failed = inplace_backend._Work(rnd, failed)
    done.fut.set_result([torch.ones(1)])
    failed.fut.set_exception(RuntimeError("Connection closed by peer"))
    assert w_done.is_completed() and not w_pending.is_completed()
    rnd.end("round 1 replaces round 0")
    assert w_done.wait() and w_done.is_success()
    pending.fut.set_result([torch.ones(1)])  # gloo finished after the word: ignored
    with pytest.raises(MembershipChanged, match="round 1 replaces round 0"):
        w_pending.wait()
    assert w_pending.is_completed() and not w_pending.is_success()
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        w_failed.wait()
    late = inplace_backend._Work(rnd, _Inner())
    with pytest.raises(MembershipChanged):
        late.wait()  # issued after the word: failed at once


FSDP = r"""
import os, sys, time, threading
rank, port, tmp, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
os.environ["RDZV_AGENT_PID"] = str(os.getpid())  # this process plays its own agent
import socket
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from rdzv_client import inplace, inplace_fsdp, worker
from rdzv_client.worker import MembershipChanged, World

gen = worker.rounds()
next(gen)
w = World(round=0, rank=rank, world_size=2, local_rank=0, local_world_size=1, group_rank=rank,
          group_world_size=2, master_addr="127.0.0.1", master_port=port, fresh=False)
pg = inplace.process_group(w, timeout_s=60)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
fully_shard(model, mesh=inplace_fsdp.mesh(pg), reshard_after_forward=False)  # backward: reduce-scatter only
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
ckpt = os.path.join(tmp, "ckpt")
for _ in range(2):
    opt.zero_grad(); model(x).sum().backward(); opt.step()
if rank == 0:  # an earlier save of step 1 cut short: files, no .metadata
    os.makedirs(os.path.join(ckpt, "step-000000001"))
    open(os.path.join(ckpt, "step-000000001", "__5_0.distcp"), "w").close()
for step in (1, 2, 3):
    inplace_fsdp.save(ckpt, model, opt, step, keep=2)  # complete: both take part
    if step == 1 and rank == 0:
        print("step1", sorted(os.listdir(os.path.join(ckpt, "step-000000001"))), flush=True)
before = [p.to_local().clone() for p in opt.param_groups[0]["params"]]  # the shards
if mode == "backward":
    opt.zero_grad()
    loss = model(x).sum()  # both join the forward's all-gather
if rank == 1:  # takes no part in what follows: rank 0 blocks in it
    if mode == "save":
        inplace.all_reduce(torch.zeros(1), pg)  # save's own first all-reduce: rank 0 blocks in DCP's
    deadline = time.monotonic() + 100
    while not os.path.exists(os.path.join(tmp, "flag")) and time.monotonic() < deadline:
        time.sleep(0.05)
    os._exit(0)
inbox = os.path.join(os.path.dirname(os.environ["RDZV_AGENT_SOCKET"]), "w0")
agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
threading.Timer(0.5, agent.sendto, args=(b"stop 1", inbox)).start()  # the agent's word
try:
    if mode == "backward":
        loss.backward()  # blocks in FSDP2's reduce-scatter
        opt.step()
    else:
        inplace_fsdp.save(ckpt, model, opt, 4)  # blocks in DCP's first collective (rank 1 joined save's own)
    print("raised nothing", flush=True)
except MembershipChanged as e:
    print("raised", e, flush=True)
except BaseException as e:
    print("raised other", type(e).__name__, e, flush=True)
unchanged = all(torch.equal(a, p.to_local()) for a, p in zip(before, opt.param_groups[0]["params"]))
print("unchanged", unchanged, "latest", inplace_fsdp.latest(ckpt), flush=True)
print("saves", sorted((n, sorted(os.listdir(os.path.join(ckpt, n)))) for n in os.listdir(ckpt)), flush=True)
os._exit(0)  # as inplace.exit
"""


def _two_ranks(tmp_path: Path, mode: str) -> str:
    """FSDP run by two worker processes, each its own agent; rank 1 stays
    (and takes no part) until rank 0 is done. Rank 0's output."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RDZV_", "TORCHELASTIC_"))}
    env.update(PYTHONPATH=str(ROOT), RDZV_RESTART_MODE="in-place", LOCAL_RANK="0", TORCHELASTIC_RESTART_COUNT="0")
    agents, procs = [], []
    try:
        for r in range(2):
            (tmp_path / str(r)).mkdir()
            sock = tmp_path / str(r) / "sock"
            agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # the agent's end: takes "parked"
            agent.bind(str(sock))
            agents.append(agent)
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", FSDP, str(r), str(port), str(tmp_path), mode],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env={**env, "RDZV_AGENT_SOCKET": str(sock)},
                )
            )
        out, err = procs[0].communicate(timeout=110)
        (tmp_path / "flag").touch()  # rank 1 leaves (rank 0 may have failed before saying so)
        procs[1].communicate(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
        for a in agents:
            a.close()
    assert procs[0].returncode == 0, out + err[-3000:]
    return out + err[-3000:]


def test_an_fsdp2_backward_blocked_in_its_reduce_scatter_raises_membership_changed(tmp_path: Path) -> None:
    """FSDP2 (``fully_shard`` on ``inplace_fsdp.mesh(pg)``) trains; then rank
    1 takes no part in a backward: rank 0's ``loss.backward()``, blocked in
    FSDP2's reduce-scatter, raises MembershipChanged (not a RuntimeError, not
    gloo's timeout) when the agent's word comes, and no optimizer step is
    taken."""
    out = _two_ranks(tmp_path, "backward")
    assert "raised round 1 replaces round 0" in out, out
    assert "unchanged True" in out, out


def test_a_save_cut_short_by_the_word_raises_membership_changed_and_is_never_resumed(tmp_path: Path) -> None:
    """Saves of steps 1-3 complete (``keep=2``: step 1's goes, with the
    leftover of an earlier, interrupted save of step 1); rank 1 takes no part
    in the save of step 4: rank 0's ``inplace_fsdp.save`` raises
    MembershipChanged on the agent's word, and the newest complete save is
    still step 3's."""
    out = _two_ranks(tmp_path, "save")
    assert "raised round 1 replaces round 0" in out, out
    assert "unchanged True latest 3" in out, out
    assert "step1 ['.metadata', '__0_0.distcp', '__1_0.distcp']" in out, out  # the leftover went first
    saves = dict(ast.literal_eval(out.split("saves ")[1].splitlines()[0]))
    # the keep=2 newest complete stay; step 4's is incomplete
    assert sorted(saves) == ["step-000000002", "step-000000003", "step-000000004"], saves
    assert saves["step-000000002"] == saves["step-000000003"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert ".metadata" not in saves["step-000000004"], saves


def test_latest_is_the_newest_complete_save(tmp_path: Path) -> None:
    """A save is complete once DCP renamed its ``.metadata`` in (written last,
    after every rank's files): a newer save without it (cut short by a round
    change) is never the one resumed; stray names are ignored."""
    from rdzv_client import inplace_fsdp

    assert inplace_fsdp.latest(tmp_path / "none") == -1
    for step, complete in ((10, True), (20, True), (30, False)):
        d = tmp_path / f"step-{step:09d}"
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"x")
        if complete:
            (d / ".metadata").write_bytes(b"x")
    (tmp_path / "step-40").mkdir()  # not a save's name
    (tmp_path / "step-000000040.tmp").mkdir()
    assert inplace_fsdp.latest(tmp_path) == 20


def test_save_refuses_bad_input_before_touching_anything(tmp_path: Path) -> None:
    from rdzv_client import inplace_fsdp

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="keep"):
        inplace_fsdp.save(tmp_path / "ck", model, None, 10, keep=0)
    with pytest.raises(ValueError, match="step"):
        inplace_fsdp.save(tmp_path / "ck", model, None, -1)
    with pytest.raises(ValueError, match="not sharded"):
        inplace_fsdp.save(tmp_path / "ck", model, None, 10)  # a model not on inplace_fsdp.mesh(pg)
    assert not (tmp_path / "ck").exists()
