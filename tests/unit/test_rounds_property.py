"""Random event sequences against the round state machine, with its invariants
checked after every step (hypothesis prints the failing sequence and seed)."""

from __future__ import annotations

import json

import pytest
from hypothesis import Phase, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from rdzv_common.protocol import (
    AssignedMsg,
    EvictedMsg,
    ExitRecord,
    JobSpec,
    JobState,
    JoinMsg,
    RdzvError,
)
from rdzv_server import rounds

# A small pool so that ids collide, hosts sort naturally (node2 < node10) and
# requested ranks clash.
NODES = {f"n{i}": host for i, host in enumerate(["node10", "node2", "node1", "node2", "gpu-a", "node03"])}
NODE_IDS = sorted(NODES)
STEPS = [
    0.05,
    0.3,
    0.3,
    1.0,
    1.0,
    1.0,
    2.5,
    2.5,
    7.0,
    40.0,
]  # mostly small; 7 s loses silent nodes, 40 s times joins out

node_ids = st.sampled_from(NODE_IDS)
exit_records = st.builds(
    ExitRecord,
    local_rank=st.integers(0, 3),
    rank=st.integers(0, 15),
    pid=st.integers(1, 99999),
    exit_code=st.one_of(st.none(), st.integers(-1, 255)),
    signal=st.one_of(st.none(), st.sampled_from(["SIGKILL", "SIGSEGV"])),
    timestamp=st.floats(0, 100),
)


def record(job: rounds.Job) -> dict:
    return json.loads(json.dumps(rounds.to_record(job)))


class RoundsMachine(RuleBasedStateMachine):
    """One job, a pool of nodes and a clock that only moves forward."""

    @initialize(min_nodes=st.integers(1, 3), extra=st.integers(0, 2), max_restarts=st.integers(0, 5))
    def create(self, min_nodes, extra, max_restarts):
        self.spec = JobSpec(
            min_nodes=min_nodes,
            max_nodes=min_nodes + extra,
            max_restarts=max_restarts,
            last_call_s=1.0,
            heartbeat_timeout_s=6.0,
            join_timeout_s=30.0,
            scale_up_window_s=0.5,
        )
        self.now = 0.0
        self._new_job()

    def _new_job(self):
        self.job = rounds.new_job("j", self.spec, self.now)
        self.incarnation = {nid: 0 for nid in NODE_IDS}  # bumped whenever a node leaves the job
        self.last_round = 0
        self.last_run = 1
        self.last_restarts = 0
        self.ended: JobState | None = None
        self.completed: tuple[int, list[tuple[str, int]]] | None = None  # round, [(node, incarnation)]
        self.assignments: dict[str, object] = {}

    # ---------------------------------------------------------------- driving

    def _apply(self, op, *args) -> None:
        """Run one event; a refusal must leave the job exactly as it was."""
        before = record(self.job)
        ids_before = set(self.job.nodes)
        # the ranks nodes asked for, kept for those an event removes after completing their round
        self.asked = {nid: n.requested_rank for nid, n in self.job.nodes.items()}
        run_before = self.job.run
        try:
            fx = op(self.job, *args)
        except RdzvError as e:
            event(f"refused {op.__name__}: {type(e).__name__}")
            assert record(self.job) == before, f"refused {op.__name__} changed the job"
            return
        if self.job.finished:
            event(f"job {self.job.state.value}")
        if self.job.run != run_before:  # a fresh join started the next run: its rounds start over
            event("started the next run")
            self.completed, self.assignments = None, {}
        if fx is not None:  # before counting removals: a round may complete, then lose nodes, in one tick
            self.asked.update((nid, n.requested_rank) for nid, n in self.job.nodes.items())
            self._check_effects(fx, ids_before)
        for nid in ids_before - set(self.job.nodes):
            self.incarnation[nid] += 1

    def _pick(self, pick: int) -> str:
        """Mostly a member of the current round (reports from others are refused)."""
        if self.job.order and pick < 8:
            return self.job.order[pick % len(self.job.order)]
        return NODE_IDS[pick % len(NODE_IDS)]

    @rule(
        joins=st.lists(
            st.tuples(
                node_ids,
                st.sampled_from([1, 2, 8]),
                st.one_of(st.none(), st.integers(0, 4)),
                st.sampled_from([None] * 4 + [0, -1]),
            ),
            min_size=1,
            max_size=4,
        )
    )
    def join(self, joins):
        """One to four nodes join (or, with a resume round, reconnect)."""
        for nid, lws, rank, resume in joins:
            resume_round = None if resume is None else max(0, self.job.round + resume)
            host = NODES[nid]
            msg = JoinMsg(
                job_id="j",
                node_id=nid,
                host=host,
                addr=f"{host}.addr",
                local_world_size=lws,
                master_port=20000 + NODE_IDS.index(nid),
                spec=self.spec,
                requested_rank=rank,
                resume_round=resume_round,
            )
            self._apply(rounds.join, msg, self.now)

    @rule(keep_rank=st.booleans(), resume=st.booleans())
    def rejoin_after_restart(self, keep_rank, resume):
        """Agents told to restart rejoin, as real agents do at once (plainly, or by resuming their old round)."""
        for node in [n for n in self.job.nodes.values() if n.state == rounds.REJOINING]:
            msg = JoinMsg(
                job_id="j",
                node_id=node.node_id,
                host=node.host,
                addr=node.addr,
                local_world_size=node.local_world_size,
                master_port=node.master_port,
                spec=self.spec,
                requested_rank=node.requested_rank if keep_rank else None,
                resume_round=self.job.round - 1 if resume else None,
            )
            self._apply(rounds.join, msg, self.now)

    @rule(nid=node_ids, grace_s=st.sampled_from([0.5, 3.0]), coin=st.integers(0, 2))
    def disconnect(self, nid, grace_s, coin):
        if coin == 1:  # losses are rarer than joins, or jobs would rarely form (hypothesis favours 0 and max)
            self._apply(rounds.disconnect, nid, self.now, grace_s)

    @rule(dt=st.sampled_from(STEPS), silent=st.sampled_from([(), (), (), tuple(NODE_IDS)]) | st.tuples(node_ids))
    def tick(self, dt, silent):
        """Time passes; every connected agent heartbeats except the silent ones
        (a frozen host); a finished job is followed by a fresh one."""
        self.now += dt
        if self.job.finished:
            self._new_job()
        for node in list(self.job.nodes.values()):
            if node.connected and node.node_id not in silent:
                rounds.heartbeat(self.job, node.node_id, self.now)
        self._apply(rounds.tick, self.now)

    # Rules are drawn uniformly: these three twice as often, so that jobs form and re-form.
    join_more = join
    tick_more = tick
    rejoin_more = rejoin_after_restart

    @rule(
        pick=st.integers(0, 9),
        offset=st.sampled_from([0, 0, -1, 1]),
        failures=st.lists(exit_records, min_size=1, max_size=3),
        coin=st.integers(0, 2),
    )
    def fail(self, pick, offset, failures, coin):
        if coin == 1:
            self._apply(rounds.fail, self._pick(pick), max(0, self.job.round + offset), failures, self.now)

    @rule(picks=st.lists(st.integers(0, 9), min_size=1, max_size=4), offset=st.sampled_from([0, 0, 0, -1]))
    def succeed(self, picks, offset):
        for pick in picks:
            self._apply(rounds.succeed, self._pick(pick), max(0, self.job.round + offset), self.now)

    @rule(nid=node_ids, coin=st.integers(0, 2))
    def leave(self, nid, coin):
        if coin == 1:
            self._apply(rounds.leave, nid, "sigterm", self.now)

    @rule(coin=st.integers(0, 19))
    def close(self, coin):
        if coin == 7:  # rarely: a closed job explores nothing more
            self._apply(rounds.close, self.now)

    @rule()
    def restart_server(self):
        """The server restarts: the job comes back from its record, everyone gets a grace period."""
        rec = record(self.job)
        job = rounds.from_record(rec)
        assert record(job) == rec
        assert {k: v for k, v in job.counts.items() if v} == {k: v for k, v in self.job.counts.items() if v}
        rounds.restored(job, self.now)
        self.job = job

    # ------------------------------------------------------------- checking

    def _check_effects(self, fx: rounds.Effects, ids_before: set[str]) -> None:
        job = self.job
        msgs = fx.messages()
        for nid, msg in msgs:
            if isinstance(msg, EvictedMsg):
                assert nid in ids_before and nid not in job.nodes, f"evicted {nid} is still in the job"
        by_round: dict[int, list] = {}
        for nid, msg in msgs:
            if isinstance(msg, AssignedMsg):
                by_round.setdefault(msg.assignment.round, []).append((nid, msg.assignment))
        for round_no, got in sorted(by_round.items()):
            if self.completed is not None and round_no == self.completed[0]:
                for nid, a in got:  # a resume: the very same assignment again
                    assert self.assignments[nid] == a, f"resume of {nid} got a different assignment"
                continue
            assert self.completed is None or round_no > self.completed[0]
            self._check_completed_round(round_no, got)

    def _check_completed_round(self, round_no: int, got: list) -> None:
        spec, job = self.spec, self.job
        got.sort(key=lambda item: item[1].group_rank)
        n = len(got)
        assert spec.min_nodes <= n <= spec.max_nodes, f"round {round_no} completed with {n} nodes"
        assert [a.group_rank for _, a in got] == list(range(n))
        offset = 0
        for _, a in got:
            assert a.rank_offset == offset, "rank offsets are not prefix sums"
            offset += a.local_world_size
        rank0 = got[0][0]
        for _, a in got:
            assert (a.world_size, a.group_world_size) == (offset, n)
            assert (a.master_addr, a.master_port) == (f"{NODES[rank0]}.addr", 20000 + NODE_IDS.index(rank0))
            assert a.restarts == job.restarts and a.max_restarts == spec.max_restarts
        order = [(nid, self.incarnation[nid]) for nid, _ in got]
        if self.completed is None:
            event("completed a first round")
        if self.completed is not None:
            prev = self.completed[1]
            survivors = [x for x in prev if x in order]
            event(f"completed a later round with {min(len(survivors), 2)}{'+' * (len(survivors) >= 2)} survivors")
            if survivors and survivors[0] == prev[0]:
                assert order[0] == prev[0], f"rank 0 {prev[0]} survived but moved: {order}"
            keep = [x for x in survivors if self.asked.get(x[0]) is None]
            assert [x for x in order if x in keep] == keep, f"survivors reordered: {prev} -> {order}"
        self.completed = (round_no, order)
        self.assignments = {nid: a for nid, a in got}

    @invariant()
    def counts_match_states(self):
        actual: dict[str, int] = {}
        for node in self.job.nodes.values():
            assert node.state in (rounds.WAITING, rounds.REJOINING, rounds.RUNNING, rounds.SUCCEEDED, rounds.SPARE)
            actual[node.state] = actual.get(node.state, 0) + 1
        assert {k: v for k, v in self.job.counts.items() if v} == actual
        assert all(v >= 0 for v in self.job.counts.values())

    @invariant()
    def members_hold_ranks_0_to_n_minus_1(self):
        job = self.job
        if job.state == JobState.WAITING:
            assert job.order == [] and _count(job, rounds.RUNNING) == 0 and _count(job, rounds.SUCCEEDED) == 0
            return
        if job.finished:
            return
        assert _count(job, rounds.REJOINING) == 0, "a running job still waits for a previous member"
        # A member that succeeded and left may come back under the same id as a
        # new node: members are the nodes that run or succeeded.
        members = sorted(
            (n for n in job.nodes.values() if n.state in (rounds.RUNNING, rounds.SUCCEEDED)), key=lambda n: n.group_rank
        )
        for m in members:
            assert job.order[m.group_rank] == m.node_id, f"{m.node_id} holds rank {m.group_rank} of {job.order}"
        for n in job.nodes.values():
            if n.state not in (rounds.RUNNING, rounds.SUCCEEDED):
                assert n.state in (rounds.WAITING, rounds.SPARE) and n.group_rank is None, f"{n.node_id} {n.state}"
        if len(members) == len(job.order):
            assert sorted(m.group_rank for m in members) == list(range(len(job.order)))
            assert job.world_size == sum(m.local_world_size for m in members)
            offsets = [m.rank_offset for m in members]
            assert offsets == [sum(m.local_world_size for m in members[:i]) for i in range(len(members))]

    @invariant()
    def a_forming_round_is_never_stuck(self):
        job, spec = self.job, self.spec
        if not job.forming:
            return
        waiting = _count(job, rounds.WAITING)
        if job.prev_order:
            assert _count(job, rounds.REJOINING) > 0 or waiting < spec.min_nodes, "re-formed round did not complete"
        else:
            assert waiting < spec.max_nodes, "max_nodes waiting but the round did not complete"
            assert (job.last_call_deadline is not None) == (waiting >= spec.min_nodes)

    @invariant()
    def numbers_only_grow_and_the_end_is_final(self):
        """Within a run; a fresh join to a finished job starts the next run,
        which starts from round 0 and keeps the ended run's summary."""
        job = self.job
        if job.run != self.last_run:
            assert job.run == self.last_run + 1 and self.ended is not None
            assert job.runs[-1].state == self.ended.value and job.runs[-1].run == job.run - 1
            self.last_run, self.last_round, self.last_restarts, self.ended = job.run, 0, 0, None
        assert job.round >= self.last_round and job.restarts >= self.last_restarts
        assert job.restarts <= job.spec.max_restarts
        assert [r.round for r in job.history] == list(range(job.history[0].round, job.round + 1))
        for rec in job.history:
            if rec.completed_at is not None:
                assert job.spec.min_nodes <= rec.nodes <= job.spec.max_nodes
        self.last_round, self.last_restarts = job.round, job.restarts
        if self.ended is not None:
            assert job.state == self.ended, f"a {self.ended.value} job became {job.state.value}"
        elif job.finished:
            self.ended = job.state


def _count(job: rounds.Job, state: str) -> int:
    return job.counts.get(state, 0)


# No "explain" phase: its line tracing makes shrinking a 40-step failure take
# minutes; the shrunk steps and the seed are what one needs.
PHASES = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink]
RoundsMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    derandomize=False,
    phases=PHASES,
    report_multiple_bugs=False,
)
# Passing takes seconds; a failure's shrinking may take a minute or two.
TestRounds = pytest.mark.timeout(300)(RoundsMachine.TestCase)


# ------------------------------------------------------------ assign_ranks


def _node(nid: str, host: str, rank: int | None) -> rounds.Node:
    return rounds.Node(
        node_id=nid, host=host, addr=host, local_world_size=1, master_port=1, requested_rank=rank, last_seen=0.0
    )


@settings(max_examples=200, deadline=None, phases=PHASES)
@given(
    pool=st.lists(
        st.tuples(st.sampled_from(["node1", "node2", "node10", "gpu3"]), st.one_of(st.none(), st.integers(0, 6))),
        min_size=1,
        max_size=8,
    ),
    prev_size=st.integers(0, 8),
    world=st.integers(1, 8),
)
def test_assign_ranks_is_a_stable_permutation(pool, prev_size, world):
    """assign_ranks splits candidates into members and spares, honours free requested ranks,
    keeps rank 0 and the previous order, and puts previous members before new ones."""
    nodes = [_node(f"id{i}", host, rank) for i, (host, rank) in enumerate(pool)]
    prev = [n.node_id for n in reversed(nodes[:prev_size])]
    world = min(world, len(nodes))
    members, spares = rounds.assign_ranks(prev, nodes, world)
    assert len(members) == world
    assert sorted(n.node_id for n in members + spares) == sorted(n.node_id for n in nodes)
    ids = [n.node_id for n in members]
    if prev and prev[0] in ids:
        assert ids[0] == prev[0]
    placed_by_request = set()
    for i, n in enumerate(members):
        if n.requested_rank is not None and n.requested_rank < world and i == n.requested_rank:
            placed_by_request.add(n.node_id)
    kept_rank0 = bool(prev) and ids[0] == prev[0]  # rule 2 wins over a request, both ways
    for n in members:  # a free requested rank is never refused
        r = n.requested_rank
        if r is None or r >= world or members[r].node_id == n.node_id:
            continue
        if kept_rank0 and (r == 0 or n.node_id == ids[0]):
            continue
        assert members[r].requested_rank == r, f"{n.node_id} asked for {r}, given to a node that did not"
    plain = [n.node_id for n in members if n.node_id not in placed_by_request]
    old = [x for x in plain if x in prev]
    assert old == [x for x in prev if x in old], "previous members reordered"
    assert all(plain.index(o) < plain.index(x) for o in old for x in plain if x not in prev), "new before old"
    new_plain = [n for n in members if n.node_id in plain and n.node_id not in prev]
    assert new_plain == sorted(new_plain, key=rounds.natural_key)
    if len(prev) <= world:
        assert not any(n.node_id in prev for n in spares), "a previous member was made a spare"
