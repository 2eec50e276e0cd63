"""FSDP2 (``torch.distributed.fsdp.fully_shard``) in place (docs/inplace.md, "An FSDP2
script, in place").

Per round: :func:`mesh` gives a ``DeviceMesh`` on the round's group made
interruptible (:mod:`rdzv_client.inplace_backend`: FSDP2's all-gathers and
reduce-scatters, DTensor's and DCP's collectives raise
:class:`~rdzv_client.worker.MembershipChanged` the moment the agent says the
round is over), the script shards a freshly built model on it, and
:func:`resume` loads the last complete :func:`save` (a
``torch.distributed.checkpoint`` directory per saved step) into it: DCP
reshards it for the round's world size. A lost node's shards exist nowhere
else, so every rank of a new round, survivors, newcomers and a rank-0
replacement alike, goes back to the last save: ``save`` every K steps and a
round change costs at most K steps (plus the load), never a process start.

Checkpoints: ``<dir>/step-<N>``, complete once DCP wrote its ``.metadata``
(written last, by a rename, after every rank's files); rank 0 keeps the
``keep`` newest complete ones. The directory must be one every rank reads
and writes (a shared file system across hosts).

This module imports torch; :mod:`rdzv_client.worker` does not.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import DeviceMesh

from . import inplace, worker
from .inplace_backend import InterruptibleGroup, interruptible

__all__ = ["mesh", "resume", "save", "latest"]

_STEP_DIR = re.compile(r"^step-(\d{9})$")
# the file DCP writes last (by a rename from .metadata.tmp): a save is complete once it exists
_COMPLETE = ".metadata"


def mesh(pg: Any, device_type: str = "cpu") -> DeviceMesh:
    """A 1-D ``DeviceMesh`` over the round's group ``pg``, its collectives
    interruptible (:func:`rdzv_client.inplace_backend.interruptible`, made the
    default group): ``fully_shard(module, mesh=inplace_fsdp.mesh(pg))``.

    Its dimension is named after the round (``round<N>``): torch compares
    meshes by their ranks, layout, device type and dimension names, never by
    their groups, and DTensor's caches hand out the mesh they met first, so
    an unnamed mesh of a later round with the same ranks (3 -> 2 -> 3 nodes)
    came back as the earlier round's, on its abandoned group (seen: "Could
    not resolve the process group registered under the name
    rdzv-round0-...")."""
    group = interruptible(pg)
    return DeviceMesh.from_group(group, device_type, mesh_dim_names=(f"round{group.round.round}",))


def _dir(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f"step-{step:09d}"


def _steps(root: str | os.PathLike[str]) -> list[int]:
    """The steps of the saves under ``root``, complete or not."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return [int(m.group(1)) for n in names if (m := _STEP_DIR.match(n))]


def _complete(root: str | os.PathLike[str]) -> list[int]:
    return sorted(s for s in _steps(root) if (_dir(root, s) / _COMPLETE).exists())


def latest(root: str | os.PathLike[str]) -> int:
    """The step of the newest complete save under ``root`` (-1: none)."""
    return max(_complete(root), default=-1)


def _group(model: torch.nn.Module) -> InterruptibleGroup:
    """The interruptible group ``model`` is sharded on (its first DTensor's mesh)."""
    for p in model.parameters():
        spec = getattr(p, "device_mesh", None)
        if spec is not None:
            g = spec.get_group()
            if isinstance(g, InterruptibleGroup):
                if g.round.over is not None:
                    raise worker.MembershipChanged(g.round.over)
                return g
    raise ValueError("the model is not sharded on a mesh from inplace_fsdp.mesh(pg) (fully_shard(..., mesh=...))")


def _state(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def resume(root: str | os.PathLike[str], model: torch.nn.Module, optimizer: Any) -> int:
    """Load the newest complete save under ``root`` into ``model`` (sharded by
    ``fully_shard`` on :func:`mesh`) and ``optimizer``, resharded for this
    round's world size, and return its step (0, nothing loaded, if there is
    none). Every rank of the round calls it; they agree on the step (the
    lowest newest one any rank sees). Each forward of ``model`` is then a
    :func:`worker.progress` call (the agent's hang watch; it raises
    :class:`MembershipChanged` once the round is over)."""
    group = _group(model)
    mine = torch.tensor([latest(root)], dtype=torch.int64)
    step = int(inplace.all_reduce(mine, group.inner, dist.ReduceOp.MIN).item())
    if step >= 0:
        state = _state(model, optimizer)
        _guarded(lambda: dcp_load(state, checkpoint_id=str(_dir(root, step)), process_group=group))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if not getattr(model, "_rdzv_watched", False):
        model.register_forward_pre_hook(lambda *_: worker.progress())
        model._rdzv_watched = True  # type: ignore[assignment]
    return max(step, 0)


def save(root: str | os.PathLike[str], model: torch.nn.Module, optimizer: Any, step: int, keep: int = 2) -> None:
    """Save ``model`` and ``optimizer`` (every rank its shards, by DCP) as
    ``step`` under ``root``; rank 0 then deletes all but the ``keep`` newest
    complete saves. A round change during the save raises
    :class:`MembershipChanged`; the save it interrupted is incomplete (no
    ``.metadata``) and never loaded."""
    if keep < 1:
        raise ValueError(f"save(keep={keep}): at least 1")
    if step < 0:
        raise ValueError(f"save(step={step}): a step is >= 0")
    group = _group(model)
    target = _dir(root, step)
    if group.rank() == 0:
        Path(root).mkdir(parents=True, exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)  # an earlier, interrupted save of this step
    state = _state(model, optimizer)
    # every rank past rank 0's cleanup before anyone writes (DCP's first collective comes after its planning)
    inplace.all_reduce(torch.zeros(1), group.inner)
    _guarded(lambda: dcp_save(state, checkpoint_id=str(target), process_group=group))
    if group.rank() == 0:
        complete = _complete(root)
        for s in _steps(root):
            if s not in complete[-keep:] and s < step:
                shutil.rmtree(_dir(root, s), ignore_errors=True)


def _guarded(call: Any) -> None:
    """``call()``, for DCP: its collectives raise :class:`MembershipChanged`
    themselves; any other error (DCP gathers its ranks' errors into a
    ``CheckpointException``, a ``BaseException``) raised once the round is
    over is :class:`MembershipChanged` too."""
    try:
        call()
    except worker.MembershipChanged:
        raise
    except BaseException:
        worker.check()
        raise
