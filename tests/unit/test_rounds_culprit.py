"""The round machine's side of "a failed job explained in one place" (issue 25):
the culprit (first failure, its stderr tail) and the nodes that left, kept
bounded and saved with the job; and an in-place store port taken by another
process re-forming without a charge (pure: plain numbers for time)."""

from __future__ import annotations

from rdzv_common.protocol import ExitRecord, JobState, RestartMsg
from rdzv_common.sizes import MAX_TAIL_BYTES, json_len
from rdzv_server import rounds
from rdzv_server.rounds.departed import MAX_DEPARTED
from tests.unit.test_rounds import form, record, rejoin, sent, spec

PORT = ExitRecord(local_rank=0, rank=0, pid=7, exit_code=76, message="StorePortTaken: ...", reason="store_port")


def test_a_store_port_taken_re_forms_uncharged_and_counts_against_no_host() -> None:
    job = form(["a", "b"], spec(min_nodes=1, max_restarts=0))
    fx = rounds.fail(job, "a", 0, [PORT], 1.0)
    assert job.state == JobState.WAITING and job.round == 1 and job.restarts == 0
    assert fx.host_failures == [] and set(sent(fx, RestartMsg)) == {"a", "b"}
    assert "store port taken, not charged" in job.history[-1].reason
    assert [e.kind for e in fx.events][:1] == ["node_failed"]
    assert job.culprit is not None and job.culprit.node_id == "a"


def test_a_storm_of_taken_store_ports_still_ends_the_job() -> None:
    """Uncharged is not unbounded: rounds that bring no progress count toward the storm."""
    job = form(["a", "b"], spec(min_nodes=1, max_restarts=0, storm_restarts=2, min_round_s=60.0))
    now = 1.0
    for _ in range(2):
        rounds.fail(job, "a", job.round, [PORT], now)
        rejoin(job, ["a", "b"], now)
        rounds.tick(job, now + 2.0)
        now += 3.0
    assert job.state == JobState.RUNNING and job.restarts == 0
    rounds.fail(job, "a", job.round, [PORT], now)
    assert job.state == JobState.FAILED and "no progress in 2 restarts" in (job.end_reason or "")


def test_a_charged_failure_names_its_culprit_with_its_tail_bounded_and_escaped() -> None:
    job = form(["a", "b"], spec(min_nodes=1))
    rec = ExitRecord(local_rank=1, rank=3, pid=9, exit_code=1, message="boom", stderr=["x\x1b[2J" + "y" * 230] * 20)
    rounds.fail(job, "b", 0, [rec], 1.0)
    c = job.culprit
    assert c is not None and (c.node_id, c.host, c.round, c.rank, c.local_rank) == ("b", "b", 0, 3, 1)
    assert "exit code 1" in c.cause and c.stderr and c.stderr[-1].startswith("x\\x1b[2J")
    assert sum(json_len(s) + 3 for s in c.stderr) <= MAX_TAIL_BYTES
    assert rounds.view(job, 1.0).culprit is not None


def test_an_echo_of_a_lost_peer_names_no_culprit() -> None:
    job = form(["a", "b", "c"], spec(min_nodes=1, max_nodes=3))
    rounds.disconnect(job, "c", 2.0, grace_s=0.5)
    rounds.fail(job, "a", 0, [ExitRecord(local_rank=0, rank=0, pid=9, exit_code=1, stderr=["gloo"])], 2.1)
    assert job.culprit is None
    assert [(d.node_id, d.reason) for d in job.departed] == [("c", "connection lost")]


def test_departures_are_kept_the_latest_and_saved_with_the_job() -> None:
    ids = [f"n{i}" for i in range(MAX_DEPARTED + 5)]
    job = form(ids, spec(min_nodes=1, max_nodes=len(ids)))
    rounds.fail(job, "n0", 0, [ExitRecord(local_rank=0, rank=0, pid=1, exit_code=1, stderr=["e"])], 1.5)
    for i, nid in enumerate(ids[1:]):
        rounds.leave(job, nid, "bye\n" + "z" * 500, 2.0 + i)
    assert len(job.departed) == MAX_DEPARTED and job.departed[-1].node_id == ids[-1]
    assert all("\n" not in d.reason and json_len(d.reason) <= 192 for d in job.departed)
    back = rounds.from_record(record(job))
    assert back.departed == job.departed and back.culprit == job.culprit
    assert record(back) == record(job)


def test_a_job_without_either_saves_the_record_older_code_wrote() -> None:
    saved = record(form(["a"], spec(min_nodes=1)))
    assert "culprit" not in saved and "departed" not in saved


def test_a_saved_culprit_is_bounded_again_on_load() -> None:
    job = form(["a"], spec(min_nodes=1))
    rounds.fail(job, "a", 0, [ExitRecord(local_rank=0, rank=0, pid=1, exit_code=1, stderr=["e"])], 1.0)
    saved = record(job)
    saved["culprit"]["stderr"] = ["\x07" + "q" * 10_000] * 1000  # a record edited by hand, or by older code
    back = rounds.from_record(saved)
    assert back.culprit is not None and 0 < len(back.culprit.stderr) <= 20
    assert all("\x07" not in s and json_len(s) <= 240 for s in back.culprit.stderr)


def test_a_hostile_failure_loop_with_tails_and_departures_keeps_the_record_under_its_bound() -> None:
    """design.md "Bounds": with 200 rounds, the culprit and 32 departures (ids and
    hosts at their longest, reasons and tails of 4-byte characters) a job's
    record stays under ~110 KiB."""
    import json

    from rdzv_common.protocol import MAX_ID_LEN, MAX_STDERR_LINE, MAX_STDERR_LINES, JoinMsg

    wide = "\U0001f4a5"
    sp = spec(min_nodes=1, max_nodes=40, max_restarts=100_000, storm_restarts=0, heartbeat_timeout_s=3600.0)
    job = rounds.new_job("j", sp, 0.0)
    tail = [wide * MAX_STDERR_LINE] * MAX_STDERR_LINES

    def join(i: int, now: float) -> None:
        node = f"{i:03d}" + "n" * (MAX_ID_LEN - 3)
        host = f"{i:03d}" + "h" * 252
        msg = JoinMsg(job_id="j", node_id=node, host=host, addr="a", local_world_size=1, master_port=1, spec=sp)
        rounds.join(job, msg, now)

    join(0, 0.0)
    rounds.tick(job, 10.0)
    for i in range(rounds.MAX_HISTORY + 50):
        first = next(iter(job.nodes))
        rec = ExitRecord(local_rank=0, rank=0, pid=1, exit_code=1, message=wide * 4000, stderr=tail)
        rounds.fail(job, first, job.round, [rec], 20.0 + i)
        join(0, 20.0 + i)
        rounds.tick(job, 30.0 + i)
    for i in range(1, 40):
        join(i, 1000.0)
    rounds.tick(job, 1100.0)
    for i, node in enumerate(list(job.nodes)[1:]):
        rounds.leave(job, node, wide * 300, 1200.0 + i)
    assert len(job.departed) == MAX_DEPARTED and job.culprit is not None and job.culprit.stderr
    size = len(json.dumps(rounds.to_record(job), separators=(",", ":")))
    assert size < 110 * 1024, size
