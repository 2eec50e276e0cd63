"""``rdzv status`` rendering: render_jobs / render_job on hand-built models."""

from __future__ import annotations

import datetime as dt

import pytest

from rdzv_client import cli
from rdzv_common.protocol import JobList, JobState, JobSummary, JobView, NodeView, RoundView, WaitingInfo

pytestmark = pytest.mark.timeout(10)

T0 = 1_700_000_000.0


def _columns(header: str, names: list[str]) -> list[int]:
    """Where each column starts in the header line."""
    starts = [header.index(n) for n in names]
    assert starts == sorted(starts), header
    return starts


def _cells(line: str, starts: list[int]) -> list[str]:
    """Split a table line at the header's column starts."""
    bounds = [*starts[1:], None]
    return [line[a:b].strip() for a, b in zip(starts, bounds)]


def _assert_aligned(lines: list[str], starts: list[int]) -> None:
    """Every cell begins exactly at its column: the character before a column
    start is a space and the one at it is not (a cell is never empty)."""
    for line in lines:
        for s in starts[1:]:
            assert line[s - 2 : s] == "  " and line[s] != " ", f"misaligned at {s}: {line!r}"


def _section(text: str, first_header: str) -> list[str]:
    """The table that starts with ``first_header``: its header and its rows."""
    lines = text.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith(first_header))
    out = []
    for ln in lines[i:]:
        if not ln:
            break
        out.append(ln)
    return out


def _node(
    node_id: str,
    rank: int | None,
    state: str = "running",
    host: str = "node1",
    addr: str = "10.0.0.1",
    nproc: int = 8,
    seen: float = 0.25,
) -> NodeView:
    return NodeView(
        node_id=node_id, host=host, addr=addr, state=state, group_rank=rank, local_world_size=nproc, last_seen_s=seen
    )


def _round(n: int, reason: str, started: float, formed_ms: float | None, world: int | None) -> RoundView:
    return RoundView(
        round=n,
        reason=reason,
        started_at=started,
        completed_at=None if formed_ms is None else started + formed_ms / 1000,
        world_size=world,
        nodes=None if world is None else world // 8,
    )


def _job(**kw) -> JobView:
    base = dict(
        job_id="exp1",
        state=JobState.RUNNING,
        round=0,
        min_nodes=2,
        max_nodes=4,
        world_size=16,
        restarts=0,
        max_restarts=3,
        master_addr="10.0.0.1",
        master_port=29501,
        nodes=[],
        spares=[],
        waiting_for=None,
        root_cause=None,
        history=[],
    )
    base.update(kw)
    return JobView(**base)


# ------------------------------------------------------------------ render_jobs


def test_render_jobs_no_jobs() -> None:
    assert cli.render_jobs(JobList(jobs=[])) == "no jobs"


def test_render_jobs_one_aligned_row_per_job() -> None:
    jobs = JobList(
        jobs=[
            JobSummary(
                job_id="exp1",
                state=JobState.RUNNING,
                round=2,
                min_nodes=2,
                max_nodes=8,
                nodes=3,
                world_size=24,
                restarts=1,
                max_restarts=3,
            ),
            JobSummary(
                job_id="a-much-longer-job-id.v2",
                state=JobState.WAITING,
                round=0,
                min_nodes=4,
                max_nodes=4,
                nodes=1,
                world_size=0,
                restarts=0,
                max_restarts=1000000,
            ),
            JobSummary(
                job_id="j",
                state=JobState.SUCCEEDED,
                round=11,
                min_nodes=1,
                max_nodes=1,
                nodes=0,
                world_size=1,
                restarts=10,
                max_restarts=10,
            ),
        ]
    )
    lines = cli.render_jobs(jobs).splitlines()
    assert len(lines) == 4
    names = ["JOB", "STATE", "ROUND", "NODES", "MIN:MAX", "WORLD", "RESTARTS"]
    assert lines[0].split() == names
    starts = _columns(lines[0], names)
    _assert_aligned(lines, starts)
    assert [_cells(ln, starts) for ln in lines[1:]] == [
        ["exp1", "running", "2", "3", "2:8", "24", "1/3"],
        ["a-much-longer-job-id.v2", "waiting", "0", "1", "4:4", "0", "0/unlimited"],  # a plugin job (issue 25)
        ["j", "succeeded", "11", "0", "1:1", "1", "10/10"],
    ]
    # the widest cell sets its column's width; two spaces separate columns; no trailing blanks
    assert starts[1] == len("a-much-longer-job-id.v2") + 2
    assert all(ln == ln.rstrip() for ln in lines)


# ------------------------------------------------------------------- render_job


def test_render_job_running_with_nodes_spares_and_history() -> None:
    job = _job(
        round=1,
        world_size=16,
        restarts=1,
        nodes=[
            _node("node1-100-aaaaaa", 0, seen=0.04).model_copy(
                update={"step": 1200, "steps_per_s": 4.5, "since_progress_s": 0.7, "straggler": True}
            ),
            _node("node10-7-bbbbbb", 1, host="node10", addr="10.0.0.10", seen=12.345),
        ],
        spares=[_node("node3-9-cccccc", None, state="spare", host="node3", addr="10.0.0.3", nproc=4, seen=1.0)],
        history=[
            _round(0, "job created", T0, 1234.4, 24),
            _round(1, "node node2-5-dddddd (node2) connection lost", T0 + 60, 3.2, 16),
        ],
    )
    text = cli.render_job(job)
    head = text.splitlines()[0]
    assert head == ("job exp1: running, round 1, world size 16, nodes 2 (min 2, max 4), spares 1, restarts 1/3")
    assert "master 10.0.0.1:29501" in text.splitlines()
    assert "waiting for" not in text and "root cause" not in text

    nodes = _section(text, "RANK")
    names = ["RANK", "NODE", "HOST", "ADDR", "STATE", "NPROC", "LAST SEEN", "PROGRESS"]
    starts = _columns(nodes[0], names)
    _assert_aligned(nodes, starts)
    assert [_cells(ln, starts) for ln in nodes[1:]] == [
        ["0", "node1-100-aaaaaa", "node1", "10.0.0.1", "running", "8", "0.0s ago", "step 1200 4.5/s 1s ago STRAGGLER"],
        # "-": its workers do not call rdzv_client.worker.progress()
        ["1", "node10-7-bbbbbb", "node10", "10.0.0.10", "running", "8", "12.3s ago", "-"],
        ["-", "node3-9-cccccc", "node3", "10.0.0.3", "spare", "4", "1.0s ago", "-"],  # spares last, no rank
    ]

    hist = _section(text, "ROUND")
    names = ["ROUND", "OPENED", "FORMED IN", "WORLD", "WHY"]
    starts = _columns(hist[0], names)
    _assert_aligned(hist, starts)
    local = lambda ts: dt.datetime.fromtimestamp(ts).strftime("%H:%M:%S.%f")[:-3]  # noqa: E731
    assert [_cells(ln, starts) for ln in hist[1:]] == [
        ["0", local(T0), "1234 ms", "24", "job created"],
        ["1", local(T0 + 60), "3 ms", "16", "node node2-5-dddddd (node2) connection lost"],
    ]
    # sections: header, master, blank, nodes table, blank, history table
    assert text.count("\n\n") == 2


def test_render_job_forming_shows_what_it_waits_for() -> None:
    waiting = WaitingInfo(
        text="1 more node to reach min 2; previous members not back: node2-5-dddddd",
        joined=1,
        min_nodes=2,
        max_nodes=4,
        missing=["node2-5-dddddd"],
    )
    job = _job(
        state=JobState.WAITING,
        round=2,
        world_size=0,
        master_addr=None,
        master_port=None,
        waiting_for=waiting,
        nodes=[_node("node1-100-aaaaaa", None, state="waiting")],
        history=[
            _round(0, "job created", T0, 5.0, 16),
            _round(1, "scale-up: 1 new node(s) x", T0 + 1, 2.0, 24),
            _round(2, "worker failure: ...", T0 + 2, None, None),
        ],
    )
    text = cli.render_job(job)
    lines = text.splitlines()
    assert lines[0].startswith("job exp1: waiting, round 2, world size 0, nodes 1 (min 2, max 4), spares 0,")
    assert not any(ln.startswith("master") for ln in lines), "no master while the round forms"
    assert f"waiting for: {waiting.text}" in lines
    nodes = _section(text, "RANK")
    starts = _columns(nodes[0], ["RANK", "NODE", "HOST", "ADDR", "STATE", "NPROC", "LAST SEEN"])
    assert _cells(nodes[1], starts)[:5] == ["-", "node1-100-aaaaaa", "node1", "10.0.0.1", "waiting"]
    hist = _section(text, "ROUND")
    starts = _columns(hist[0], ["ROUND", "OPENED", "FORMED IN", "WORLD", "WHY"])
    _assert_aligned(hist, starts)
    last = _cells(hist[-1], starts)
    assert (last[0], last[2], last[3], last[4]) == ("2", "-", "-", "worker failure: ...")  # not formed yet


def test_render_job_failed_names_the_root_cause_and_no_nodes() -> None:
    cause = "node node2-5-dddddd (node2) rank 9 (local rank 1, pid 77) failed with signal SIGKILL (out of memory?)"
    job = _job(
        state=JobState.FAILED,
        restarts=3,
        root_cause=cause,
        master_addr=None,
        master_port=None,
        history=[_round(0, "job created", T0, 1.0, 16)],
    )
    text = cli.render_job(job)
    assert f"root cause: {cause}" in text.splitlines()
    assert "no nodes" in text.splitlines()
    assert "restarts 3/3" in text.splitlines()[0]


def test_render_job_shows_the_last_20_rounds() -> None:
    job = _job(round=29, history=[_round(i, f"reason {i}", T0 + i, 1.0, 16) for i in range(30)])
    hist = _section(cli.render_job(job), "ROUND")
    starts = _columns(hist[0], ["ROUND", "OPENED", "FORMED IN", "WORLD", "WHY"])
    _assert_aligned(hist, starts)
    assert [_cells(ln, starts)[0] for ln in hist[1:]] == [str(i) for i in range(10, 30)]


# ----------------------------------------------------------------- the parser


def test_parser_defaults_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RDZV_ENDPOINT", raising=False)
    monkeypatch.delenv("RDZV_TOKEN", raising=False)
    args = cli.build_parser().parse_args(["status"])
    assert (args.endpoint, args.token, args.job, args.json, args.watch) == ("127.0.0.1:29400", None, None, False, False)
    monkeypatch.setenv("RDZV_ENDPOINT", "head:1234")
    monkeypatch.setenv("RDZV_TOKEN", "t0k")
    args = cli.build_parser().parse_args(["status", "exp1", "--watch", "--interval", "0.5"])
    assert (args.endpoint, args.token, args.job, args.watch, args.interval) == ("head:1234", "t0k", "exp1", True, 0.5)
    args = cli.build_parser().parse_args(["--endpoint", "other:1", "--token", "x", "close", "exp1"])
    assert (args.endpoint, args.token, args.command, args.job) == ("other:1", "x", "close", "exp1")


@pytest.mark.parametrize("argv", [[], ["close"], ["status", "a", "b"], ["frobnicate"]])
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert "usage: rdzv" in capsys.readouterr().err


@pytest.mark.parametrize("job", ["a/b", "x?y", "", "-x", "a#b", "j" * 129])
def test_a_job_id_that_is_no_id_is_refused_before_any_request(job: str, capsys) -> None:
    """The id goes into the URL path: ``x/close`` or ``a?b`` would name
    another resource. Refused with exit 2, no server needed (port 1)."""
    with pytest.raises(SystemExit) as e:
        cli.main(
            ["--endpoint", "127.0.0.1:1", "status", job]
            if job != "-x"
            else ["--endpoint", "127.0.0.1:1", "close", "--", job]
        )
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.count("\n") == 1 and "is not a job id" in err


def test_a_bad_endpoint_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["--endpoint", "ftp://x", "status"])
    assert e.value.code == 2
    assert capsys.readouterr().err == "rdzv: endpoint 'ftp://x': scheme must be http or https\n"


def test_render_job_says_when_a_straggler_is_kept_for_want_of_a_spare() -> None:
    note = "no spare waits to replace it: flagged only (straggler policy replace)"
    slow = {"step": 10, "steps_per_s": 0.5, "since_progress_s": 0.2, "straggler": True}
    job = _job(
        nodes=[
            _node("node1-100-aaaaaa", 0).model_copy(update={**slow, "straggler_note": note}),
            _node("node10-7-bbbbbb", 1, host="node10", addr="10.0.0.10").model_copy(update=slow),
        ]
    )
    rows = _section(cli.render_job(job), "RANK")
    assert rows[1].endswith("step 10 0.5/s 0s ago STRAGGLER (no spare to replace it)")
    assert rows[2].endswith("step 10 0.5/s 0s ago STRAGGLER")


def test_an_events_line_names_the_run_only_after_the_first() -> None:
    render_event = cli.render_event
    ev = {"id": 1, "time": 1.0, "type": "job_state", "job": "j", "run": 1, "round": 0, "node": None, "state": "waiting"}
    assert "run=" not in render_event(ev) and "state=waiting" in render_event(ev)
    assert "run=2" in render_event({**ev, "run": 2})


def test_render_job_of_a_big_job_counts_every_node_and_lists_a_page() -> None:
    """`rdzv status JOB` of a 16,384-node job asks for a page of nodes (issue 24): the
    header counts them all (node_counts), the footer says how many more and in which states."""
    job = _job(
        nodes=[_node("node1-100-aaaaaa", 0), _node("node10-7-bbbbbb", 1, host="node10", addr="10.0.0.10")],
        spares=[],
    ).model_copy(update={"node_counts": {"running": 16380, "spare": 4}, "nodes_omitted": 16382})
    text = cli.render_job(job)
    assert ", nodes 16380 (min 2, max 4), spares 4, " in text.splitlines()[0]
    assert "(+16382 more nodes not listed; all of them: 16380 running, 4 spare)" in text.splitlines()
