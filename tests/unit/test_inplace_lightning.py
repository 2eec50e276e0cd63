"""rdzv_client.inplace_lightning (issue 20): what InPlaceDDPStrategy refuses,
and the agent's stack-dump signal after Lightning's teardown. The strategy's
re-formation itself is proven end to end (tests/e2e/test_inplace_lightning.py:
real agents, a SIGKILLed node, Lightning's Trainer.fit going on in place)."""

from __future__ import annotations

import os
import signal
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
