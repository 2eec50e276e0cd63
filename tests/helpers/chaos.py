"""What the seeded chaos runs check, as they go and at the end: the standalone
server's (tests/faults/test_chaos.py) and the HA replicas' (tests/ha/test_ha_chaos.py).

:class:`ChaosMonitor` samples the checkpoint and the job's view on every poll
(a subclass says where the view comes from) and fails at once if the
checkpoint step goes back, the round goes back, or a (round, group rank) is
held by two nodes. :func:`check_the_end` checks the job's end: it succeeded,
every live agent exited 0, the checkpoint reached the last step, the history
lists every round with a known reason, no live node was evicted, and the
agents' own logs agree with what REST said about ranks."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cluster import assigned_ranks
from .procs import Proc, wait_until


def draw_plan(rng: random.Random, kinds: Sequence[str], n: int) -> list[str]:
    """``n`` events in a seeded order: every kind once (when ``n`` allows), the rest drawn."""
    plan = list(kinds) + [rng.choice(kinds) for _ in range(max(0, n - len(kinds)))]
    rng.shuffle(plan)
    return plan[:n]


def agent_flags(heartbeat_timeout_s: float) -> tuple[str, ...]:
    """The chaos runs' agent flags: a budget that kills never spend, a node's
    kill and its replacement land in one round (the scale-up window), and
    --storm-restarts 0: worker kills come faster than --min-round-s and
    train_ddp.py reports no steps; chaos is not a restart storm."""
    return (
        "--heartbeat-timeout", f"{heartbeat_timeout_s:g}",
        "--max-restarts", "50",
        "--scale-up-window", "3",
        "--storm-restarts", "0",
    )  # fmt: skip


@dataclass
class ChaosMonitor:
    seed: int
    ckpt: Path
    label: str = field(default="chaos", kw_only=True)
    steps: list[int] = field(default_factory=list, kw_only=True)
    rounds: list[int] = field(default_factory=list, kw_only=True)
    owners: dict[tuple[int, int], str] = field(default_factory=dict, kw_only=True)
    last_view: dict[str, Any] | None = field(default=None, kw_only=True)
    log: list[str] = field(default_factory=list, kw_only=True)

    def view(self) -> dict[str, Any] | None:
        """The job's view now (None: no server answers it)."""
        raise NotImplementedError

    def context(self) -> str:
        """More to say when a wait fails (e.g. the replicas' roles)."""
        return ""

    def fail(self, what: str) -> None:
        raise AssertionError(f"[{self.label} seed {self.seed}] {what}\nevents: {self.log}")

    def ckpt_step(self) -> int | None:
        import torch

        try:
            return int(torch.load(self.ckpt / "checkpoint.pt", map_location="cpu", weights_only=True)["step"])
        except FileNotFoundError:
            return None

    def sample(self) -> dict[str, Any] | None:
        step = self.ckpt_step()
        if step is not None:
            if self.steps and step < self.steps[-1]:
                self.fail(f"the checkpoint went back from step {self.steps[-1]} to {step}")
            self.steps.append(step)
        view = self.view()
        if view is not None:
            if self.rounds and view["round"] < self.rounds[-1]:
                self.fail(f"round went back from {self.rounds[-1]} to {view['round']}")
            self.rounds.append(view["round"])
            if view["state"] == "running":
                seen: dict[tuple[int, int], str] = {}
                for n in view["nodes"]:
                    if n["group_rank"] is None:
                        continue
                    key = (view["round"], n["group_rank"])
                    if key in seen:
                        self.fail(f"round {key[0]} has group rank {key[1]} twice: {seen[key]}, {n['node_id']}")
                    seen[key] = n["node_id"]
                    if self.owners.setdefault(key, n["node_id"]) != n["node_id"]:
                        self.fail(f"round {key[0]} group rank {key[1]} was {self.owners[key]}, now {n['node_id']}")
            self.last_view = view
        return view

    def step(self) -> int:
        return self.steps[-1] if self.steps else 0

    def until(self, pred: Callable[[dict[str, Any] | None], Any], timeout: float, what: str) -> Any:
        try:
            return wait_until(lambda: pred(self.sample()), timeout, what, interval=0.1)
        except AssertionError as e:
            self.fail(f"{e}{self.context()}\nlast view: {json.dumps(self.last_view)[:3000]}")


def check_the_end(
    mon: ChaosMonitor,
    final: dict[str, Any],
    live: Sequence[Proc],
    dead: Sequence[Proc],
    steps: int,
    reasons: Sequence[str],
) -> None:
    """The invariants both chaos runs hold the job's end to (see the module docstring)."""
    if final["state"] != "succeeded":
        mon.fail(f"the job {final['state']}: {final.get('root_cause')}")
    for a in live:
        try:
            code = a.wait_exit(30)
        except AssertionError as e:
            mon.fail(str(e))
        if code != 0:
            mon.fail(f"{a.name} exited {code}:\n{a.text()[-2000:]}")
    if mon.ckpt_step() != steps:
        mon.fail(f"final checkpoint step {mon.ckpt_step()} != {steps}")
    history = final["history"]
    if [h["round"] for h in history] != list(range(final["round"] + 1)):
        mon.fail(f"history does not list every round: {[h['round'] for h in history]}")
    for h in history[1:]:
        if not any(r in h["reason"] for r in reasons):
            mon.fail(f"round {h['round']} has no known reason: {h['reason']!r}")
    evicted = [a.name for a in live if "evicted (" in a.text()]
    if evicted:
        mon.fail(f"live nodes were evicted (only killed nodes may be lost): {evicted}")
    told = assigned_ranks(*live, *dead)
    shared = {k: v for k, v in told.items() if len(v) > 1}
    if shared:
        mon.fail(f"(round, group rank) given to more than one node: {shared}")
    for key, node in mon.owners.items():
        if told.get(key, {node}) != {node}:
            mon.fail(f"REST said {key} is {node}, the agents say {told[key]}")
