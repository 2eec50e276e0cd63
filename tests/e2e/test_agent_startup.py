"""Start-up is part of recovery: the real rdzv-agent's join reaches the real
server before the agent has imported pydantic (or aiohttp).

The agent runs with a ``sitecustomize`` that hooks the import system: the
moment anything first imports pydantic, the hook (in the agent's own thread,
so the agent can send nothing meanwhile) asks the server over REST, until a
deadline, whether this agent's node has joined, and writes the answer down.
An agent that imported pydantic before it sent its join would find no node
there: its join cannot leave while the hook holds it."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

from tests.helpers.cluster import Cluster
from tests.helpers.procs import ROOT, wait_until

HOOK = textwrap.dedent("""
    import json, os, sys, time, urllib.request

    _OUT, _URL = os.environ["STARTUP_HOOK_OUT"], os.environ["STARTUP_HOOK_URL"]

    class _FirstImport:
        seen = set()

        def find_spec(self, name, path=None, target=None):
            top = name.split(".")[0]
            if top in ("pydantic", "aiohttp") and top not in self.seen:
                self.seen.add(top)
                joined, deadline = None, time.monotonic() + 10
                while time.monotonic() < deadline:
                    try:
                        with urllib.request.urlopen(_URL, timeout=2) as r:
                            joined = [n["node_id"] for n in json.load(r)["nodes"]]
                        if joined:
                            break
                    except OSError:
                        pass
                    time.sleep(0.05)
                with open(_OUT, "a") as f:
                    f.write(json.dumps({"module": top, "nodes_joined": joined}) + "\\n")
            return None

    sys.meta_path.insert(0, _FirstImport())
""")


def test_the_join_reaches_the_server_before_pydantic_is_imported(cluster: Cluster, tmp_path: Path) -> None:
    server = cluster.start_server()
    hook_dir = tmp_path / "hook"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(HOOK)
    out = tmp_path / "first-imports.jsonl"
    env = {
        "PYTHONPATH": f"{hook_dir}:{ROOT}",
        "STARTUP_HOOK_OUT": str(out),
        "STARTUP_HOOK_URL": f"{server.url}/v1/jobs/startup",
    }
    # 2 nodes: no round forms; the agent joins and waits
    agent = cluster.start_agent(
        server, "startup", sys.executable, "-c", "pass", nnodes="2", env=env, flags=("--no-python",)
    )
    wait_until(lambda: out.exists() and "pydantic" in out.read_text(), 30, "the agent to import pydantic")
    firsts = {r["module"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert "aiohttp" not in firsts, firsts  # the agent never needs it
    assert firsts["pydantic"]["nodes_joined"], firsts  # the join was in before pydantic
    assert agent.popen.poll() is None, agent.text()[-2000:]
