"""What the agent's failure report carries (issue 25): the first failing
rank's last stderr lines (bounded, colours dropped, control characters
escaped), also when an error file gave the message; and an in-place worker
whose round store port was taken reported as such (reason "store_port", which
the server does not charge). Real workers (a WorkerGroup of python processes)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from rdzv_client.attempt import exit_records
from rdzv_client.exits import ExitInfo, report_tail
from rdzv_client.inplace_store import STORE_PORT_EXIT
from rdzv_common.protocol import MAX_STDERR_LINE, MAX_STDERR_LINES, ExitRecord, FailedMsg
from rdzv_common.sizes import MAX_TAIL_BYTES, json_len
from tests.unit.test_workers import WAIT_S, assignment, make_group


class Watch:
    """The two questions exit_records asks the agent's WorkerWatch (no timer kills here)."""

    def timer_killed(self, pid: int) -> bool:
        return False

    def exit_message(self, i: ExitInfo) -> str:
        return i.message


FAILING = r"""
import json, os, sys, time
for i in range(30):
    print(f"noise {i}", file=sys.stderr)
print("\x1b[1;31mRuntimeError: CUDA error: device-side assert\x1b[0m \u202e", file=sys.stderr)
sys.stderr.flush()
if os.environ.get("WRITE_ERROR_FILE"):
    with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as fp:
        json.dump({"message": "RuntimeError: from the error file"}, fp)
time.sleep(float(os.environ.get("DELAY", "0")))
raise SystemExit(1)
"""


async def _failed(tmp_path: Path, codes: list[str]) -> list[ExitInfo]:
    group = make_group(codes, tmp_path, console=None)
    await group.start()
    try:
        failed = await asyncio.wait_for(group.wait(), WAIT_S)
        infos = await group.stop(timeout=5)
    finally:
        await group.stop(timeout=1)
    return [i for i in infos if not i.ok] or failed


async def test_the_first_failures_last_stderr_lines_travel_escaped_and_bounded(tmp_path: Path) -> None:
    infos = await _failed(tmp_path, [FAILING, "import time; time.sleep(60)"])
    failed = [i for i in infos if i.exit_code == 1]
    assert len(failed) == 1 and failed[0].stderr, infos
    records = exit_records(assignment(local_world_size=2), [i for i in infos if not i.ok], Watch(), in_place=False)
    first = next(r for r in records if r.local_rank == 0)
    assert first.stderr is not None and len(first.stderr) == MAX_STDERR_LINES
    assert first.stderr[-1] == "RuntimeError: CUDA error: device-side assert \\u202e"  # colours gone, bidi escaped
    assert first.stderr[0] == "noise 11" and first.stderr[-2] == "noise 29"
    assert all(r.stderr is None for r in records if r is not first)  # the SIGTERMed peer: no tail
    FailedMsg(round=4, failures=records)  # the wire takes it


async def test_the_tail_travels_also_when_an_error_file_gave_the_message(tmp_path: Path) -> None:
    code = "import os; os.environ['WRITE_ERROR_FILE'] = '1'\n" + FAILING
    infos = await _failed(tmp_path, [code])
    (rec,) = exit_records(assignment(local_world_size=1), infos, Watch(), in_place=False)
    assert rec.message.startswith("RuntimeError: from the error file")
    assert rec.stderr is not None and "device-side assert" in rec.stderr[-1]
    assert json.loads(FailedMsg(round=0, failures=[rec]).model_dump_json())["failures"][0]["stderr"] == rec.stderr


def test_report_tail_bounds_lines_bytes_and_control_characters() -> None:
    hostile = ["\x00\x07\x1b]0;title\x07" + "\U0001f4a5" * 5000] * 100 + ["\x1b[2J\x1b[Hplain \x1b(B"]
    tail = report_tail(hostile)
    assert tail is not None and len(tail) <= MAX_STDERR_LINES
    assert all(len(t) <= MAX_STDERR_LINE and json_len(t) <= MAX_STDERR_LINE for t in tail)
    assert sum(json_len(t) + 3 for t in tail) <= MAX_TAIL_BYTES
    assert all(c >= " " and c != "\x7f" for t in tail for c in t)
    assert tail[-1] == "plain \\x1b(B"
    ExitRecord(local_rank=0, rank=0, pid=1, stderr=tail)  # within the server's model
    assert report_tail([]) is None


def _info(local_rank: int, code: int, ts: float) -> ExitInfo:
    return ExitInfo(local_rank, 100 + local_rank, code, None, "m", ts, stderr=(f"line of {local_rank}",))


def test_the_tail_goes_with_the_earliest_failure_as_the_server_names_it() -> None:
    records = exit_records(assignment(), [_info(0, 1, 20.0), _info(1, 2, 10.0)], Watch(), in_place=False)
    assert [r.stderr for r in records] == [None, ["line of 1"]]


def test_a_store_port_exit_is_reason_store_port_in_place_only() -> None:
    failed = [_info(0, STORE_PORT_EXIT, 1.0)]
    assert [r.reason for r in exit_records(assignment(), failed, Watch(), in_place=True)] == ["store_port"]
    assert [r.reason for r in exit_records(assignment(), failed, Watch(), in_place=False)] == [None]
    assert [r.reason for r in exit_records(assignment(), [_info(0, 1, 1.0)], Watch(), in_place=True)] == [None]
