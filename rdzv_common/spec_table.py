"""The job spec's fields, one table: what the first join of a job fixes for its
life (see ``JobSpec`` in :mod:`rdzv_common.protocol`).

Each :class:`SpecField` says a field's name, kind and bounds, its default, the
rdzv-agent flag that sets it (with its help), the ``--rdzv-conf`` key that sets
it under torchrun (and the plugin's own default, where it differs), and whether
a job record leaves it out at its default. Everything else reads this table:

* :func:`check_spec` (the pydantic-free check the agent runs before its first
  join, re-exported by :mod:`rdzv_common.wire`);
* the records of :mod:`rdzv_server.rounds.records` (:func:`spec_record`,
  :func:`spec_from_record`);
* rdzv-agent's flags and the ``--rdzv-conf`` keys of both the agent and the
  torchrun plugin (:mod:`rdzv_client.spec_flags`).

``JobSpec`` stays the pydantic model the server validates with (typed fields
for the code that reads them); tests/unit/test_spec_table.py holds it equal to
this table, field for field: names and order, defaults, and what each takes
and refuses. Adding a field: CONTRIBUTING.md, "Adding a job spec field".

This module imports nothing of ours (the agent's start-up path imports it,
the client as well as the server).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

# The bounds of spec fields (and, for MAX_NODES, of ranks on the wire).
MAX_NODES = 100_000
MAX_RESTARTS = 1_000_000
MAX_TIMEOUT_S = 7 * 24 * 3600.0

# A running node whose steps/s stays below straggler_fraction x the job's median for
# straggler_window_s is a straggler; the policy says what then: "warn" (flag only) or
# "replace" (a waiting spare takes its place in a new round).
STRAGGLER_POLICIES = ("warn", "replace")
RESTART_MODES = ("process", "in-place")  # design.md "In-place re-formation"

Kind = Literal["count", "seconds", "fraction", "choice"]


class _Same:
    def __repr__(self) -> str:
        return "SAME"


SAME: Final = _Same()  # SpecField.plugin_default: the table's default


@dataclass(frozen=True)
class SpecField:
    """One job spec field.

    ``kind``: "count" (an int in [lo, hi]), "seconds" (a finite number in
    (lo, hi], a float on the wire), "fraction" (as seconds, without the unit),
    "choice" (one of ``choices``). ``off``: None is taken too (the feature is
    off). ``required``: no default (``min_nodes``, ``max_nodes``).
    """

    name: str
    kind: Kind
    default: Any
    help: str = ""  # rdzv-agent's flag help (argparse's %(default)s works)
    flag: str | None = None  # rdzv-agent's flag; None: set another way (--nnodes)
    aliases: tuple[str, ...] = ()  # the flag's other spellings (torchrun's)
    pet: bool = False  # torchrun's PET_<NAME> variable gives the flag's default
    lo: float = 0
    hi: float = MAX_TIMEOUT_S
    choices: tuple[str, ...] = ()
    off: bool = False
    required: bool = False
    conf: str | None = None  # the torchrun plugin's --rdzv-conf key
    agent_conf: bool = False  # rdzv-agent reads the --rdzv-conf key too (torchrun's own keys)
    plugin_default: Any = SAME  # under torchrun, when --rdzv-conf does not say
    saved_at_default: bool = False  # False: a job record leaves it out at its default (older code reads it)

    def check(self, value: Any) -> Any:
        """``value`` as the plain JSON ``JobSpec`` writes, or ValueError naming the field."""
        name = self.name
        if value is None and self.off:
            return None
        if self.kind == "count":
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}: must be an integer, got {value!r}")
            if not self.lo <= value <= self.hi:
                raise ValueError(f"{name}: must be between {self.lo} and {self.hi}, got {value}")
            return value
        if self.kind == "choice":
            if value not in self.choices:
                raise ValueError(f"{name}: must be one of {', '.join(self.choices)}, got {value!r}")
            return value
        unit = " seconds" if self.kind == "seconds" else ""
        number = not isinstance(value, bool) and isinstance(value, (int, float))
        if not number and unit:
            raise ValueError(f"{name}: must be a number of seconds, got {value!r}")
        if not number or not math.isfinite(value) or not self.lo < value <= self.hi:
            raise ValueError(f"{name}: must be more than {self.lo:g} and at most {self.hi:g}{unit}, got {value!r}")
        return float(value)

    def parse(self, text: Any) -> Any:
        """A flag's or a ``--rdzv-conf`` value (text) as this field's type; ValueError if it is none."""
        return int(text) if self.kind == "count" else float(text) if self.kind in ("seconds", "fraction") else text


_PART = " (part of the job spec)"

# In JobSpec's order (the order of a join's "spec" object on the wire).
SPEC_FIELDS: Final[tuple[SpecField, ...]] = (
    SpecField("min_nodes", "count", None, lo=1, hi=MAX_NODES, required=True, saved_at_default=True),
    SpecField("max_nodes", "count", None, lo=1, hi=MAX_NODES, required=True, saved_at_default=True),
    SpecField(
        "max_restarts",
        "count",
        3,
        "restarts after worker failures before the job fails (default %(default)s; torchrun: 0)",
        flag="--max-restarts",
        aliases=("--max_restarts",),
        pet=True,
        lo=0,
        hi=MAX_RESTARTS,
        conf="max_restarts",
        plugin_default=MAX_RESTARTS,  # torchrun keeps its own budget (--max-restarts)
        saved_at_default=True,
    ),
    SpecField(
        "last_call_s",
        "seconds",
        1.0,
        "seconds the first round waits for more nodes once min is reached",
        flag="--last-call",
        conf="last_call_timeout",
        agent_conf=True,
        saved_at_default=True,
    ),
    SpecField(
        "heartbeat_timeout_s",
        "seconds",
        6.0,
        "seconds of silence after which the server evicts a node",
        flag="--heartbeat-timeout",
        saved_at_default=True,
    ),
    SpecField(
        "join_timeout_s",
        "seconds",
        600.0,
        "seconds a job below min nodes waits for more before it fails",
        flag="--join-timeout",
        conf="join_timeout",
        agent_conf=True,
        saved_at_default=True,
    ),
    SpecField(
        "scale_up_window_s",
        "seconds",
        0.5,
        "seconds new nodes are batched before one scale-up round",
        flag="--scale-up-window",
        saved_at_default=True,
    ),
    SpecField(
        "hang_timeout_s",
        "seconds",
        None,
        "a worker that called rdzv_client.worker.progress() and then goes this many seconds without "
        "another call is hung: its stacks are dumped and the round restarts (default: off; part of the job spec)",
        flag="--hang-timeout",
        off=True,
    ),
    SpecField(
        "storm_restarts",
        "count",
        3,  # restarts in a row without progress that stop a job (0: off)
        "the job fails (agents exit 4, do not requeue) after this many restarts in a row without progress: "
        "no rank's progress() step beyond the highest seen when the round began, and no round lasting "
        "--min-round-s; 0: off; --max-restarts stays the hard budget" + _PART,
        flag="--storm-restarts",
        lo=0,
        hi=MAX_RESTARTS,
        conf="storm_restarts",
        plugin_default=0,  # off under torchrun: it keeps its own budget, and its exit code cannot say "no progress"
    ),
    SpecField(
        "min_round_s",
        "seconds",
        60.0,  # a round that ran this long made progress (scripts that never call progress())
        "a round that ran this many seconds made progress, for restart storms" + _PART,
        flag="--min-round-s",
        conf="min_round_s",
    ),
    SpecField(
        "straggler_policy",
        "choice",
        "warn",
        "what the server does with a straggler (a node below --straggler-fraction of the job's median "
        "progress() steps/s for --straggler-window-s): warn (flag it) or replace (a waiting spare takes its "
        "place in a new round at once; with no spare it is flagged only); part of the job spec",
        flag="--straggler-policy",
        choices=STRAGGLER_POLICIES,
    ),
    SpecField(
        "straggler_fraction",
        "fraction",
        0.5,
        "a node below this fraction of the job's median steps/s may be a straggler" + _PART,
        flag="--straggler-fraction",
        hi=1,
    ),
    SpecField(
        "straggler_window_s",
        "seconds",
        30.0,
        "seconds a node must stay below the fraction to be a straggler" + _PART,
        flag="--straggler-window-s",
    ),
    SpecField(
        "restart_mode",
        "choice",
        "process",
        "on a round change: 'process' stops and starts the workers; 'in-place' keeps survivors' workers and "
        "hands them the new round over the worker channel (rdzv_client.worker.rounds(); part of the job spec)",
        flag="--restart-mode",
        choices=RESTART_MODES,
    ),
    SpecField(
        "in_place_timeout_s",
        "seconds",
        10.0,  # a worker must reach its safe point this fast after a round change
        "in-place mode: seconds a worker has to reach its safe point after a round change before its "
        "node's workers are restarted the process way" + _PART,
        flag="--in-place-timeout",
    ),
    SpecField(
        "straggler_score",
        "fraction",
        0.75,  # NVRx's threshold: median / own compute
        "a rank whose compute score (the job's median compute fraction over its own; ranks that report "
        "timings, lock-step training) stays below this for --straggler-window-s is a straggler" + _PART,
        flag="--straggler-score",
        hi=1,
    ),
)
FIELDS: Final[Mapping[str, SpecField]] = {f.name: f for f in SPEC_FIELDS}
DEFAULTS: Final[Mapping[str, Any]] = {f.name: f.default for f in SPEC_FIELDS if not f.required}

# The defaults by name, for the code and the models that read them.
DEFAULT_MAX_RESTARTS: Final[int] = DEFAULTS["max_restarts"]
DEFAULT_LAST_CALL_S: Final[float] = DEFAULTS["last_call_s"]
DEFAULT_HEARTBEAT_TIMEOUT_S: Final[float] = DEFAULTS["heartbeat_timeout_s"]
DEFAULT_JOIN_TIMEOUT_S: Final[float] = DEFAULTS["join_timeout_s"]
DEFAULT_SCALE_UP_WINDOW_S: Final[float] = DEFAULTS["scale_up_window_s"]
DEFAULT_STORM_RESTARTS: Final[int] = DEFAULTS["storm_restarts"]
DEFAULT_MIN_ROUND_S: Final[float] = DEFAULTS["min_round_s"]
DEFAULT_STRAGGLER_POLICY: Final[Literal["warn", "replace"]] = DEFAULTS["straggler_policy"]
DEFAULT_STRAGGLER_FRACTION: Final[float] = DEFAULTS["straggler_fraction"]
DEFAULT_STRAGGLER_WINDOW_S: Final[float] = DEFAULTS["straggler_window_s"]
DEFAULT_STRAGGLER_SCORE: Final[float] = DEFAULTS["straggler_score"]
DEFAULT_RESTART_MODE: Final[Literal["process", "in-place"]] = DEFAULTS["restart_mode"]
DEFAULT_IN_PLACE_TIMEOUT_S: Final[float] = DEFAULTS["in_place_timeout_s"]


def check_spec(**values: Any) -> dict[str, Any]:
    """A job spec as the plain JSON object ``JobSpec`` serializes to (every
    field, in its order; the table's defaults for those not given), or
    ValueError naming the field: the same rules as ``JobSpec``, without
    pydantic. An unknown or missing required field is a TypeError, as for a
    call with a wrong keyword."""
    unknown = sorted(set(values) - FIELDS.keys())
    if unknown:
        raise TypeError(f"check_spec() got unexpected keyword arguments: {', '.join(unknown)}")
    missing = [f.name for f in SPEC_FIELDS if f.required and f.name not in values]
    if missing:
        raise TypeError(f"check_spec() missing required keyword arguments: {', '.join(missing)}")
    out = {f.name: f.check(values.get(f.name, f.default)) for f in SPEC_FIELDS}
    if out["min_nodes"] > out["max_nodes"]:
        raise ValueError(f"min_nodes ({out['min_nodes']}) is greater than max_nodes ({out['max_nodes']})")
    return out


def spec_record(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A spec (``JobSpec.model_dump()``) as a job record keeps it: the fields
    that are not ``saved_at_default`` are left out at their defaults, so a job
    that never used them saves what older code wrote and reads."""
    return {k: v for k, v in spec.items() if FIELDS[k].saved_at_default or v != FIELDS[k].default}


def spec_from_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """A record's spec with the table's defaults for the fields it left out."""
    return {**DEFAULTS, **record}
