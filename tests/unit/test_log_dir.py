"""--log-dir as the docs now say (issue 25): as torchrun, it keeps the error
files, and worker output only for the streams --redirects/--tee send to files;
alone it writes no stdout.log/stderr.log, and the agent's line says so (it read
"keep worker logs" and users found empty directories). Real workers."""

from __future__ import annotations

import asyncio
from pathlib import Path

from rdzv_client.attempt import log_dir_line, run_log_dir
from rdzv_client.launch import Std
from tests.unit.test_config import BASE, cfg_of
from tests.unit.test_workers import WAIT_S, make_group

CODE = """
import json, os, sys
print("to stdout"); print("to stderr", file=sys.stderr)
with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as fp:
    json.dump({"message": "RuntimeError: kept"}, fp)
raise SystemExit(1)
"""


async def _run(tmp_path: Path, **kw: object) -> Path:
    group = make_group(CODE, tmp_path, log_dir=tmp_path / "logs", console=None, **kw)
    await group.start()
    await asyncio.wait_for(group.wait(), WAIT_S)
    await group.stop(timeout=5)
    return tmp_path / "logs" / "attempt_0" / "0"


async def test_log_dir_alone_keeps_error_files_and_no_output(tmp_path: Path) -> None:
    rank_dir = await _run(tmp_path)
    assert sorted(p.name for p in rank_dir.iterdir()) == ["error.json"]


async def test_with_tee_3_it_keeps_the_output_too(tmp_path: Path) -> None:
    rank_dir = await _run(tmp_path, tee=Std.ALL)
    assert sorted(p.name for p in rank_dir.iterdir()) == ["error.json", "stderr.log", "stdout.log"]
    assert (rank_dir / "stdout.log").read_text() == "to stdout\n"


def test_the_agents_line_says_what_goes_there(tmp_path: Path) -> None:
    alone = cfg_of(*BASE, "--log-dir", str(tmp_path))
    where = run_log_dir(alone, tmp_path / "agent")
    assert where is not None and where.parent == tmp_path
    line = log_dir_line(alone, where)
    assert line.startswith(f"log directory set to: {where} ") and "error files only" in line and "--tee 3" in line
    for flag in ("--tee", "--redirects"):
        cfg = cfg_of(*BASE, "--log-dir", str(tmp_path), flag, "2")
        assert log_dir_line(cfg, where) == f"log directory set to: {where}"


def test_the_help_no_longer_promises_logs_without_redirects_or_tee() -> None:
    from rdzv_client.config import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "keep worker error files, and the logs --redirects/--tee ask for" in text
