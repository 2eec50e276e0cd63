"""Lock-step stragglers by their compute (rounds.slow_ranks; pure: explicit
clock). A simulated lock-step job: every rank makes the same steps, each step
lasts the slowest rank's compute plus the all-reduce, and a rank's compute
fraction over a heartbeat window is its compute / that step time (with the
window split where a rank turned slow). Heartbeats every HB_S, staggered per
node, bring each node's RankTiming of the window since its last one."""

from __future__ import annotations

import random

from test_rounds import form, join_msg, rejoin, sent, spec

from rdzv_common.protocol import AssignedMsg, RankTiming, RestartMsg, SpareMsg
from rdzv_server import rounds
from rdzv_server.rounds import slow_ranks
from rdzv_server.rounds.views import view

HB_S = 2.0  # an agent's progress heartbeats
WINDOW_S = 10.0  # the job's straggler window
COMPUTE_S, COMM_S = 0.08, 0.02  # a normal rank's compute per step, the all-reduce


def _fractions(slow: dict[str, float], names: list[str]) -> dict[str, float]:
    """Each rank's compute fraction in lock-step: ``slow`` multiplies some ranks' compute."""
    computes = {n: COMPUTE_S * slow.get(n, 1.0) for n in names}
    step = max(computes.values()) + COMM_S
    return {n: c / step for n, c in computes.items()}


class Sim:
    def __init__(self, n: int, noise: float = 0.0, seed: int = 0, **kw: object) -> None:
        self.names = [f"n{i}" for i in range(n)]
        self.job = form(self.names, spec(min_nodes=1, max_nodes=n, straggler_window_s=WINDOW_S, **kw))
        self.noise, self.rng = noise, random.Random(seed)
        self.t = 100.0
        self.slow: dict[str, float] = {}
        self.turned_at: float | None = None
        self.fx = rounds.Effects()
        self.timed = set(self.names)

    def turn_slow(self, name: str, factor: float) -> None:
        self.slow, self.turned_at = {name: factor}, self.t

    def run(self, seconds: float, until_flag: str | None = None) -> float | None:
        """Heartbeats for ``seconds``; the time a node ``until_flag`` was flagged (None: not)."""
        end = self.t + seconds
        before = _fractions({}, self.names)
        while self.t < end:
            for i, name in enumerate(self.names):
                now = self.t + i * HB_S / len(self.names)  # staggered
                node = self.job.nodes.get(name)
                if node is None or node.state != rounds.RUNNING:
                    continue
                after = _fractions(self.slow, self.names)
                share = 1.0 if self.turned_at is None else min(1.0, max(0.0, (now - self.turned_at) / HB_S))
                f = share * after[name] + (1 - share) * before[name]
                f *= 1 + self.rng.uniform(-self.noise, self.noise)
                timings = (RankTiming(local_rank=0, window_s=HB_S, steps=20, compute_s=f * HB_S, wait_s=0.0),)
                self.fx.merge(
                    rounds.heartbeat(
                        self.job,
                        name,
                        now,
                        step=int(now * 10),
                        rate=10.0,
                        timings=timings if name in self.timed else None,
                    )
                )
                if until_flag is not None and self.job.nodes[until_flag].straggler:
                    return now
            self.t += HB_S
        return None

    def flagged(self) -> set[str]:
        return {n for n, node in self.job.nodes.items() if node.straggler}


def test_the_decision_median_over_own_below_the_threshold_and_beyond_the_mad() -> None:
    # one rank computing 5x longer among equals: score 0.2, far beyond a MAD of 0
    assert [s for _, s in slow_ranks.slow([0.2, 0.2, 1.0], 0.75)] == [False, False, True]
    assert slow_ranks.slow([0.2, 0.2, 1.0], 0.75)[2][0] == 0.2
    # spread anyway: the last has score 0.6 < 0.75, but is within 3 robust deviations: no outlier
    assert not any(s for _, s in slow_ranks.slow([0.1, 0.2, 0.3, 0.4, 0.5], 0.75))
    # beyond the spread, it is
    assert [s for _, s in slow_ranks.slow([0.3, 0.31, 0.29, 0.3, 0.5], 0.75)] == [False] * 4 + [True]
    # fewer than 3 ranks: no baseline; nobody computes: nobody is slow
    assert not any(s for _, s in slow_ranks.slow([0.1, 1.0], 0.75))
    assert not any(s for _, s in slow_ranks.slow([0.0, 0.0, 0.0, 0.5], 0.75))
    # fast ranks are never slow, whatever their score
    assert not any(s for _, s in slow_ranks.slow([0.1, 0.5, 0.5, 0.5], 0.75))


def test_a_rank_5x_slower_is_flagged_within_2_windows_and_only_it() -> None:
    sim = Sim(3, noise=0.05)
    assert sim.run(60) is None and not sim.flagged()  # equal ranks: no flag
    sim.turn_slow("n2", 5.0)
    at = sim.run(3 * WINDOW_S, until_flag="n2")
    assert at is not None and sim.turned_at is not None
    windows = (at - sim.turned_at) / WINDOW_S
    assert windows <= 2, windows
    assert sim.flagged() == {"n2"}
    node = sim.job.nodes["n2"]
    assert node.slow_rank is not None and node.slow_rank.local_rank == 0 and node.slow_rank.ratio < 0.3
    # an event names the rank, the host, the ratio and the window; a failure counts against its host
    flags = [ev for ev in sim.fx.events if ev.kind == "straggler_flagged"]
    assert len(flags) == 1 and flags[0].node == "n2"
    f = flags[0].fields
    assert f["host"] == "n2" and f["rank"] == 2 and f["ratio"] < 0.3 and f["window_s"] >= WINDOW_S
    assert "rank 2" in flags[0].text and "n2" in flags[0].text
    assert [h for h, _ in sim.fx.host_failures] == ["n2"]
    # the view says the same
    nodes = {n.node_id: n for n in view(sim.job, at).nodes}
    v = nodes["n2"].slow_rank
    assert nodes["n2"].straggler and v is not None and v.rank == 2 and v.ratio < 0.3 and v.window_s >= WINDOW_S
    assert not nodes["n0"].straggler and nodes["n0"].slow_rank is None
    # it stays flagged without another event; it recovers: unflagged, said once
    sim.run(20)
    assert len([ev for ev in sim.fx.events if ev.kind == "straggler_flagged"]) == 1
    sim.slow = {}
    sim.fx = rounds.Effects()
    sim.run(2 * HB_S)
    assert not sim.flagged()
    assert len([ln for ln in sim.fx.logs if "no longer a straggler" in ln]) == 1


def test_a_rank_1_5x_slower_is_flagged_within_3_windows() -> None:
    sim = Sim(4, noise=0.05, seed=1)
    sim.run(40)
    sim.turn_slow("n1", 1.5)
    at = sim.run(5 * WINDOW_S, until_flag="n1")
    assert at is not None and sim.turned_at is not None
    assert (at - sim.turned_at) / WINDOW_S <= 3
    assert sim.flagged() == {"n1"}


def test_equal_ranks_with_noise_are_never_flagged() -> None:
    for n, noise in ((3, 0.1), (8, 0.2), (16, 0.25)):
        sim = Sim(n, noise=noise, seed=n)
        sim.run(2000)  # 1000 heartbeats a node
        assert not sim.flagged() and not [ev for ev in sim.fx.events if ev.kind == "straggler_flagged"], n


def test_fewer_than_3_timed_ranks_are_never_flagged_by_compute() -> None:
    sim = Sim(2)
    sim.turn_slow("n1", 5.0)
    sim.run(5 * WINDOW_S)
    assert not sim.flagged()  # lock-step: equal steps/s, and no baseline for compute
    sim = Sim(3)
    sim.timed = {"n0", "n1"}  # n2 reports progress but no timings
    sim.turn_slow("n1", 5.0)
    sim.run(5 * WINDOW_S)
    assert not sim.flagged()


def test_a_spread_job_flags_nobody_the_mad_guard() -> None:
    """Ranks that differ anyway (heterogeneous inputs): the slowest is 1.7x the
    median (score 0.6 < 0.75) but within the spread: not an outlier."""
    job = form(["a", "b", "c", "d", "e"], spec(min_nodes=1, max_nodes=5, straggler_window_s=WINDOW_S))
    fractions = {"a": 0.15, "b": 0.2, "c": 0.3, "d": 0.4, "e": 0.5}
    t = 100.0
    while t < 100 + 5 * WINDOW_S:
        for name, f in fractions.items():
            timing = RankTiming(local_rank=0, window_s=HB_S, steps=20, compute_s=f * HB_S, wait_s=0.0)
            rounds.heartbeat(job, name, t, step=int(t), rate=10.0, timings=(timing,))
        t += HB_S
    assert not any(n.straggler for n in job.nodes.values())


def test_replace_swaps_the_slow_rank_s_node_for_a_waiting_spare_without_charging_a_restart() -> None:
    sim = Sim(3, straggler_policy="replace")
    job = sim.job
    rounds.join(job, join_msg("spare", sp=job.spec), sim.t)
    assert job.nodes["spare"].state == rounds.SPARE
    sim.turn_slow("n2", 5.0)
    sim.run(3 * WINDOW_S, until_flag="n2")
    assert job.round == 1 and job.forming and job.restarts == 0
    restarts = sent(sim.fx, RestartMsg)
    assert "n2" in restarts and "straggler" in restarts["n2"].reason
    fx = rejoin(job, ["n2"], sim.t)
    told = sent(fx, SpareMsg)["n2"]
    assert told.reason is not None and "replaced as a straggler" in told.reason and "rank 2" in told.reason
    fx = rejoin(job, ["n0", "n1"], sim.t)
    assert set(job.order) == {"n0", "n1", "spare"} and set(sent(fx, AssignedMsg)) == {"n0", "n1", "spare"}
    assert job.restarts == 0 and job.nodes["n2"].state == rounds.SPARE and job.nodes["n2"].slow_rank is None


def test_a_rank_flag_is_a_failure_of_its_host_each_time() -> None:
    """Flagged, recovered, flagged again: two failures against the host (hosts.py
    cools a host down after --host-failures of them within the window)."""
    sim = Sim(3)
    for _ in range(2):
        sim.turn_slow("n0", 5.0)
        assert sim.run(3 * WINDOW_S, until_flag="n0") is not None
        sim.slow = {}
        sim.run(2 * HB_S)
        assert not sim.flagged()
    assert [h for h, _ in sim.fx.host_failures] == ["n0", "n0"]
    assert all("straggler" in why for _, why in sim.fx.host_failures)


def test_the_step_rate_rule_stays_for_jobs_without_timings_and_its_flag_counts_against_the_host() -> None:
    job = form(["a", "b", "c"], spec(min_nodes=1, max_nodes=3, straggler_window_s=WINDOW_S))
    fx = rounds.Effects()
    t = 100.0
    while t < 100 + 2 * WINDOW_S:
        for name, rate in (("a", 10.0), ("b", 10.0), ("c", 2.0)):
            fx.merge(rounds.heartbeat(job, name, t, step=int(t * rate), rate=rate))
        t += HB_S
    assert job.nodes["c"].straggler and job.nodes["c"].slow_rank is None
    assert not [ev for ev in fx.events if ev.kind == "straggler_flagged"]  # a warning line, as before
    assert [h for h, _ in fx.host_failures] == ["c"]
