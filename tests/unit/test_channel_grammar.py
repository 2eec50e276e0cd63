"""The worker channel's grammar (rdzv_client/channel_grammar.py), written once
for both sides: what the agent writes, the worker reads back unchanged."""

from __future__ import annotations

import subprocess
import sys

from rdzv_client import channel_grammar as grammar
from rdzv_client.reform import in_place_assignment
from rdzv_common.protocol import Assignment

A = Assignment(
    job_id="j",
    round=5,
    group_rank=1,
    group_world_size=2,
    local_world_size=2,
    rank_offset=2,
    world_size=4,
    master_addr="10.0.0.1",
    master_port=29555,
    max_restarts=3,
    restarts=1,
)


def test_an_assignment_reads_back_as_the_round_and_exactly_the_assigned_names() -> None:
    order = grammar.parse_order(in_place_assignment(A, 1, "j", virtual_local_rank=False).encode())
    assert order is not None and (order.kind, order.round) == (grammar.ASSIGN, 5)
    assert tuple(order.env) == grammar.ASSIGNED_VARS
    assert (order.env["RANK"], order.env["LOCAL_RANK"], order.env["MASTER_PORT"]) == ("3", "1", "29555")


def test_stop_and_where_read_back() -> None:
    assert grammar.parse_order(grammar.stop(7).encode()) == grammar.Order(grammar.STOP, 7, {})
    assert grammar.parse_order(grammar.ask_where(7).encode()) == grammar.Order(grammar.ASK_WHERE, 7, {})


def test_a_datagram_without_a_round_is_no_order() -> None:
    for data in (b"", b"stop", b"stop x", b"assign", "stop \u0663".encode()):
        assert grammar.parse_order(data) is None, data


def test_the_worker_reads_the_grammar_without_importing_more_than_the_standard_library() -> None:
    """rdzv_client.worker is what training scripts import: the grammar adds no dependency."""
    code = (
        "import sys\n"
        "from rdzv_client import worker\n"
        "from rdzv_client import channel_grammar\n"
        "print(worker.ASSIGNED_VARS == frozenset(channel_grammar.ASSIGNED_VARS), "
        "sorted(m for m in sys.modules if m.split('.')[0] in "
        "('rdzv_common', 'rdzv_server', 'pydantic', 'aiohttp', 'torch')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "[]"]
