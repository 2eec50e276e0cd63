"""What server and client share has one neutral home, rdzv_common (issue 21: one fact, one place): the client
imports nothing of the server package, the shared package imports neither side, and no module is left under
its old name in rdzv_server (no re-export shims)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERVER, CLIENT, COMMON = "rdzv_server", "rdzv_client", "rdzv_common"
# The one exception: `rdzv-agent --standalone` runs the server in its own process, so agent.py starts it,
# importing it only then (inside the function), never at import time.
ALLOWED = {("rdzv_client/agent.py", "rdzv_server.embedded")}


def imports(package: str) -> list[tuple[str, str, bool]]:
    """(file, absolute module, at module level) of every import in a package's modules."""
    out = []
    for path in sorted((REPO / package).rglob("*.py")):
        rel = path.relative_to(REPO)
        pkg = list(rel.parent.parts)
        tree = ast.parse(path.read_text())
        top = {id(n) for n in tree.body} | {
            id(c) for n in tree.body if isinstance(n, (ast.If, ast.Try)) for c in ast.walk(n)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = pkg[: len(pkg) - node.level + 1] if node.level else []
                mod = ".".join(base + ([node.module] if node.module else []))
                mods = [mod]
            else:
                continue
            out.extend((str(rel), m, id(node) in top) for m in mods)
    return out


def of(package: str, found: list[tuple[str, str, bool]]) -> list[tuple[str, str, bool]]:
    return [f for f in found if f[1] == package or f[1].startswith(package + ".")]


def test_the_client_imports_nothing_of_the_server_but_the_standalone_start() -> None:
    found = of(SERVER, imports(CLIENT))
    assert {(f, m) for f, m, _ in found} == ALLOWED, found
    assert [f for f in found if f[2]] == [], "imported at module level: the agent would load the server"


def test_the_shared_package_imports_neither_side() -> None:
    found = imports(COMMON)
    assert of(SERVER, found) + of(CLIENT, found) == []


def test_no_shared_module_is_left_in_the_server_under_its_old_name() -> None:
    shared = {p.name for p in (REPO / COMMON).glob("*.py")} - {"__init__.py"}
    assert shared, "rdzv_common has no modules"
    assert sorted(shared & {p.name for p in (REPO / SERVER).glob("*.py")}) == []


def test_the_client_runs_without_loading_the_server() -> None:
    """The same, at run time: the agent, the rdzv command, the REST client and the node session load the
    wire contract from rdzv_common and no module of rdzv_server."""
    code = (
        "import sys\n"
        "import rdzv_client.agent, rdzv_client.cli, rdzv_client.rest, rdzv_client.session, rdzv_client.reactions\n"
        "import rdzv_common.protocol\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'rdzv_server'), 'rdzv_common' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]", "True"]
