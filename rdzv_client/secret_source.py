"""Where a job secret comes from: a file (``--job-secret-file`` for rdzv-agent,
``--rdzv-conf job_secret_file=PATH`` for torchrun), the environment
(``RDZV_JOB_SECRET``, or ``RDZV_JOB_SECRET_FILE`` naming a file), or the command
line (``--job-secret``, ``--rdzv-conf job_secret=``), which every user of the
machine reads in ``ps``: that one works, with a warning (once per process).

The file holds the secret on its first line (a trailing newline is dropped);
a file that others may read is said too. One place for the agent and the plugin."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping

log = logging.getLogger("rdzv_agent")

SECRET_FILE_ENV = "RDZV_JOB_SECRET_FILE"
SECRET_ENV = "RDZV_JOB_SECRET"
# a secret file larger than this is not a secret file (a wrong path: a log, a binary)
MAX_SECRET_FILE_BYTES = 4096

_warned: set[str] = set()


class SecretSourceError(ValueError):
    """A secret file that cannot be used, or two sources given at once."""


def read_secret_file(path: str) -> str:
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise SecretSourceError(f"job secret file {path!r} is not a regular file")
            data = f.read(MAX_SECRET_FILE_BYTES + 1)
    except OSError as e:
        raise SecretSourceError(f"cannot read the job secret file {path!r}: {e.strerror or e}") from None
    if len(data) > MAX_SECRET_FILE_BYTES:
        raise SecretSourceError(f"job secret file {path!r} is over {MAX_SECRET_FILE_BYTES} bytes: not a secret file")
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise SecretSourceError(f"job secret file {path!r}: the secret must be printable ASCII") from None
    lines = text.splitlines()
    secret = lines[0] if lines else ""
    if any(line.strip() for line in lines[1:]):
        raise SecretSourceError(f"job secret file {path!r}: the secret is its only line")
    if not secret:
        raise SecretSourceError(f"job secret file {path!r} is empty")
    if st.st_mode & 0o077 and "mode:" + path not in _warned:
        _warned.add("mode:" + path)
        log.warning(
            "the job secret file %s can be read by other users (mode %o): chmod 600 it", path, st.st_mode & 0o777
        )
    return secret


def job_secret(
    flag: str | None, file: str | None, flag_name: str, file_name: str, env: Mapping[str, str] = os.environ
) -> str | None:
    """The job secret: ``flag`` (the command line's), else ``file``, else
    $RDZV_JOB_SECRET_FILE, else $RDZV_JOB_SECRET, else None. ``flag_name`` /
    ``file_name``: how the user spelled them, for the messages."""
    if flag is not None and file is not None:
        raise SecretSourceError(f"give {flag_name} or {file_name}, not both")
    if flag is not None:
        if flag_name not in _warned:
            _warned.add(flag_name)
            log.warning(
                "%s puts the job secret on the command line, where every user of this machine sees it (ps); "
                "use %s or $%s",
                flag_name,
                file_name,
                SECRET_ENV,
            )
        return flag
    if file is not None:
        return read_secret_file(file)
    if env.get(SECRET_FILE_ENV):
        return read_secret_file(env[SECRET_FILE_ENV])
    return env.get(SECRET_ENV) or None
