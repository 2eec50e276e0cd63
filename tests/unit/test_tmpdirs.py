"""The agent's private directory and the sweep of dead agents' (rdzv_client/tmpdirs.py)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from rdzv_client.tmpdirs import open_agent_dir, sweep


def test_own_dir_is_private_locked_and_removed_on_close(tmp_path: Path) -> None:
    d = open_agent_dir(tmp_path / "base")
    assert d.path == tmp_path / "base" / f"agent-{os.getpid()}"
    assert stat.S_IMODE(os.stat(tmp_path / "base").st_mode) == 0o700
    (d.path / "f").write_text("x")
    assert sweep(tmp_path / "base") == []  # our own: never
    d.close()
    assert list((tmp_path / "base").iterdir()) == []


def test_sweep_spares_a_live_holder_and_removes_a_dead_one(tmp_path: Path) -> None:
    base = tmp_path / "base"
    code = (
        "import sys, time; from pathlib import Path; from rdzv_client.tmpdirs import open_agent_dir; "
        "d = open_agent_dir(Path(sys.argv[1])); print(d.path, flush=True); sys.stdin.read()"
    )
    live = subprocess.Popen([sys.executable, "-c", code, str(base)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert live.stdout is not None
        # the live agent has opened (and swept) before the dead one starts: else, started late under
        # load, its own start-up sweep removed the dead one's directory first (seen once in a full run)
        live_path = Path(live.stdout.readline().decode().strip())
        dead = subprocess.run([sys.executable, "-c", code.replace("sys.stdin.read()", "pass"), str(base)], check=True)
        assert dead.returncode == 0
        removed = sweep(base)
        assert [p.name for p in removed] and live_path not in removed
        assert live_path.is_dir()
    finally:
        live.kill()
        live.communicate()
    assert [p.name for p in sweep(base)] == [live_path.name]
    assert list(base.iterdir()) == []


def test_a_base_dir_of_someone_else_or_a_link_is_not_used(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "base").symlink_to(target)
    d = open_agent_dir(tmp_path / "base")
    try:
        assert d.path.parent != target and d.path.name.startswith("rdzv-agent-")
        assert list(target.iterdir()) == []
    finally:
        d.close()
    assert not d.path.exists()
