"""Collective counts from NCCL RAS and torch's Flight Recorder (issue 22, item 4),
on recorded outputs: ``fr_gloo_rank*.json`` are real Flight Recorder dumps
(torch 2.13, gloo: three ranks, rank 2 dumped after 3 all_reduces, the others
after enqueuing 5); the RAS replies are written from NCCL's format
(``src/ras/client_support.cc``: the text warnings and the JSON status)."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import ClassVar

import pytest

from rdzv_client import nccl_trace as nt
from tests.helpers.fake_ras import FakeRas

DATA = Path(__file__).parent / "data" / "nccl_trace"


def read(name: str) -> str:
    return (DATA / name).read_text()


def test_ras_text_names_the_ranks_behind_and_not_those_ahead_or_missing() -> None:
    snap = nt.parse_ras_text(read("ras_status.txt"))
    # AllReduce: 6 ranks at 4817, rank 6 at 4816, rank 3 ahead at 4818; Broadcast: 5 at 12, ranks 1, 5, 6 at 9.
    # Rank 4 (status INIT) and rank 0 (no data: INCOMPLETE) are listed too, but not as counts.
    assert snap == {"5e3f7a0c29d1b846": {1: (3, 51201), 5: (3, 51878), 6: (3, 51879)}}


def test_ras_text_without_mismatch_is_nobody_behind() -> None:
    assert nt.parse_ras_text(read("ras_status_ok.txt")) == {}


def test_ras_json_compares_every_kind_against_its_most_common_count() -> None:
    snap = nt.parse_ras_json(read("ras_status.json"))
    # every rank of both communicators; rank 6 of the world's at 4815 all_reduces, 6 at 4817, rank 3 ahead
    world = {r: (2 if r == 6 else 0, 51200 + r % 4 + 677 * (r // 4)) for r in range(8)}
    assert snap == {"0x5e3f7a0c29d1b846": world, "0x1b2c3d4e5f607182": {r: (0, 51200 + r) for r in range(4)}}
    assert nt.describe(snap) == ["0x5e3f7a0c29d1b846: rank 6 (pid 51879) is 2 collective(s) behind"]


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "[]",
        '{"communicators": 3}',
        '{"communicators": [{"hash": "x"}]}',
        '{"communicators": [{"hash": "x", "ranks": [{"rank": 0, "collective_counts": [1, 2]}]}]}',
        '{"communicators": [{"hash": "x", "ranks": [{"rank": 0, "collective_counts": {"AllReduce": 1.5}}]}]}',
    ],
)
def test_ras_json_that_is_not_ras_is_a_clear_error(bad: str) -> None:
    with pytest.raises(nt.TraceError, match="RAS|integer"):
        nt.parse_ras_json(bad)


def test_flight_recorder_dumps_compared_per_process_group() -> None:
    dumps = {r: nt.parse_fr(read(f"fr_gloo_rank{r}.json")) for r in range(3)}
    assert dumps == {0: {"0": 5}, 1: {"0": 5}, 2: {"0": 3}}
    assert nt.fr_snapshot(dumps, pids={2: 4242}) == {"pg 0": {0: (0, 0), 1: (0, 0), 2: (2, 4242)}}
    assert nt.fr_snapshot({0: dumps[0], 1: dumps[1]}) == {"pg 0": {0: (0, 0), 1: (0, 0)}}


@pytest.mark.parametrize(
    "bad", [b"", b"{}", b'{"pg_status": {"0": {}}}', b'{"pg_status": {"0": {"last_enqueued_collective": "x"}}}']
)
def test_a_dump_that_is_not_flight_recorder_json_is_a_clear_error(bad: bytes) -> None:
    with pytest.raises(nt.TraceError):
        nt.parse_fr(bad)


def test_tracker_flags_a_rank_behind_in_a_share_of_the_window_only() -> None:
    t = nt.LagTracker(window_s=10.0, share=0.3, min_samples=5)
    slow, noisy = {"c": {6: (1, 60)}}, {"c": {2: (1, 20)}}
    for i in range(10):  # rank 6 behind in 4 of 10 readings, rank 2 in 1
        t.add(float(i), slow if i % 5 in (1, 3) else noisy if i == 4 else {})
    assert t.flagged() == [nt.Flag("c", 6, 60, 0.4, 10, 1)]
    for i in range(10, 21):  # the window slides past: nobody behind any more
        t.add(float(i), {})
    assert t.flagged() == []


def test_tracker_leaves_launch_jitter_alone_and_flags_the_rank_beyond_it() -> None:
    """8 ranks that each show 1 behind in 4 of 10 readings (a reading is not one
    instant everywhere): nobody is the straggler. One at 9 of 10 while the
    others jitter at 2-3 of 10: that one."""
    jitter = nt.LagTracker(window_s=100.0)
    slow = nt.LagTracker(window_s=100.0)
    for i in range(10):
        jitter.add(float(i), {"c": {r: (int((i + r) % 5 < 2), 0) for r in range(8)}})
        slow.add(float(i), {"c": {r: (int(i != 0) if r == 7 else int((i + r) % 4 == 0), 0) for r in range(8)}})
    assert jitter.flagged() == []
    assert [(f.rank, f.share) for f in slow.flagged()] == [(7, 0.9)]


def test_tracker_decides_nothing_before_min_samples() -> None:
    t = nt.LagTracker(window_s=60.0, min_samples=5)
    for i in range(4):
        t.add(float(i), {"c": {1: (9, 0)}})
    assert t.flagged() == []
    t.add(4.0, {"c": {1: (9, 0)}})
    assert [f.rank for f in t.flagged()] == [1]


def test_ras_query_speaks_the_client_protocol_and_reads_json() -> None:
    ras = FakeRas(read("ras_status.json"))
    try:
        assert nt.ras_snapshot("127.0.0.1", ras.port, timeout=5) == nt.parse_ras_json(read("ras_status.json"))
    finally:
        ras.close()
    assert ras.seen == [["CLIENT PROTOCOL 2", "SET FORMAT json", "VERBOSE STATUS"]]


def test_an_nccl_without_json_is_asked_for_text() -> None:
    ras = FakeRas(read("ras_status.txt"), json_ok=False)
    try:
        fmt, reply = nt.ras_query("127.0.0.1", ras.port, timeout=5)
    finally:
        ras.close()
    assert (fmt, reply) == ("text", read("ras_status.txt"))
    assert ras.seen[1] == ["CLIENT PROTOCOL 2", "VERBOSE STATUS"]


def test_a_port_that_is_not_ras_or_a_reply_too_large_is_an_oserror(monkeypatch: pytest.MonkeyPatch) -> None:
    ras = FakeRas("x", hello=b"HTTP/1.1 400 Bad Request\n")
    try:
        with pytest.raises(OSError, match="not an NCCL RAS port"):
            nt.ras_query("127.0.0.1", ras.port, timeout=5)
    finally:
        ras.close()
    monkeypatch.setattr(nt, "MAX_REPLY_BYTES", 100)
    ras = FakeRas(read("ras_status.json"))
    try:
        with pytest.raises(OSError, match="over 100 bytes"):
            nt.ras_query("127.0.0.1", ras.port, timeout=5)
    finally:
        ras.close()


def test_nobody_listening_is_an_oserror_at_once() -> None:
    s = socket.create_server(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(OSError):
        nt.ras_query("127.0.0.1", port, timeout=5)


def test_ras_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NCCL_RAS_ADDR", raising=False)
    assert nt.ras_port() == ("127.0.0.1", nt.RAS_PORT)
    monkeypatch.setenv("NCCL_RAS_ADDR", "localhost:29000")
    assert nt.ras_port() == ("localhost", 29000)
    assert nt.ras_enabled({}) and not nt.ras_enabled({"NCCL_RAS_ENABLE": "0"})
    assert not nt.ras_enabled({"RDZV_NCCL_RAS": "0"})
    # a reading is a RAS collective over the whole job: 10 per window, at most one a second
    assert nt.RasWatch(window_s=30.0).interval_s == 3.0 and nt.RasWatch(window_s=5.0).interval_s == 1.0


def test_cli_compares_dumps(capsys: pytest.CaptureFixture[str]) -> None:
    assert nt.main(["fr", *(str(DATA / f"fr_gloo_rank{r}.json") for r in range(3))]) == 0
    assert capsys.readouterr().out.strip() == "pg 0: rank 2 (pid 0) is 2 collective(s) behind"


def tick_until(w: nt.RasWatch, pids: list[int], readings: int) -> list[tuple[int, nt.Flag]]:
    """Tick ``w`` (its clock 0.5 s a tick) until it has taken ``readings``; what the ticks returned."""
    out: list[tuple[int, nt.Flag]] = []
    now, deadline = 0.0, time.monotonic() + 30
    while w.readings < readings and time.monotonic() < deadline:
        out += w.tick(now, pids)
        now += 0.5
        time.sleep(0.01)
    return out + w.tick(now, pids)


def test_ras_watch_says_the_agents_own_rank_behind_once(monkeypatch: pytest.MonkeyPatch) -> None:
    ras = FakeRas(read("ras_status.json"))
    monkeypatch.setenv("NCCL_RAS_ADDR", f"127.0.0.1:{ras.port}")
    try:
        w = nt.RasWatch(window_s=60.0, interval_s=0.0)
        # this agent's workers: ranks 4-7 of the job (the RAS view has every node's); rank 6 is behind
        said = tick_until(w, [51877, 51878, 51879, 51880], nt.MIN_SAMPLES + 2)
        other = tick_until(nt.RasWatch(window_s=60.0, interval_s=0.0), [51200, 51201, 51202, 51203], nt.MIN_SAMPLES)
    finally:
        ras.close()
    assert w.error is None and w.readings >= nt.MIN_SAMPLES + 2
    assert [(lr, f.comm, f.rank, f.behind, f.share) for lr, f in said] == [(2, "0x5e3f7a0c29d1b846", 6, 2, 1.0)]
    assert other == []  # another node's agent: not its rank


def test_ras_watch_off_or_nobody_listening(monkeypatch: pytest.MonkeyPatch) -> None:
    ras = FakeRas(read("ras_status.json"))
    monkeypatch.setenv("NCCL_RAS_ADDR", f"127.0.0.1:{ras.port}")
    try:
        off = nt.RasWatch(window_s=60.0, interval_s=0.0, env={"NCCL_RAS_ENABLE": "0"})
        assert [off.tick(float(i), [51879]) for i in range(3)] == [[], [], []]
    finally:
        ras.close()
    assert ras.seen == []  # never asked
    w = nt.RasWatch(window_s=60.0, interval_s=0.0)  # the port is closed now: refused
    w.tick(0.0, [1])
    deadline = time.monotonic() + 30
    while w.error is None and time.monotonic() < deadline:
        w.tick(1.0, [1])
        time.sleep(0.01)
    assert w.error is not None and w.readings == 0
    w.tick(2.0, [1])
    assert w._thread is None  # not asked again before PROBE_S
    w.tick(1.0 + w.PROBE_S, [1])
    assert w._thread is not None


def test_the_agents_watch_reads_ras_while_workers_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from rdzv_client.config import build_parser, config_from_args
    from rdzv_client.watch import WorkerWatch

    ras = FakeRas(read("ras_status.json"))
    monkeypatch.setenv("NCCL_RAS_ADDR", f"127.0.0.1:{ras.port}")
    cfg = config_from_args(build_parser().parse_args(["--standalone", "--straggler-window-s", "60", "train.py"]))
    said: list[str] = []
    watch = WorkerWatch(cfg, lambda fmt, *a: said.append(fmt % a))
    assert watch.ras.interval_s == 6.0  # the 60 s window / 10
    watch.ras.interval_s = 0.0

    class Group:  # the running workers, as WorkerWatch.check reads them
        pids: ClassVar[list[int]] = [51877, 51878, 51879, 51880]

        def running(self, lr: int) -> bool:
            return True

    try:
        now, deadline = 0.0, time.monotonic() + 30
        while watch.ras.readings < nt.MIN_SAMPLES and time.monotonic() < deadline:
            watch.check(Group(), None, now)  # type: ignore[arg-type]
            now += 0.5
            time.sleep(0.01)
        watch.check(Group(), None, now)  # type: ignore[arg-type]

        class Link:  # the server link, as WorkerWatch.check uses it
            heartbeat_s = 0.0
            sent: ClassVar[list[dict]] = []

            def send_nowait(self, text: str) -> None:
                self.sent.append(json.loads(text))

        # the heartbeat names the lagging rank to the server (no progress datagrams: that alone)
        watch.check(Group(), Link(), now + 0.5)  # type: ignore[arg-type]
        [hb] = Link.sent
        assert hb["op"] == "hb" and "step" not in hb, hb
        [lag] = hb["nccl_lag"]
        assert lag["local_rank"] == 2 and lag["share"] == 1.0 and lag["behind"] == 2 and lag["window_s"] == 60.0
        assert lag["readings"] >= nt.MIN_SAMPLES
        watch.ras.new_round()  # none lags now: said once ([]), then nothing
        for t in (1.0, 2.0):
            watch.check(None, Link(), now + t)  # type: ignore[arg-type]
        assert Link.sent[1:] == [{"op": "hb", "nccl_lag": []}], Link.sent
    finally:
        ras.close()
        watch.close()
    assert watch.ras.tracker.window_s == 60.0
    assert len(said) == 1, said  # said once, however many readings follow
    head, _, tail = said[0].partition(" of ")
    assert head == "local rank 2 (pid 51879) is behind its NCCL communicator 0x5e3f7a0c29d1b846 in 100%"
    assert tail.endswith(" RAS readings over 60s (by up to 2 collectives): a lock-step straggler")
    assert int(tail.split()[0]) >= nt.MIN_SAMPLES


def test_cli_reads_ras_once(capsys: pytest.CaptureFixture[str]) -> None:
    ras = FakeRas(read("ras_status.txt"))
    try:
        assert nt.main(["ras", "--port", str(ras.port), "--text"]) == 0
    finally:
        ras.close()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("NCCL RAS (text): ") and out[1:] == [
        "5e3f7a0c29d1b846: rank 1 (pid 51201) is 3 collective(s) behind",
        "5e3f7a0c29d1b846: rank 5 (pid 51878) is 3 collective(s) behind",
        "5e3f7a0c29d1b846: rank 6 (pid 51879) is 3 collective(s) behind",
    ]
    assert nt.main(["ras", "--port", str(ras.port)]) == 1  # closed now
    assert "NCCL RAS at 127.0.0.1:" in capsys.readouterr().err
