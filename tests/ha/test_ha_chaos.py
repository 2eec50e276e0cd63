"""A seeded, bounded chaos run against HA replicas (issue 11), everything real.

A 3-member etcd (tests/helpers/etcd.py), 3 rdzv-server replicas on it
(tests/helpers/ha.py), 3 agents given every replica (``--endpoint a,b,c``,
``--nnodes 2:3``) running examples/train_ddp.py with checkpoints (real gloo
workers). ``random.Random(seed)`` orders a fixed number of events, every kind
at least once:

* ``kill_leader``: SIGKILL the leading replica; once another leads, and a
  random while later, the killed one starts again on its port;
* ``kill_etcd``: SIGKILL a random etcd member; a random while later it starts
  again on its data dir and ports (one member down at a time: quorum holds);
* ``kill_node``: a node dies (its agent and workers SIGKILLed) and a new agent
  is started for it; the new one is started first and queued for a scale-up,
  so that the next round takes it in the dead one's place
  (``--scale-up-window 3``), as in tests/faults/test_chaos.py.

Event k fires once the checkpoint has reached step ``(k - 1/2) * STRIDE`` and at
least ``SPACING_S`` after the previous one ended (about 40 s of chaos in
all), so every event happens while training still has work left. Checked
throughout (the job's REST view from whichever replica leads, and the
checkpoint, sampled every poll) and at the end, the invariants of
tests/faults/test_chaos.py: the job succeeds; the checkpoint step never goes
back; round numbers only grow (across leaders); no (round, group rank) ever
had two nodes, in the views nor in the agents' logs; the history has every
round with its reason; no live node was evicted. Beyond those: leader and
etcd kills open no round (at most two rounds per node killed), and etcd's
history shows no replica writing job or host state outside its leadership.

Reproduce a run with ``RDZV_CHAOS_SEED=<seed>`` (printed at the start and in
every assertion message); ``RDZV_CHAOS_EVENTS`` changes the number of events (3 by default, each kind once in a
drawn order: the suite's time bound; every run draws a new seed, so runs cover the orders, and a
larger RDZV_CHAOS_EVENTS the repeats).
"""

from __future__ import annotations

import os
import random
import time
import urllib.error
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.chaos import ChaosMonitor, agent_flags, check_the_end, draw_plan
from tests.helpers.cluster import TRAIN
from tests.helpers.ha import HAServers, Replica, fencing_violations
from tests.helpers.procs import Proc, wait_healthy

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SEED = int(os.environ.get("RDZV_CHAOS_SEED", str(random.SystemRandom().randrange(1 << 16))))
N_EVENTS = int(os.environ.get("RDZV_CHAOS_EVENTS", "3"))
KINDS = ("kill_leader", "kill_etcd", "kill_node")
STRIDE = 20  # checkpoint steps between two events (a leader kill and restart lasts about that long)
SPACING_S = 2.0  # and at least this long after the previous one ended (things settle)
STEPS = (N_EVENTS + 1) * STRIDE + STRIDE // 2  # what is left after the last event: 1.5 strides
NODES = 3
JOB = "hachaos"
HB_TIMEOUT = 6.0
REASONS = ("connection lost", "no heartbeat", "worker failure", "scale-up", "left")


@dataclass
class Monitor(ChaosMonitor):
    """The job's view from whichever replica leads."""

    ha: HAServers | None = None
    _at: int = 0  # the replica that answered last

    def view(self) -> dict[str, Any] | None:
        """The job's view from the replica that leads (None: none answers it now)."""
        assert self.ha is not None
        n = len(self.ha.replicas)
        for i in range(n):
            r = self.ha.replicas[(self._at + i) % n]
            if not r.running:
                continue
            try:
                status, body = r.request("GET", f"/v1/jobs/{JOB}", timeout=1.0)
            except (OSError, urllib.error.URLError, ValueError):
                continue
            if status == 200:
                self._at = (self._at + i) % n
                return body  # type: ignore[no-any-return]
        return None

    def context(self) -> str:
        return f"\nroles: {self.ha.roles() if self.ha is not None else None}"

    def wait(self, seconds: float) -> None:
        """Keep sampling for ``seconds``."""
        end = time.monotonic() + seconds
        self.until(lambda _: time.monotonic() >= end, seconds + 30, f"{seconds:.1f}s to pass")


def at_step(k: int) -> int:
    """The checkpoint step event k (from 1) waits for: half a stride, then one more stride each."""
    return k * STRIDE - STRIDE // 2


def restart_replica(ha: HAServers, dead: Replica) -> Replica:
    """Start the (killed) replica ``dead`` again on its port, as a new process;
    it takes ``dead``'s place in ``ha.replicas``; returns once /healthz answers."""
    n = sum(1 for p in ha.cluster.procs if p.name.startswith(dead.name.split(".")[0]))
    name = f"{dead.name.split('.')[0]}.run{n + 1}"
    argv = ha.argv(dead.port, list(dead.etcd))
    replica: Replica = ha.cluster.start(name, argv, cls=Replica, port=dead.port, index=dead.index, etcd=dead.etcd)
    assert wait_healthy(replica, 30), f"{name} exited at once:\n{replica.text()[-3000:]}"
    ha.replicas[ha.replicas.index(dead)] = replica
    return replica


@pytest.mark.timeout(170)
def test_seeded_ha_chaos(ha: HAServers, tmp_path: Path) -> None:
    print(f"\n[ha chaos] seed {SEED} ({N_EVENTS} events; RDZV_CHAOS_SEED={SEED} reproduces this run)")
    rng = random.Random(SEED)
    plan = draw_plan(rng, KINDS, N_EVENTS)

    ha.start(3)
    ckpt = tmp_path / "ckpt"
    mon = Monitor(SEED, ckpt, ha, label="ha chaos")
    n_agents = 0

    def new_agent() -> Proc:
        nonlocal n_agents
        n_agents += 1
        return ha.start_agent(
            JOB,
            TRAIN,
            "--ckpt-dir",
            str(ckpt),
            "--steps",
            str(STEPS),
            "--step-sleep",
            "0.3",
            "--ckpt-every",
            "2",
            "--log-every",
            "2",
            nnodes=f"2:{NODES}",
            name=f"agent{n_agents}",
            flags=agent_flags(HB_TIMEOUT),
        )

    live = [new_agent() for _ in range(NODES)]
    dead: list[Proc] = []
    started = time.monotonic()
    last_event = started
    kills = {"kill_leader": 0, "kill_etcd": 0, "kill_node": 0}

    for k, kind in enumerate(plan, start=1):
        mon.until(
            lambda v, k=k: (
                mon.step() >= at_step(k)
                and v is not None
                and v["state"] == "running"
                and time.monotonic() - last_event >= SPACING_S
            ),
            90,
            f"step {at_step(k)} before event {k} ({kind})",
        )
        at = f"{time.monotonic() - started:5.1f}s step {mon.step()} round {mon.rounds[-1] if mon.rounds else '?'}"
        kills[kind] += 1
        if kind == "kill_leader":
            old = ha.leader(timeout=30)
            ha.kill9(old)
            mon.log.append(f"{at}: kill_leader {old.name} (port {old.port})")
            new = mon.until(lambda _: _leading(ha), 30, "another replica leading")
            delay = rng.uniform(0.5, 3.0)
            mon.wait(delay)
            back = restart_replica(ha, old)
            mon.log[-1] += f"; {new.name} leads; {back.name} back after {delay:.1f}s more"
        elif kind == "kill_etcd":
            i = rng.randrange(len(ha.etcd.members))
            ha.etcd.kill(i)
            delay = rng.uniform(0.5, 3.0)
            mon.wait(delay)
            ha.etcd.restart(i)
            mon.log.append(f"{at}: kill_etcd m{i}, restarted after {delay:.1f}s")
        else:
            victim = live.pop(rng.randrange(len(live)))
            live.append(new_agent())
            mon.until(
                lambda v: v is not None and (v["spares"] or any(n["state"] == "waiting" for n in v["nodes"])),
                60,
                "the replacement queued",
            )
            ha.cluster.kill_node(victim)
            dead.append(victim)
            mon.log.append(f"{at}: kill_node {victim.name}, replaced by {live[-1].name}")
        last_event = time.monotonic()
        print(f"[ha chaos] event {k}: {mon.log[-1]}")
    chaos_s = time.monotonic() - started

    mon.until(lambda v: v is not None and v["state"] in ("succeeded", "failed", "closed"), 90, "the job's end")
    final = mon.last_view
    assert final is not None
    elapsed = time.monotonic() - started
    print(
        f"[ha chaos] seed {SEED}: {final['state']} {elapsed:.1f}s after the agents started "
        f"({chaos_s:.1f}s of chaos: {kills}), round {final['round']}, restarts {final['restarts']}, "
        f"checkpoint steps sampled {len(mon.steps)}, leaders elected {len(ha.leader_terms())}"
    )
    check_the_end(mon, final, live, dead, STEPS, REASONS)
    history = final["history"]
    # a leader or etcd member killed opens no round (failover is a server restart: nodes keep
    # their round); a node killed opens at most two: its loss, and its replacement's scale-up
    if final["round"] > 2 * kills["kill_node"]:
        mon.fail(f"{final['round']} rounds for {kills['kill_node']} node kill(s): {history}")
    problems = fencing_violations(ha.events(), ha.prefix)
    if problems:
        mon.fail(f"writes outside their leadership in etcd: {problems}")


def _leading(ha: HAServers) -> Replica | None:
    leading = [r for r in ha.replicas if r.running and r.role() == "leader"]
    return leading[0] if len(leading) == 1 else None
