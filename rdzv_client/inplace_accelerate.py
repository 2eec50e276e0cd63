"""In-place re-formation for a Hugging Face accelerate script (issue 20).

    from rdzv_client import inplace, worker
    from rdzv_client.inplace_accelerate import InPlaceAccelerator

    for world in worker.rounds():
        with inplace.group(world) as pg:
            accelerator = InPlaceAccelerator(pg, cpu=True)
            model, opt, dl = accelerator.prepare(model, opt, dl)
            step = accelerator.sync_state(world, step)
            ...  # the accelerate training loop, unchanged
    inplace.exit(0)

Run under ``rdzv-agent --restart-mode in-place`` (not ``accelerate launch``:
that runs torchrun, which restarts its own workers). What it does, in
accelerate's own terms: accelerate keeps its process-wide state in
singletons (``PartialState``, ``AcceleratorState``, ``GradientState``) that
it fills once, from the default process group. An :class:`InPlaceAccelerator`
is made once per round: it clears those singletons (accelerate's own
``_reset_state``) and lets ``Accelerator.__init__`` fill them again from the
round's group (:func:`inplace.process_group` made it the default group, so
accelerate finds ``torch.distributed`` initialised and takes its rank and
world size from it). ``prepare`` then works as accelerate's, with three
differences: the model's DDP is :func:`inplace.ddp` on the round's group
(the gradient all-reduce that the agent's word interrupts:
``accelerator.backward(loss)`` raises
:class:`~rdzv_client.worker.MembershipChanged`), accelerate's own wrapping
(device placement, mixed-precision autocast) still applied to the module
under it; objects prepared in an earlier round are taken back to what they
wrap (the module under the old DDP, the optimizer and scheduler under
accelerate's wrappers, the dataloader that was prepared), so the usual
``model, opt, dl = accelerator.prepare(model, opt, dl)`` can run every
round; a prepared dataloader synchronises its random state (accelerate does
it at the start of every epoch, by a blocking broadcast) with the library's
sliced broadcast. The dataloader is sharded for the round's world size and
rank. :meth:`InPlaceAccelerator.sync_state` brings every rank to the state
of the most advanced one: every prepared model, optimizer and scheduler and
every object given to ``register_for_checkpointing``, broadcast in memory.

The accelerator's collectives (``wait_for_everyone`` on the round's group
waited in slices; ``gather``, ``gather_for_metrics``, ``reduce``,
``pad_across_processes``, accelerate's blocking calls) raise
:class:`MembershipChanged` when a lost peer fails them.

Limits (refused with a clear error): gloo on CPU only (``cpu=True``, like
:mod:`rdzv_client.inplace_lightning`); no DDP comm hook of the user's
(``DistributedDataParallelKwargs(comm_hook=...)``: the hook is rdzv's); no
``torch.compile`` (``dynamo_backend``); no ``dispatch_batches`` (a blocking
broadcast per batch); random-state synchronisation for ``"torch"`` and
``"generator"`` only. A dataloader starts its epoch over in a new round.

This module imports torch and accelerate.
"""

from __future__ import annotations

import io
import weakref
from collections.abc import Callable
from typing import Any

import torch
from accelerate import Accelerator  # type: ignore[import-untyped]
from accelerate.data_loader import DataLoaderDispatcher  # type: ignore[import-untyped]
from accelerate.optimizer import AcceleratedOptimizer  # type: ignore[import-untyped]
from accelerate.scheduler import AcceleratedScheduler  # type: ignore[import-untyped]
from accelerate.state import AcceleratorState, GradientState  # type: ignore[import-untyped]
from accelerate.utils import DistributedDataParallelKwargs, DistributedType, DynamoBackend, RNGType  # type: ignore[import-untyped]
from accelerate.utils.other import extract_model_from_parallel  # type: ignore[import-untyped]

from . import inplace, inplace_backend
from .worker import MembershipChanged, World

__all__ = ["InPlaceAccelerator", "MembershipChanged"]

# the random states a prepared dataloader may synchronise, by the library's broadcast
_RNG_TYPES = (RNGType.TORCH.value, RNGType.GENERATOR.value)
# a prepared dataloader -> the dataloader it was prepared from (the next round prepares that one again)
_originals: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _reset_accelerate() -> None:
    """Empty accelerate's process-wide singletons: the next ``Accelerator``
    fills them from the default group (the round's)."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


class InPlaceAccelerator(Accelerator):  # type: ignore[misc]
    """An ``Accelerator`` on the round's group ``pg`` (from
    :func:`inplace.process_group` or :func:`inplace.group`), made once per
    round (see the module's docstring). Takes ``Accelerator``'s keyword
    arguments; pass ``cpu=True`` (without it accelerate sets up no
    distributed training on a host without GPUs, and NCCL on one with)."""

    def __init__(self, pg: Any, **kwargs: Any) -> None:
        if isinstance(pg, inplace._Over):  # the round ended while its group formed
            raise MembershipChanged(pg._reason)
        if id(pg) not in inplace._rounds:
            raise ValueError("InPlaceAccelerator: pg must come from inplace.process_group() or inplace.group()")
        if torch.distributed.distributed_c10d._get_default_group() not in (pg, inplace_backend._made.get(id(pg))):
            raise ValueError("InPlaceAccelerator: pg is not the default group (a later group was made)")
        for handler in kwargs.get("kwargs_handlers") or ():
            if isinstance(handler, DistributedDataParallelKwargs) and _value(handler.comm_hook) != "no":
                raise ValueError("InPlaceAccelerator: a DDP comm_hook is not supported (the hook is rdzv's)")
        for rng in kwargs.get("rng_types") or ():
            if _value(rng) not in _RNG_TYPES:
                raise ValueError(f"InPlaceAccelerator: rng_types {rng!r} not supported (only {', '.join(_RNG_TYPES)})")
        _reset_accelerate()
        self.pg = pg
        self._plain_type = False  # while True, accelerate's prepare_model sees no distributed setup (no DDP of its own)
        try:
            super().__init__(**kwargs)
            refused = None
            if self.state.distributed_type != DistributedType.MULTI_CPU:
                refused = f"gloo on CPU only (pass cpu=True); accelerate set up {self.state.distributed_type}"
            elif self.state.dynamo_plugin.backend != DynamoBackend.NO:
                refused = "torch.compile (dynamo_backend) is not supported"
            elif (self.num_processes, self.process_index) != (pg.size(), pg.rank()):
                seen = f"rank {self.process_index} of {self.num_processes}"
                refused = f"accelerate sees {seen}, the group rank {pg.rank()} of {pg.size()}"
            if refused is not None:
                raise ValueError(f"InPlaceAccelerator: {refused}")
        except BaseException:
            _reset_accelerate()  # no half-made state is left for the next Accelerator
            raise

    # ---------------------------------------------------------- prepare

    @property
    def distributed_type(self) -> Any:
        return DistributedType.NO if self._plain_type else self.state.distributed_type

    def prepare_model(
        self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> Any:
        """accelerate's ``prepare_model`` (device placement, autocast) with
        the DDP made by :func:`inplace.ddp` on the round's group."""
        module = _unwrap_model(model)
        if evaluation_mode or not any(p.requires_grad for p in module.parameters()):
            return super().prepare_model(module, device_placement, evaluation_mode)
        self._plain_type = True
        try:
            module = super().prepare_model(module, device_placement, evaluation_mode)
        finally:
            self._plain_type = False
        module.__dict__.pop("_is_accelerate_prepared", None)  # the DDP is what is prepared
        kwargs = self.ddp_handler.to_kwargs() if self.ddp_handler is not None else {}
        ddp = inplace.ddp(module, self.pg, **kwargs)
        self._models[self._models.index(module)] = ddp
        return ddp

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        while isinstance(optimizer, AcceleratedOptimizer):  # an earlier round's
            optimizer = optimizer.optimizer
        return super().prepare_optimizer(optimizer, device_placement)

    def prepare_scheduler(self, scheduler: Any) -> Any:
        while isinstance(scheduler, AcceleratedScheduler):
            scheduler = scheduler.scheduler
        return super().prepare_scheduler(scheduler)

    def prepare_data_loader(
        self, data_loader: Any, device_placement: bool | None = None, slice_fn_for_dispatch: Any = None
    ) -> Any:
        """accelerate's, sharded for this round; its random-state
        synchronisation (a blocking broadcast at each epoch's start) goes
        through the library's broadcast, waited in slices."""
        original = _originals.get(data_loader, data_loader)
        prepared = super().prepare_data_loader(original, device_placement, slice_fn_for_dispatch)
        if isinstance(prepared, DataLoaderDispatcher):
            self._dataloaders.remove(prepared)
            raise ValueError(
                "InPlaceAccelerator: dispatch_batches is not supported (a blocking broadcast per batch): "
                "pass DataLoaderConfiguration(dispatch_batches=False)"
            )
        _originals[prepared] = original
        rng_types = [_value(r) for r in (getattr(prepared, "rng_types", None) or ())]
        if rng_types:
            prepared.rng_types = None  # accelerate's own broadcast: blocking, on the default group
            prepared.begin = _synchronising(prepared.begin, rng_types, prepared.synchronized_generator, self.pg)
        return prepared

    # ---------------------------------------------------------- state

    def sync_state(self, world: World, step: int) -> int:
        """Bring every rank of the round to the state of the rank with the
        highest ``step`` (the lowest such rank): every prepared model,
        optimizer and scheduler and every object registered for
        checkpointing, broadcast from it in memory. Returns that step: it
        never goes back. Call it after ``prepare``, every rank with the same
        objects prepared."""
        objs = self._state_objects()
        counts = [len(self._models), len(self._optimizers), len(self._schedulers), len(self._custom_objects)]
        top, src = inplace.most_advanced(self.pg, world, step)
        blob = None
        if world.rank == src:
            buf = io.BytesIO()
            torch.save({"counts": counts, "states": [o.state_dict() for o in objs]}, buf)
            blob = buf.getvalue()
        data = inplace.broadcast_bytes(blob, self.pg, world.rank, src)
        if world.rank != src:
            state = torch.load(io.BytesIO(data), weights_only=True)
            if state["counts"] != counts:
                raise ValueError(
                    f"InPlaceAccelerator.sync_state: rank {src} prepared (models, optimizers, schedulers, "
                    f"checkpointed objects) {state['counts']}, this rank {counts}"
                )
            for obj, sd in zip(objs, state["states"], strict=True):
                obj.load_state_dict(sd)
        return top

    def _state_objects(self) -> list[Any]:
        models = [extract_model_from_parallel(m) for m in self._models]
        optimizers = [o.optimizer for o in self._optimizers]
        schedulers = [s.scheduler for s in self._schedulers]
        return [*models, *optimizers, *schedulers, *self._custom_objects]

    # ---------------------------------------------------------- collectives

    def wait_for_everyone(self) -> None:
        inplace.wait(self.pg.barrier())

    def gather(self, tensor: Any) -> Any:
        return _membership(super().gather, tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        return _membership(super().gather_for_metrics, input_data, use_gather_object)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        return _membership(super().reduce, tensor, reduction, scale)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        return _membership(super().pad_across_processes, tensor, dim, pad_index, pad_first)


def _value(x: Any) -> str:
    """An accelerate enum member or its string, as the string."""
    return str(getattr(x, "value", x))


def _unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module under an earlier round's DDP, its forward as it was before
    accelerate's autocast wrapper (the next prepare wraps it again)."""
    module: torch.nn.Module = extract_model_from_parallel(model, keep_fp32_wrapper=False)
    if module is not model:
        module.__dict__.pop("_is_accelerate_prepared", None)
    return module


def _synchronising(begin: Callable[[], None], rng_types: list[str], generator: Any, pg: Any) -> Callable[[], None]:
    """A dataloader's ``begin`` (run at the start of each epoch's iteration)
    that first takes rank 0's random states, as accelerate's
    ``synchronize_rng_states`` does, by :func:`inplace.broadcast`."""

    def start() -> None:
        for kind in rng_types:
            if kind == RNGType.TORCH.value:
                state = torch.get_rng_state()
                inplace.broadcast(state, pg, 0)
                torch.set_rng_state(state)
            elif generator is not None:
                state = generator.get_state()
                inplace.broadcast(state, pg, 0)
                generator.set_state(state)
        begin()

    return start


def _membership(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, one of accelerate's blocking collectives: its failure
    (a peer lost) raises :class:`MembershipChanged` in in-place mode."""
    try:
        return fn(*args)
    except RuntimeError as e:
        inplace._raise_membership(e)
