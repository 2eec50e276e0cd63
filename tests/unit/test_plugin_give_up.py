"""The torchrun plugin's give-up report: torchrun's ChildFailedError (real
torch objects, an error file as torch's ``@record`` writes it) as exit records."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

pytest.importorskip("torch")

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from rdzv_client.torch_params import exit_records as _exit_records
from rdzv_common.protocol import Assignment

A = Assignment(
    job_id="j",
    round=2,
    group_rank=1,
    group_world_size=2,
    local_world_size=2,
    rank_offset=2,
    world_size=4,
    master_addr="127.0.0.1",
    master_port=29500,
    max_restarts=0,
    restarts=0,
)


def test_failures_become_exit_records_with_the_error_files_message(tmp_path: Path) -> None:
    error_file = tmp_path / "error.json"
    error_file.write_text(
        json.dumps(
            {
                "message": {
                    "message": "RuntimeError: boom at step 7",
                    "extraInfo": {"py_callstack": "Traceback ...\nRuntimeError: boom at step 7", "timestamp": "1700"},
                }
            }
        )
    )
    failed = ProcessFailure(local_rank=1, pid=4242, exitcode=1, error_file=str(error_file))
    killed = ProcessFailure(local_rank=0, pid=4241, exitcode=-signal.SIGKILL, error_file="<N/A>")
    records = _exit_records(ChildFailedError("train.py", {3: failed, 2: killed}), A)
    assert [(r.rank, r.local_rank, r.pid) for r in records] == [(2, 0, 4241), (3, 1, 4242)]
    assert (records[0].exit_code, records[0].signal, records[0].message) == (None, "SIGKILL", "")
    assert (records[1].exit_code, records[1].signal, records[1].timestamp) == (1, None, 1700.0)
    assert records[1].message.startswith("RuntimeError: boom at step 7")
    assert "rank 3 (local rank 1, pid 4242) failed with exit code 1: RuntimeError: boom at step 7" in (
        records[1].describe()
    )


def test_a_failure_that_does_not_fit_the_wire_still_gives_one_record_naming_this_node() -> None:
    odd = ProcessFailure(local_rank=10**9, pid=1, exitcode=1, error_file="<N/A>")  # beyond the wire's bounds
    (record,) = _exit_records(ChildFailedError("train.py", {0: odd}), A)
    assert record.rank == A.rank_offset and record.exit_code == 1 and "gave up" in record.message


@pytest.mark.parametrize(("conf", "new_run"), [({}, True), ({"new_run": "0"}, False), ({"new_run": "1"}, True)])
def test_rdzv_conf_new_run_reaches_the_join(conf: dict, new_run: bool) -> None:
    """``--rdzv-conf new_run=0``: a finished job id refuses this torchrun instead of starting its next run."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from rdzv_client.torch_plugin import RdzvRendezvousHandler

    params = RendezvousParameters(
        backend="rdzv", endpoint="127.0.0.1:29400", run_id="j", min_nodes=1, max_nodes=1, local_addr="127.0.0.1", **conf
    )
    handler = RdzvRendezvousHandler(params)  # connects on its first rendezvous only
    assert handler.session.join_msg()["new_run"] is new_run
