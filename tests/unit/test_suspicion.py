"""rdzv_server.rounds.suspicion, pure: who watches whom, which reports count,
the probe's deadline, each reporter's budget, the tables' bounds, and the
eviction a failed probe causes."""

from __future__ import annotations

import pytest

from rdzv_common.protocol import JobSpec
from rdzv_server import rounds
from rdzv_server.rounds import forming
from rdzv_server.rounds import suspicion as sus
from tests.helpers.jobs import node_join, running_job


def _job(n: int, probe: bool = True):
    return running_job(n, probe)[0]


def _by_rank(job):
    return [job.nodes[n] for n in job.order]


def test_each_member_watches_the_next_two_in_rank_order() -> None:
    job = _job(5)
    members = _by_rank(job)
    for r, node in enumerate(members):
        watch = sus.watch_list(job, node)
        assert [w.node_id for w in watch] == [members[(r + 1) % 5].node_id, members[(r + 2) % 5].node_id]
        assert all(w.addr == job.nodes[w.node_id].addr and w.port == job.nodes[w.node_id].probe_port for w in watch)
    # every member is watched by exactly two others
    watched = [w.node_id for node in members for w in sus.watch_list(job, node)]
    assert sorted(watched) == sorted(n.node_id for n in members for _ in range(2))


def test_small_jobs_and_nodes_without_probes() -> None:
    two = _job(2)
    a, b = _by_rank(two)
    assert [w.node_id for w in sus.watch_list(two, a)] == [b.node_id]
    one = _job(1)
    assert sus.watch_list(one, _by_rank(one)[0]) == []
    silent = _job(3, probe=False)
    assert all(sus.watch_list(silent, n) == [] for n in _by_rank(silent))


def test_the_assignment_carries_the_watch_list() -> None:
    job = rounds.new_job("j", JobSpec(min_nodes=2, max_nodes=2), 0.0)
    sends = []
    for i in range(2):
        sends += rounds.join(job, node_join(job, i, 41000 + i), 0.0).messages()
    assigned = {node: m.assignment for node, m in sends if m.op == "assigned"}
    assert assigned["n0"].watch[0].node_id == "n1" and assigned["n0"].watch[0].port == 41001
    assert assigned["n1"].watch[0].node_id == "n0" and assigned["n1"].watch[0].port == 41000


def test_the_probe_deadline_follows_the_rtt() -> None:
    assert sus.probe_deadline(None) == sus.PROBE_MIN_S
    assert sus.probe_deadline(0.00005) == sus.PROBE_MIN_S  # a LAN
    assert sus.probe_deadline(0.3) == pytest.approx(sus.PROBE_RTTS * 0.3 + sus.PROBE_RETRANSMIT_S)  # 300 ms of delay


def test_which_reports_count() -> None:
    job = _job(3)
    with pytest.raises(ValueError, match="itself"):
        sus.suspects(job, "n0", 0, ["n1", "n0"])
    assert sus.suspects(job, "n0", 0, ["n1", "n1", "nobody", "n2"]) == ["n1", "n2"]
    assert sus.suspects(job, "n0", 1, ["n1"]) == []  # another round
    assert sus.suspects(job, "stranger", 0, ["n1"]) == []  # not a member
    job.nodes["n2"].state = None  # gone meanwhile (a test shortcut: no counts involved below)
    assert sus.suspects(job, "n2", 0, ["n1"]) == [] and sus.suspects(job, "n0", 0, ["n2"]) == []


def test_a_confirmed_suspect_is_evicted_with_the_reason_and_its_host_charged() -> None:
    job = _job(3)
    fx = sus.confirmed(job, "n1", 0, 2, 0.301, 5.0)
    assert fx.evicted == ["n1"] and "n1" not in job.nodes
    assert job.round == 1 and job.forming and job.restarts == 0
    assert "suspected by 2 peer(s), no answer to probe in 301 ms" in job.history[-1].reason
    assert fx.host_failures and fx.host_failures[0][0] == "h1"
    # a late verdict for a round that is over changes nothing
    assert sus.confirmed(job, "n2", 0, 1, 0.3, 5.1).events == []


def test_each_reporter_has_a_budget() -> None:
    t = sus.Suspicions()
    assert [t.allow("j", "n0", 0.0) for _ in range(sus.REPORT_BURST + 2)] == [True] * sus.REPORT_BURST + [False] * 2
    assert t.allow("j", "n1", 0.0)  # another node's budget is its own
    assert t.allow("j", "n0", 1.0 / sus.REPORT_RATE)  # refilled
    assert not t.allow("j", "n0", 1.0 / sus.REPORT_RATE)


def test_one_probe_per_suspect_and_a_cleared_one_is_left_alone() -> None:
    t = sus.Suspicions()
    assert t.open("j", "n1", "n0", 0, 0.0)
    assert not t.open("j", "n1", "n2", 0, 0.1)  # joins the open probe
    probe = t.close("j", "n1", answered=True, now=0.4)
    assert probe is not None and probe.reporters == {"n0", "n2"}
    assert not t.open("j", "n1", "n0", 0, 0.5)  # it answered lately
    assert t.open("j", "n1", "n0", 0, 0.4 + sus.CLEARED_FOR_S)
    assert t.close("j", "n1", answered=False, now=3.0) is not None
    assert t.close("j", "n1", answered=False, now=3.0) is None
    assert t.open("j", "n1", "n0", 0, 3.0)  # not answered: not held off
    assert t.open("j", "n1", "n0", 1, 3.1)  # a later round's suspicion replaces it
    assert t.close("j", "n1", answered=False, now=3.3, round_no=0) is None  # round 0's timer: not its probe
    assert t.close("j", "n1", answered=False, now=3.4, round_no=1) is not None


def test_the_tables_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sus, "MAX_PROBES", 3)
    monkeypatch.setattr(sus, "MAX_REPORTERS", 2)
    t = sus.Suspicions()
    assert [t.open("j", f"n{i}", "r", 0, 0.0) for i in range(4)] == [True, True, True, False]
    assert t.allow("j", "a", 0.0) and t.allow("j", "b", 0.0)
    assert not t.allow("j", "c", 0.0)  # full of budgets in use
    assert t.allow("j", "c", 100.0)  # the idle (full) buckets are forgotten
    assert len(t.budgets) <= 2


def test_a_completing_round_writes_each_members_watch_peer_once_and_again_only_when_it_moved(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 24's 16,384-node re-formation: every member is in MAX_WATCH watch lists; its
    text as a watched peer is written once for all of them when the round completes, and
    kept for the next round while its probe address and port stay (rounds.forming.peer_texts):
    a node loss writes none of its survivors again, a member that moved is written anew."""
    written: list[str] = []
    real = forming.peer_text
    monkeypatch.setattr(forming, "peer_text", lambda peer: written.append(peer.node_id) or real(peer))
    job, effects = running_job(4, probe=True)
    assert sorted(written) == ["n0", "n1", "n2", "n3"], written  # once each, not once per watcher
    watch = [m.assignment.watch for fx in effects for _, m in fx.messages() if m.op == "assigned"]
    assert len(watch) == 4 and all(len(w) == 2 for w in watch)
    assert watch == [sus.watch_list(job, job.nodes[n]) for n in job.order]  # what each one's own list says
    # n3 leaves; the survivors join again, n1 from a new address, and n4 comes (min_nodes is 4)
    written.clear()
    rounds.leave(job, "n3", "done", 1.0)
    got = []
    for i in (0, 1, 2, 4):
        msg = node_join(job, i, 40000 + i, run=job.run)
        got.append(rounds.join(job, msg, 2.0, seen_addr="10.7.7.7" if i == 1 else f"10.0.0.{i + 1}"))
    assert not job.forming and len(job.order) == 4
    assert sorted(written) == ["n1", "n4"], written  # only the member that moved, and the new one
    watch = {to: m.assignment.watch for fx in got for to, m in fx.messages() if m.op == "assigned"}
    assert watch == {n: sus.watch_list(job, job.nodes[n]) for n in job.order}
    assert any(w.addr == "10.7.7.7" for ws in watch.values() for w in ws)
    assert set(job.peer_texts) == set(job.order)  # kept for the members of the running round only
    record = rounds.to_record(job)
    assert "peer_texts" not in record
