"""rdzv_client.inplace_lightning (issue 20): what InPlaceDDPStrategy refuses,
and the agent's stack-dump signal after Lightning's teardown. The strategy's
re-formation itself is proven end to end (tests/e2e/test_inplace_lightning.py:
real agents, a SIGKILLed node, Lightning's Trainer.fit going on in place)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pytorch_lightning")

from rdzv_client.inplace_lightning import InPlaceDDPStrategy

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"ddp_comm_hook": print}, "ddp_comm_hook not supported"),
        ({"model_averaging_period": 4}, "model_averaging_period not supported"),
        ({"process_group_backend": "nccl"}, "must be gloo, not 'nccl'"),
        ({"start_method": "spawn"}, "start_method='popen' only"),
        ({"timeout_s": 0}, "timeout_s must be positive"),
    ],
)
def test_the_strategy_refuses_what_it_cannot_re_form(kwargs: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        InPlaceDDPStrategy(**kwargs)  # type: ignore[arg-type]


def test_the_default_arguments_make_a_gloo_strategy() -> None:
    s = InPlaceDDPStrategy(find_unused_parameters=True)
    assert s.process_group_backend == "gloo" and s.timeout_s == 60.0
    assert s._ddp_kwargs == {"find_unused_parameters": True}


SIGUSR1_AFTER_TEARDOWN = r"""
import os, signal, sys
import pytorch_lightning as pl
from rdzv_client import inplace_lightning
trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
trainer._signal_connector.register_signal_handlers()  # what Trainer._run does
trainer._signal_connector.teardown()  # what Trainer._teardown does: SIGUSR1 back to SIG_DFL
if sys.argv[1] == "restore":
    inplace_lightning._restore_stack_dump()
os.kill(os.getpid(), signal.SIGUSR1)
print("alive", flush=True)
"""


@pytest.mark.parametrize("restore", [True, False])
def test_the_stack_dump_signal_survives_lightnings_teardown(restore: bool) -> None:
    """The agent sends SIGUSR1 to dump a hung worker's stack. Lightning's
    signal teardown resets it to SIG_DFL (faulthandler's handler is not a
    Python one), so the signal kills the worker; the launcher installs the
    dump again after each teardown. Without that (``restore`` False) the
    worker dies of the signal: what the test shows the fix is needed for."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for k in [k for k in env if k.startswith(("RDZV_", "TORCHELASTIC_"))]:
        del env[k]
    p = subprocess.run(
        [sys.executable, "-c", SIGUSR1_AFTER_TEARDOWN, "restore" if restore else "no"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    if restore:
        assert p.returncode == 0 and "alive" in p.stdout, p.stderr[-2000:]
        assert "Current thread" in p.stderr and "<module>" in p.stderr, p.stderr[-2000:]
    else:
        assert p.returncode == -signal.SIGUSR1 and "alive" not in p.stdout, (p.returncode, p.stderr[-2000:])


COLLECTIVES = r"""
import os, socket, sys, threading, time
os.environ["RDZV_AGENT_PID"] = str(os.getpid())  # this process plays its own agent (before the import)
import torch
import pytorch_lightning as pl
from rdzv_client import inplace, worker, inplace_lightning
from rdzv_client.inplace_lightning import InPlaceDDPStrategy
from rdzv_client.worker import MembershipChanged, World

def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close(); return port

gen = worker.rounds()
next(gen)  # the worker channel's inbox and thread
port = free_port()
strategies, out, errors = {}, {}, []

def rank(r, fn):
    try:
        w = World(round=0, rank=r, world_size=2, local_rank=0, local_world_size=1, group_rank=r,
                  group_world_size=2, master_addr="127.0.0.1", master_port=port, fresh=False)
        s = strategies.get(r)
        if s is None:
            s = strategies[r] = InPlaceDDPStrategy(timeout_s=float(sys.argv[1]))
            s.world, s.pg = w, inplace.process_group(w, timeout_s=float(sys.argv[1]))
        fn(r, s)
    except BaseException as e:
        errors.append((r, e))

def both(fn):
    threads = [threading.Thread(target=rank, args=(r, fn)) for r in range(2)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert not errors and not any(t.is_alive() for t in threads), errors

def collectives(r, s):
    out[r] = (
        float(s.reduce(torch.tensor([r + 1.0]))),  # mean
        float(s.reduce(torch.tensor([r + 1.0]), reduce_op="sum")),
        float(s.reduce(torch.tensor([r + 1.0]), reduce_op="max")),
        s.broadcast({"from": r, "list": [r] * 3}, src=1),
    )
    s.barrier()

both(collectives)
print("COLLECTIVES", out[0], out[1], flush=True)

# rank 1 alone in Lightning's per-step SIGTERM-flag broadcast (rank 0 left the round): the agent's word ends it
trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
if sys.argv[2] == "patched":
    inplace_lightning._interruptible_sigterm_broadcast(trainer, strategies[1])
else:  # Lightning's own, on the default group: made rank 1's round group (the threads made two)
    torch.distributed.distributed_c10d._update_default_pg(strategies[1].pg)

def stuck(r, s):
    t0 = time.monotonic()
    try:
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
        out["stuck"] = f"returned after {time.monotonic() - t0:.1f}s"
    except MembershipChanged as e:
        out["stuck"] = f"MembershipChanged: {e}"

t = threading.Thread(target=rank, args=(1, stuck))
t.start()
time.sleep(0.5)
agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
agent.sendto(b"stop 1", os.path.join(os.path.dirname(os.environ["RDZV_AGENT_SOCKET"]), "w0"))
t.join(60)
print("STUCK", out.get("stuck"), errors, flush=True)
inplace.exit(0)
"""


def _collectives(tmp_path: Path, variant: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RDZV_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = str(ROOT)
    agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # the agent's end: takes "parked"
    agent.bind(str(tmp_path / "sock"))
    env.update(RDZV_AGENT_SOCKET=str(tmp_path / "sock"), RDZV_RESTART_MODE="in-place", LOCAL_RANK="0")
    env["TORCHELASTIC_RESTART_COUNT"] = "0"
    try:
        return subprocess.run(
            [sys.executable, "-c", COLLECTIVES, str(timeout_s), variant],
            capture_output=True,
            text=True,
            env=env,
            timeout=150,
        )
    finally:
        agent.close()


def test_the_strategys_collectives_and_the_sigterm_broadcast_end_on_the_agents_word(tmp_path: Path) -> None:
    """Two ranks (threads, gloo on loopback): ``reduce`` (mean, sum, max),
    ``broadcast`` of an object and ``barrier`` on the round's group give
    Lightning's answers. Then rank 1 waits alone in Lightning's per-step
    SIGTERM-flag broadcast (as when rank 0 left the round): the agent's
    ``stop`` ends it with MembershipChanged at once, where Lightning's own
    broadcast waits out the group's timeout (60 s here) and swallows it."""
    p = _collectives(tmp_path, "patched", 60.0)
    assert p.returncode == 0, p.stderr[-3000:]
    expect = "(1.5, 3.0, 2.0, {'from': 1, 'list': [1, 1, 1]})"
    assert f"COLLECTIVES {expect} {expect}" in p.stdout, p.stdout + p.stderr[-2000:]
    assert "STUCK MembershipChanged: round 1 replaces round 0 []" in p.stdout, p.stdout + p.stderr[-2000:]


def test_lightnings_own_sigterm_broadcast_ignores_the_agents_word(tmp_path: Path) -> None:
    """The control for the test above: Lightning's own broadcast on the same
    group does not see the agent's word; it returns only when the group's
    timeout (3 s here) fails it, and swallows the failure. This is why the
    launcher replaces it."""
    p = _collectives(tmp_path, "lightning", 3.0)
    assert p.returncode == 0, p.stderr[-3000:]
    m = re.search(r"STUCK returned after ([\d.]+)s", p.stdout)
    assert m and float(m.group(1)) >= 2.0, p.stdout + p.stderr[-2000:]
