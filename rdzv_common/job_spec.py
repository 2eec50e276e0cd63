"""What the first join of a job fixes for its life (:class:`JobSpec`: the
fields of :data:`rdzv_common.spec_table.SPEC_FIELDS`, typed) and the heartbeat
interval it implies. :mod:`rdzv_common.protocol` re-exports both."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .fields import Seconds, Strict
from .wire import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_IN_PLACE_TIMEOUT_S,
    DEFAULT_JOIN_TIMEOUT_S,
    DEFAULT_LAST_CALL_S,
    DEFAULT_MAX_RESTARTS,
    DEFAULT_MIN_ROUND_S,
    DEFAULT_SCALE_UP_WINDOW_S,
    DEFAULT_STORM_RESTARTS,
    DEFAULT_STRAGGLER_FRACTION,
    DEFAULT_STRAGGLER_POLICY,
    DEFAULT_STRAGGLER_SCORE,
    DEFAULT_STRAGGLER_WINDOW_S,
    MAX_NODES,
    MAX_RESTARTS,
    heartbeat_every,
)


class JobSpec(Strict):
    """What the first join of a job fixes for its life.

    Every later join must send the same spec, field for field; a join that
    differs is refused with ``spec_mismatch`` naming the field and both values.

    The fields are those of :data:`rdzv_common.spec_table.SPEC_FIELDS` (the one
    table: bounds, defaults, flags, records), in its order; this model gives
    them types for the code that reads them, and tests/unit/test_spec_table.py
    holds the two equal.
    """

    min_nodes: int = Field(ge=1, le=MAX_NODES)
    max_nodes: int = Field(ge=1, le=MAX_NODES)
    max_restarts: int = Field(default=DEFAULT_MAX_RESTARTS, ge=0, le=MAX_RESTARTS)
    last_call_s: Seconds = DEFAULT_LAST_CALL_S
    heartbeat_timeout_s: Seconds = DEFAULT_HEARTBEAT_TIMEOUT_S
    join_timeout_s: Seconds = DEFAULT_JOIN_TIMEOUT_S
    scale_up_window_s: Seconds = DEFAULT_SCALE_UP_WINDOW_S
    # a worker that called rdzv_client.worker.progress() and then goes this long
    # without another call is hung (see design.md "Hangs"); None: no hang detection
    hang_timeout_s: Seconds | None = None
    # restart storms (design.md "Restart storms"): the job fails, with stop
    # "no_progress", when this many restarts in a row brought no progress (no step
    # beyond the highest seen when the round started, and the round ran less than
    # min_round_s); 0: off. --max-restarts stays the hard budget.
    storm_restarts: int = Field(default=DEFAULT_STORM_RESTARTS, ge=0, le=MAX_RESTARTS)
    min_round_s: Seconds = DEFAULT_MIN_ROUND_S
    # stragglers (design.md "Hangs and progress"): a running node below
    # straggler_fraction x the job's median steps/s for straggler_window_s is
    # flagged; "replace": a waiting spare takes its place in a new round at once
    # (no spare: flagged only). Left out of records at their defaults.
    straggler_policy: Literal["warn", "replace"] = DEFAULT_STRAGGLER_POLICY
    straggler_fraction: float = Field(default=DEFAULT_STRAGGLER_FRACTION, gt=0, le=1, allow_inf_nan=False)
    straggler_window_s: Seconds = DEFAULT_STRAGGLER_WINDOW_S
    # design.md "In-place re-formation": "in-place" keeps survivors' workers on a
    # round change (they get the new assignment over the worker channel); a worker
    # that does not reach its safe point within in_place_timeout_s is restarted
    restart_mode: Literal["process", "in-place"] = "process"
    in_place_timeout_s: Seconds = DEFAULT_IN_PLACE_TIMEOUT_S
    # lock-step stragglers (design.md "Hangs and progress"): a rank whose median / own
    # compute fraction stays below this for straggler_window_s (rounds.slow_ranks)
    straggler_score: float = Field(default=DEFAULT_STRAGGLER_SCORE, gt=0, le=1, allow_inf_nan=False)

    @model_validator(mode="after")
    def _min_le_max(self) -> JobSpec:
        if self.min_nodes > self.max_nodes:
            raise ValueError(f"min_nodes ({self.min_nodes}) is greater than max_nodes ({self.max_nodes})")
        return self


def heartbeat_interval(spec: JobSpec) -> float:
    """How often agents send heartbeats: a few per timeout, at most every 2 s.
    The server says it in ``joined``; an agent uses it for its own spec until then."""
    return heartbeat_every(spec.heartbeat_timeout_s)
