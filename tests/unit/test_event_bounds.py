"""Issue 19, item 1: what a client can fill is bounded in bytes, measured as
encoded (a 4-byte character is 12 bytes of JSON): a text clipped with a marker,
an event's JSON, the event ring, a stream's queue, and what a job keeps of its
failures (pure machine: plain numbers for time)."""

from __future__ import annotations

import json

from rdzv_common.protocol import AssignedMsg, ExitRecord, JobSpec, JoinMsg
from rdzv_common.sizes import (
    MAX_OLD_REASON_BYTES,
    MAX_REASON_BYTES,
    RECENT_REASONS,
    TRUNCATED,
    clip,
    json_len,
)
from rdzv_server import rounds
from rdzv_server.events import MAX_EVENT_BYTES, MAX_FAILURES, EventLog, Subscriber, failure_fields
from rdzv_server.rounds import events as round_events
from rdzv_server.rounds.records import to_record
from tests.unit.test_rounds import form, join_msg, sent, spec

WIDE = "\U0001f600"  # 4 bytes of UTF-8, 12 of JSON (\ud83d\ude00)


def test_clip_measures_the_encoded_size_not_the_length() -> None:
    text = WIDE * 1000
    assert len(text) < 1024 < json_len(text) == 12_000
    cut = clip(text, 1024)
    assert json_len(cut) <= 1024 and cut.endswith(TRUNCATED) and cut.startswith(WIDE * 50)
    assert clip("short", 1024) == "short"
    mixed = ("a\n\x1b" + WIDE) * 500
    assert json_len(clip(mixed, 300)) <= 300
    assert json.loads(json.dumps(clip(mixed, 300))) == clip(mixed, 300)  # whole characters only


def wide_failures(n: int) -> list[ExitRecord]:
    return [ExitRecord(local_rank=i, rank=i, pid=100 + i, exit_code=1, message=WIDE * 4096) for i in range(n)]


def test_an_event_never_exceeds_its_cap() -> None:
    log = EventLog()
    ev = log.emit("node_failed", "j", 0, "n1", 1, **failure_fields(wide_failures(64)))
    body = json.loads(ev.data)
    assert len(ev.data) <= MAX_EVENT_BYTES
    assert body["truncated"] is True and body["cause"].endswith(TRUNCATED)
    assert body["failures_omitted"] == 64 - len(body["failures"]) and body["failures"]
    assert body["failures"][0]["rank"] == 0 and body["failures"][0]["message"].endswith(TRUNCATED)
    # any field a client fills, even one the event's own clipping does not know
    ev = log.emit("host_cordoned", None, host="h1", reason=WIDE * 50_000, more=["x" * 50_000] * 50)
    assert len(ev.data) <= MAX_EVENT_BYTES and json.loads(ev.data)["host"] == "h1"
    small = log.emit("host_uncordoned", None, host="h1")
    assert "truncated" not in json.loads(small.data)


def test_the_ring_is_bounded_in_bytes_and_the_gap_marker_still_works() -> None:
    log = EventLog(ring=100_000, ring_bytes=256 * 1024)
    first = log.emit("host_cordoned", None, host="h0", reason="first")
    for i in range(1, 500):
        log.emit("node_failed", "j", i, "n1", 1, **failure_fields(wide_failures(MAX_FAILURES)))
    assert log.ring_bytes <= 256 * 1024 and sum(e.cost for e in log.ring) == log.ring_bytes
    assert 10 < len(log.ring) < 500 and log.ring[-1].id == log.next_id - 1  # the oldest went first
    gap = log.gap(first.id, None)
    assert gap is not None and json.loads(gap.data)["after"] == first.id and gap.id == log.ring[0].id - 1
    assert log.gap(log.ring[0].id - 1, None) is None and log.gap(0, None) is None


def test_a_read_is_one_bounded_step_of_the_ring() -> None:
    log = EventLog()
    for i in range(100):
        log.emit("host_cordoned", None, host=f"h{i}", reason="x" * 1000)
    until = log.next_id
    got, cursor = [], 0
    while cursor < until - 1:
        chunk, cursor, lost = log.read(cursor, None, until, 8 * 1024)
        assert not lost and sum(len(e.frame) for e in chunk) <= 8 * 1024
        got += chunk
    assert [e.id for e in got] == [e.id for e in log.ring]
    # a job filter scans a bounded number of events per step
    chunk, cursor, _ = log.read(0, "nojob", until, 8 * 1024, max_scan=10)
    assert chunk == [] and cursor == log.ring[9].id


def test_a_stream_queue_is_bounded_in_bytes() -> None:
    dropped: list[bool] = []
    sub = Subscriber(None, limit=1000, on_drop=lambda: dropped.append(True), limit_bytes=10_000)
    assert all(sub.offer(b"x" * 1000) for _ in range(10)) and sub.queued_bytes == 10_000
    assert [len(f) for f in sub.take(2500)] == [1000, 1000] and sub.queued_bytes == 8000
    assert sub.offer(b"x" * 2000)
    assert not sub.offer(b"x" * 1)  # beyond 10,000 bytes: dropped, not buffered
    assert dropped == [True] and sub.dropped and sub.queued_bytes == 0 and not sub.queue


def join(node_id: str, sp: JobSpec) -> JoinMsg:
    return JoinMsg(
        job_id="j", node_id=node_id, host=node_id, addr="10.0.0.1", local_world_size=1, master_port=29500, spec=sp
    )


def test_a_failure_loop_keeps_the_job_record_bounded() -> None:
    """651 failures with long 4-byte-character messages grew a job's record to
    4 MB (rewritten at each); now each reason is clipped in bytes, reasons
    older than the newest RECENT_REASONS rounds shorter still, and the first
    failure stays."""
    sp = JobSpec(min_nodes=1, max_nodes=1, max_restarts=100_000, storm_restarts=0)
    job = rounds.new_job("j", sp, 0.0)
    rounds.join(job, join("a", sp), 0.0)
    loops = rounds.MAX_HISTORY + 200
    for i in range(loops):
        exit_ = [ExitRecord(local_rank=0, rank=0, pid=1, exit_code=1, message=f"{i} " + WIDE * 4000)]
        rounds.fail(job, "a", job.round, exit_, float(i))
        rounds.join(job, join("a", sp), float(i))
    record = json.dumps(rounds.to_record(job), separators=(",", ":"))
    assert len(job.history) == rounds.MAX_HISTORY
    assert job.history[0].reason == "job created" and job.history[1].reason.startswith("worker failure: node a")
    assert " 0 " + WIDE in job.history[1].reason  # the first failure, kept
    assert f" {loops - 1} " + WIDE in job.history[-1].reason  # and the newest
    assert all(json_len(r.reason) <= MAX_REASON_BYTES for r in job.history)
    assert all(json_len(r.reason) <= MAX_OLD_REASON_BYTES for r in job.history[2 : -RECENT_REASONS - 1])
    bound = rounds.MAX_HISTORY * (160 + MAX_OLD_REASON_BYTES) + (RECENT_REASONS + 2) * MAX_REASON_BYTES + 8192
    assert len(record) <= bound < 100_000, len(record)
    # and it ends with a root cause clipped as well
    exit_ = [ExitRecord(local_rank=0, rank=0, pid=1, exit_code=1, message=WIDE * 4096)]
    job.spec = job.spec.model_copy(update={"max_restarts": job.restarts})
    rounds.fail(job, "a", job.round, exit_, float(loops))
    assert job.finished and job.root_cause is not None and job.end_reason is not None
    assert json_len(job.root_cause) <= MAX_REASON_BYTES and json_len(job.end_reason) <= MAX_REASON_BYTES
    assert job.end_reason.endswith(TRUNCATED) or len(job.end_reason) < len(WIDE * 4096)


def test_a_node_that_reconnects_in_a_loop_does_not_write_the_log() -> None:
    """Issue 24 / hostile clients: "node N reconnected" is a note per resume. One node with its
    secret reconnecting 1,000 times (or a failover's 16,384 resumes) writes the first
    COMEBACK_BURST lines, then one every 1/COMEBACK_RATE s, which counts the lines held back."""
    job = form(["a", "b"], spec(heartbeat_timeout_s=3600.0))  # (the ticks below evict nobody)
    lines = []
    for i in range(1000):
        lines += rounds.join(job, join_msg("a", sp=job.spec), 2.0 + i * 1e-4).logs
    assert [ln.endswith("node a reconnected") for ln in lines] == [True] * round_events.COMEBACK_BURST
    quiet = 2.1 + 0.9 / round_events.COMEBACK_RATE  # not yet one line's worth of budget back
    assert rounds.join(job, join_msg("a", sp=job.spec), quiet).logs == []
    (line,) = rounds.join(job, join_msg("a", sp=job.spec), 2.1 + 1.1 / round_events.COMEBACK_RATE).logs
    held = 1000 - round_events.COMEBACK_BURST + 1
    assert line.endswith(f"node a reconnected ({held} more nodes back, not logged one by one)")
    assert line.fields["held"] == held
    # a burst held back with no reconnect after it: the job's tick tells the count once budget allows
    t = 2.1 + 1.1 / round_events.COMEBACK_RATE
    for i in range(10):
        assert rounds.join(job, join_msg("a", sp=job.spec), t + i * 1e-4).logs == []
    assert not [ln for ln in rounds.tick(job, t + 0.1).logs if "nodes back" in ln]  # no budget yet
    (told,) = [ln for ln in rounds.tick(job, t + 1.1 / round_events.COMEBACK_RATE).logs if "nodes back" in ln]
    assert told.endswith("10 more nodes back, not logged one by one") and told.fields["held"] == 10
    assert not [ln for ln in rounds.tick(job, t + 100).logs if "nodes back" in ln]  # told once
    assert "comebacks" not in to_record(job)  # the budget is the process's, never saved
    # every resume still gets its assignment, logged or not
    assert sent(rounds.join(job, join_msg("a", sp=job.spec), t + 200), AssignedMsg)
