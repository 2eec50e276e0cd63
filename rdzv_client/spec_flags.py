"""The job spec's side of the command line, from the one table
(:data:`rdzv_common.spec_table.SPEC_FIELDS`): rdzv-agent's flags for the spec's
fields, the ``--rdzv-conf`` keys that set them (rdzv-agent's and the torchrun
plugin's), and the checked spec built from them, once.

A field's flag, help, type, bounds, default and ``--rdzv-conf`` key are its
table entry's; nothing here names a field."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from rdzv_common.spec_table import SAME, SPEC_FIELDS, SpecField, check_spec

from .torchrun_flags import pet

SPEC_GROUP = "job spec (the first node's values hold for the job's life; every other node must pass the same)"


def _flagged() -> list[SpecField]:
    return [f for f in SPEC_FIELDS if f.flag is not None]


def _default(f: SpecField) -> Any:
    """The flag's default: torchrun's PET_<NAME> variable where the table says so, else the table's."""
    text = pet(f.name) if f.pet else None
    return f.default if text is None else f.parse(text)


def add_spec_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per spec field that has one, in the table's order, in a group of their own."""
    group = parser.add_argument_group(SPEC_GROUP)
    for f in _flagged():
        assert f.flag is not None
        kwargs: dict[str, Any] = {"dest": f.name, "default": _default(f), "help": f.help}
        kwargs["metavar"] = f.flag.lstrip("-").upper().replace("-", "_")  # as argparse names it from the flag
        if f.choices:
            kwargs.update(choices=f.choices, metavar=None)
        else:
            kwargs["type"] = int if f.kind == "count" else float
        group.add_argument(f.flag, *f.aliases, **kwargs)


def conf_spec(get: Callable[[str], Any], *, plugin: bool) -> dict[str, Any]:
    """The spec fields that ``--rdzv-conf`` keys set, as their types (not
    checked yet: :func:`check_spec` does that). ``get(key)``: the key's text, or
    None when not given. rdzv-agent (``plugin=False``) reads the keys the table
    marks ``agent_conf`` (its flags set the rest); the torchrun plugin reads
    every key, each field at the plugin's default where the key is not given.
    ValueError: a value that is not of its field's type."""
    out: dict[str, Any] = {}
    for f in SPEC_FIELDS:
        if f.conf is None or not (plugin or f.agent_conf):
            continue
        text = get(f.conf)
        if text is not None:
            out[f.name] = f.parse(text)
        elif plugin and f.plugin_default is not SAME:
            out[f.name] = f.plugin_default
    return out


def spec_from_args(args: argparse.Namespace, conf: dict[str, Any], *, min_nodes: int, max_nodes: int) -> dict[str, Any]:
    """The job spec of rdzv-agent's command line, checked (ValueError naming
    the field): ``--nnodes``, each field's flag, ``conf`` (from
    :func:`conf_spec`) over the flags."""
    values: dict[str, Any] = {"min_nodes": min_nodes, "max_nodes": max_nodes}
    values.update({f.name: getattr(args, f.name) for f in _flagged()})
    values.update(conf)
    return check_spec(**values)
