"""In-place re-formation for a PyTorch Lightning ``Trainer`` (issue 20).

    from rdzv_client import inplace
    from rdzv_client.inplace_lightning import InPlaceDDPStrategy

    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=InPlaceDDPStrategy(), ...)
    trainer.fit(model, dataloader)
    inplace.exit(0)

Run under ``rdzv-agent --restart-mode in-place``. What it does, in Lightning's
own terms: the strategy's launcher (Lightning calls ``launcher.launch(fit)``
around the whole of ``fit``) runs ``fit`` once per round of
:func:`rdzv_client.worker.rounds`, in the same process. Per round it makes the
round's group (:func:`inplace.process_group`, the default group), brings every
rank to the training state of the rank with the highest ``global_step`` (that
rank's full Lightning checkpoint - model, optimizers, LR schedulers, loops,
callbacks, precision plugin - made by ``dump_checkpoint`` in memory and
broadcast over the group, then restored by Lightning's own checkpoint
connector as ``fit(ckpt_path=...)`` would, never written to disk), wraps the
module with :func:`inplace.ddp` (the gradient all-reduce that the agent's word
interrupts: ``loss.backward()`` raises
:class:`~rdzv_client.worker.MembershipChanged`) and trains on. On
``MembershipChanged`` (anywhere in ``fit``) the launcher tears the round down
as Lightning does after a failure (``trainer._teardown()``, without the
``on_exception`` hooks: the training did not fail), waits for the next round
and runs ``fit`` again. ``global_step`` never goes back.

What a new round repeats (Lightning's code runs again, it is not skipped): the
``setup``/``on_fit_start``/``configure_optimizers`` hooks, the train
dataloader (a ``DistributedSampler`` for the new world size and rank), the
DDP wrapper. What a resume mid-epoch means is what it means for Lightning's
own resume from a mid-epoch checkpoint: the loops go on from the batch count
reached, but a dataloader that is not stateful starts the epoch's data over
(Lightning warns about it).

Limits: gloo (CPU) only, like :mod:`rdzv_client.inplace`; ``fit`` only
(``validate``/``test``/``predict`` run on the current round's group and are
not re-formed); no user DDP comm hook (the strategy's is the interruptible
all-reduce) and no model averaging. The strategy's collectives (``barrier``,
``broadcast``, ``reduce``: ``self.log(..., sync_dist=True)``) run on the
round's group waited in slices, so a lost peer or the agent's word ends them
with ``MembershipChanged``; a ``reduce`` on another group is Lightning's own,
blocking. The broadcast checkpoint is unpickled
(``weights_only=False``): it comes from a peer of the same job. Outside
in-place mode the strategy trains once, like ``DDPStrategy`` on the job's
group.

This module imports torch and Lightning (``pytorch_lightning``, or
``lightning.pytorch`` when that is the one imported).
"""

from __future__ import annotations

import faulthandler
import importlib
import inspect
import io
import pickle
import signal
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from . import inplace, worker
from .worker import MembershipChanged, World


def _lightning() -> Any:
    """The Lightning package the script uses: ``lightning.pytorch`` if it is
    imported already (or the only one installed), else ``pytorch_lightning``."""
    if "lightning.pytorch" in sys.modules and "pytorch_lightning" not in sys.modules:
        return sys.modules["lightning.pytorch"]
    try:
        return importlib.import_module("pytorch_lightning")
    except ImportError:
        return importlib.import_module("lightning.pytorch")


pl = _lightning()
_DDPStrategy: Any = pl.strategies.DDPStrategy
_Launcher: Any = importlib.import_module(pl.__name__ + ".strategies.launchers.launcher")._Launcher
_TrainerFn: Any = importlib.import_module(pl.__name__ + ".trainer.states").TrainerFn
_TrainerStatus: Any = importlib.import_module(pl.__name__ + ".trainer.states").TrainerStatus
_SIGTERMException: Any = importlib.import_module(pl.__name__ + ".utilities.exceptions").SIGTERMException
_FABRIC = "lightning_fabric" if pl.__name__ == "pytorch_lightning" else "lightning.fabric"
_reset_seed: Callable[[], None] = importlib.import_module(_FABRIC + ".utilities.seed").reset_seed

__all__ = ["InPlaceDDPStrategy", "MembershipChanged"]

# the ckpt_path a re-formed round's fit() is given: the strategy's load_checkpoint answers it from memory
MEMORY_CKPT = "rdzv-inplace://most-advanced-rank"
_REFUSED = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")


class InPlaceDDPStrategy(_DDPStrategy):  # type: ignore[misc]
    """``DDPStrategy`` re-formed in place on a round change (see the module's
    docstring). Takes ``DDPStrategy``'s DDP keyword arguments (for example
    ``find_unused_parameters``) and ``timeout_s``, the gloo group's timeout."""

    def __init__(self, *, timeout_s: float = 60.0, **kwargs: Any) -> None:
        refused = sorted(k for k in _REFUSED if kwargs.get(k) is not None)
        if refused:
            raise ValueError(f"InPlaceDDPStrategy: {', '.join(refused)} not supported (its comm hook is rdzv's)")
        backend = kwargs.pop("process_group_backend", None)
        if backend not in (None, "gloo"):
            raise ValueError(f"InPlaceDDPStrategy: process_group_backend must be gloo, not {backend!r}")
        if kwargs.get("start_method", "popen") != "popen":
            raise ValueError("InPlaceDDPStrategy: rdzv-agent starts the processes (start_method='popen' only)")
        if timeout_s <= 0:
            raise ValueError(f"InPlaceDDPStrategy: timeout_s must be positive, not {timeout_s}")
        super().__init__(process_group_backend="gloo", **kwargs)
        self.timeout_s = timeout_s
        self.world: World | None = None
        self.pg: Any = None  # the current round's group
        self._memory: dict[str, Any] | None = None  # the checkpoint this round's fit restores
        # a checkpoint restored in a round that ended before training began:
        # until training starts, it (not the half-set-up trainer) is this rank's state
        self._unstarted: dict[str, Any] | None = None
        self._trained = False  # this process's trainer holds training state (set up and restored)
        self.rounds = 0  # rounds this process ran fit in (1: never re-formed)

    # ---------------------------------------------------------- Lightning's hooks

    def _configure_launcher(self) -> None:
        self._launcher = _InPlaceLauncher(self)

    def setup_distributed(self) -> None:
        """The round's group is made by the launcher: here only the ranks are taken."""
        if self.pg is None:  # fit() is not how this trainer function started: take the round's group now
            self._join(worker.rounds().__next__())
        self.num_nodes = int(self.world.group_world_size if self.world else 1)
        super().set_world_ranks()
        _reset_seed()  # as DDPStrategy.setup_distributed does

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu")  # gloo on CPU: any ``devices=`` (one per local rank or 1) is this one

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        world = self.world
        if world is None:
            return dict(super().distributed_sampler_kwargs)
        return {"num_replicas": world.world_size, "rank": world.rank}

    def _setup_model(self, model: torch.nn.Module) -> Any:
        return inplace.ddp(model, self.pg, **self._ddp_kwargs)

    def _register_ddp_hooks(self) -> None:
        pass  # inplace.ddp registered the interruptible all-reduce

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if checkpoint_path == MEMORY_CKPT and self._memory is not None:
            return self._memory
        return dict(super().load_checkpoint(checkpoint_path, weights_only=weights_only))

    def on_train_start(self) -> None:
        super().on_train_start()
        self._trained, self._unstarted, self._memory = True, None, None

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self.pg is not None:
            inplace.wait(self.pg.barrier())

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` of rank ``src``, pickled and broadcast on the round's group
        (waited in slices, like every collective below)."""
        if self.pg is None or self.world is None:
            return _membership(super().broadcast, obj, src)
        data = inplace.broadcast_bytes(
            pickle.dumps(obj) if self.world.rank == src else None, self.pg, self.world.rank, src
        )
        return obj if self.world.rank == src else pickle.loads(data)

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """Lightning's ``reduce`` (``self.log(..., sync_dist=True)``): on the
        round's group, "mean"/"avg" as a sum divided by the world size (gloo
        has no AVG), a barrier first as Lightning does; another ``group`` goes
        to Lightning's own (blocking) code."""
        if not isinstance(tensor, torch.Tensor) or group is not None or self.pg is None:
            return _membership(super().reduce, tensor, group, reduce_op)
        divide = False
        if reduce_op is None:
            op = dist.ReduceOp.SUM
        elif isinstance(reduce_op, str):
            name = reduce_op.lower()
            divide = name in ("mean", "avg")
            op = dist.ReduceOp.SUM if divide else getattr(dist.ReduceOp, name.upper())
        else:
            divide = reduce_op == dist.ReduceOp.AVG
            op = dist.ReduceOp.SUM if divide else reduce_op
        self.barrier()
        inplace.all_reduce(tensor, self.pg, op)
        if not divide:
            return tensor
        size = self.pg.size()
        return tensor.copy_(tensor / size) if not torch.is_floating_point(tensor) else tensor.div_(size)

    # ---------------------------------------------------------- rounds

    def _join(self, world: World) -> None:
        """This round's group (the default group), once per round."""
        if self.world is not None and self.world.round == world.round and self.pg is not None:
            return  # a second trainer function in the same round: the same group
        self.world, self.pg = world, None
        self.pg = inplace.process_group(world, self.timeout_s)
        self.rounds += 1

    def _state(self, trainer: Any) -> tuple[int, Callable[[], dict[str, Any]] | None]:
        """This rank's training state: (global_step, how to make its checkpoint), or (-1, None)."""
        if self._unstarted is not None:
            ckpt = self._unstarted
            return int(ckpt.get("global_step", 0)), lambda: ckpt
        if self._trained:
            return int(trainer.global_step), lambda: dict(trainer._checkpoint_connector.dump_checkpoint())
        return -1, None

    def _sync(self, trainer: Any) -> int:
        """Bring every rank to the state of the rank with the highest
        ``global_step`` (the lowest such rank): its checkpoint is broadcast and
        kept for this round's fit. Returns that step, or -1 when no rank has
        trained yet (every process is new: fit starts as the script says)."""
        assert self.world is not None
        pg, world = self.pg, self.world
        self._memory = None
        step, dump = self._state(trainer)
        top, src = inplace.most_advanced(pg, world, step)
        if top < 0:
            return top
        blob = None
        if world.rank == src:
            assert dump is not None
            ckpt = dump()
            buf = io.BytesIO()
            torch.save(ckpt, buf)
            blob = buf.getvalue()
        data = inplace.broadcast_bytes(blob, pg, world.rank, src)
        if world.rank != src:
            ckpt = torch.load(io.BytesIO(data), weights_only=False)
        self._memory = self._unstarted = ckpt
        return top


def _membership(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, a collective: its failure (a peer lost) raises
    :class:`MembershipChanged` in in-place mode."""
    try:
        return fn(*args)
    except RuntimeError as e:
        inplace._raise_membership(e)


def _restore_stack_dump() -> None:
    """Lightning's teardown puts back every signal's Python-level handler as it
    found it, SIGUSR1's as SIG_DFL (faulthandler's is not a Python handler):
    the agent's stack-dump signal would then kill the worker. faulthandler
    installs its handler again only once unregistered."""
    faulthandler.unregister(signal.SIGUSR1)
    worker._register_stack_dump()


def _interruptible_sigterm_broadcast(trainer: Any, strategy: InPlaceDDPStrategy) -> None:
    """Lightning's training epoch loop broadcasts a "rank 0 got SIGTERM" flag
    from rank 0 before every step (``_broadcast_sigterm_tensor``), blocking,
    on the default group: a rank whose rank 0 left the round waits there until
    the group's timeout. The same broadcast, on the round's group, waited in
    slices: the agent's word raises :class:`MembershipChanged`."""
    loop = trainer.fit_loop.epoch_loop
    if not hasattr(loop, "_broadcast_sigterm_tensor"):
        raise TypeError("InPlaceDDPStrategy: this Lightning's training loop has no _broadcast_sigterm_tensor")

    def broadcast_sigterm() -> None:
        flag = torch.tensor([1 if getattr(trainer, "received_sigterm", False) else 0])
        inplace.broadcast(flag, strategy.pg, 0)
        if flag.item() == 1:
            strategy.barrier()
            raise _SIGTERMException()

    loop._broadcast_sigterm_tensor = broadcast_sigterm


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class _InPlaceLauncher(_Launcher):  # type: ignore[misc]
    """Runs a trainer function (``fit``: once per round, in this process)."""

    def __init__(self, strategy: InPlaceDDPStrategy) -> None:
        self.strategy = strategy

    @property
    def is_interactive_compatible(self) -> bool:
        return False

    def kill(self, signum: Any) -> None:
        pass  # rdzv-agent owns the processes

    def launch(self, function: Callable[..., Any], *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        s = self.strategy
        if trainer is None or trainer.state.fn != _TrainerFn.FITTING:
            if s.pg is None:
                s._join(next(worker.rounds()))
            return function(*args, **kwargs)
        call = inspect.signature(function).bind(*args, **kwargs)
        if "ckpt_path" not in call.arguments and "ckpt_path" not in inspect.signature(function).parameters:
            raise TypeError(f"InPlaceDDPStrategy: {function!r} takes no ckpt_path (an unknown Lightning version?)")
        _interruptible_sigterm_broadcast(trainer, s)
        for world in worker.rounds():
            try:
                s._join(world)
                top = s._sync(trainer)
                # the dataloaders again (a round cut short may have made them), with this world's sampler
                trainer.fit_loop._combined_loader = None
                trainer.fit_loop.epoch_loop.val_loop._combined_loader = None
                trainer.state.status = _TrainerStatus.RUNNING
                trainer.training = True
                if top >= 0:
                    call.arguments["ckpt_path"] = MEMORY_CKPT
                    _say(f"rdzv: round {world.round}: world {world.world_size}, from global_step {top}")
                result = function(*call.args, **call.kwargs)
            except MembershipChanged as e:
                _say(f"rdzv: round {world.round} is over: {e}")
                trainer._teardown()
                trainer.state.stage = None
                _restore_stack_dump()
                continue
            _restore_stack_dump()
            worker.done()
            return result
        raise MembershipChanged("no round to train in")  # rounds() ended: the agent is gone
