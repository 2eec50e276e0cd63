"""What rdzv-agent checks on this node before it joins a job: that the training script or
command it would start exists and can be started. A missing ``train.py`` is one line and exit 2
before the server hears of the node: no job is created, no restart is charged, no host is cooled
down (without this check each worker start failed, the job restarted until its budget was spent,
and the host collected failures).

It checks the worker command itself (AgentConfig.cmd, as config.config_from_args builds it), so
what is checked is what would run: ``python -u SCRIPT ...`` (a script, also torchrun's
``--run-path``): SCRIPT is a file, or a directory or zip file with a ``__main__`` module, as Python
runs them; ``python -u -m MODULE ...``: its top-level package is found from the working directory
and ``sys.path`` (nothing is imported); anything else (``--no-python``): an executable file, named
by a path or found on ``PATH``. A name with ``$local_rank`` in it is left to the workers (it
differs per worker).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import zipfile
from pathlib import Path
from string import Template


def _per_worker(arg: str) -> bool:
    """Whether ``arg`` names ``$local_rank`` (workers.py substitutes it per worker)."""
    return Template(arg).safe_substitute(local_rank="0") != arg


def command_problem(cmd: list[str]) -> str | None:
    """Why the agent's workers could not start ``cmd``, or None."""
    python = len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-u"
    if python and cmd[2] == "-m":
        name = cmd[3] if len(cmd) > 3 else ""
        return None if _per_worker(name) else _module_problem(name)
    if python and cmd[2].startswith("-"):  # --no-python python -u -c CODE, say: nothing to look for
        return None
    target = cmd[2] if python else cmd[0]
    if _per_worker(target):
        return None
    return _script_problem(target) if python else _executable_problem(target)


def _script_problem(script: str) -> str | None:
    path = Path(script)
    if path.is_file():
        if zipfile.is_zipfile(path) and not _zip_has_main(path):
            return f"training script {script!r} is a zip file without __main__.py"
        return None if os.access(path, os.R_OK) else f"training script {script!r} cannot be read"
    if path.is_dir():
        if (path / "__main__.py").is_file():
            return None
        return f"training script {script!r} is a directory without __main__.py"
    return f"training script {script!r} not found (working directory {os.getcwd()})"


def _zip_has_main(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as z:
            return "__main__.py" in z.namelist()
    except (OSError, zipfile.BadZipFile):
        return False


def _module_problem(name: str) -> str | None:
    top = name.split(".", 1)[0]
    if not top.isidentifier():
        return f"-m {name!r}: not a module name"
    # what `python -m` searches: the working directory first, then sys.path, through every finder
    # (editable installs have their own); finding a top-level module imports nothing
    saved = sys.path[:]
    sys.path.insert(0, os.getcwd())
    try:
        found = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        found = False
    finally:
        sys.path[:] = saved
    return None if found else f"-m {name!r}: no module {top!r} found (working directory {os.getcwd()}, or sys.path)"


def _executable_problem(command: str) -> str | None:
    if os.sep in command or (os.altsep and os.altsep in command):
        path = Path(command)
        if not path.exists():
            return f"--no-python command {command!r} not found"
        if path.is_dir() or not os.access(path, os.X_OK):
            return f"--no-python command {command!r} is not an executable file"
        return None
    if shutil.which(command) is None:
        return f"--no-python command {command!r} not found on PATH"
    return None
