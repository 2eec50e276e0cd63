"""``rdzv-agent --help`` in groups, the essentials first (issue 25: it was ~40
flags in one list). The flags are defined once, in rdzv_client.config
(the job spec's in rdzv_client.spec_flags, torchrun's in
rdzv_client.torchrun_flags, each already a group); this table only says which
group each of config's own flags is listed under, by its ``dest``.
:func:`arrange` moves them there after the parser is built and puts these
groups before the job spec's. A flag config adds that is not named here
fails the unit test (tests/unit/test_help_groups.py), never the agent."""

from __future__ import annotations

import argparse

from rdzv_common import help_format

GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("essentials", ("endpoint", "job_id", "nnodes", "nproc_per_node", "standalone")),
    (
        "the workers: how they start and stop",
        ("module", "no_python", "run_path", "role", "virtual_local_rank", "stop_timeout", "signals_to_handle"),
    ),
    (
        "worker output and logs",
        ("log_dir", "redirects", "tee", "local_ranks_filter", "line_prefix", "log_format"),
    ),
    (
        "this node: identity, credentials, runs of a job id",
        ("node_rank", "local_addr", "host_name", "token", "job_secret", "job_secret_file", "new_run"),
    ),
    ("the server and this host's health", ("server_timeout", "health_check", "health_check_timeout", "rdzv_conf")),
)


def arrange(p: argparse.ArgumentParser) -> None:
    """Move config's flags from argparse's one "options" group into GROUPS,
    listed in that order right after it (-h and --version stay there)."""
    help_format.arrange(p, GROUPS)
