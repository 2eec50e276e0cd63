"""``--help`` text for rdzv-server and rdzv-agent: flags in groups, the
essentials first, each default stated once (issue 25: the server's help said
"(default: None)", some defaults twice, and three flags had no help).

:class:`HelpFormatter` appends argparse's "(default: X)" only where there is
a default to state and the help text does not already say it. :func:`arrange`
moves a parser's flags, by ``dest``, from argparse's one "options" group into
named groups listed right after it (-h and --version stay there); which flag
goes where is each program's own table (:data:`GROUPS` for the server,
rdzv_client.help_groups for the agent)."""

from __future__ import annotations

import argparse

# rdzv-server's flags by group, essentials first; the HA flags are a group of their own in flags.py
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("essentials", ("host", "port", "data_dir", "token")),
    ("security", ("insecure", "operator_token", "tls_cert", "tls_key")),
    (
        "connections: limits and timeouts",
        (
            "disconnect_grace",
            "header_timeout",
            "body_timeout",
            "idle_timeout",
            "join_deadline",
            "max_connections",
            "max_connections_per_address",
        ),
    ),
    (
        "jobs: how many, how long they are kept",
        ("retain_finished", "max_waiting_jobs", "max_waiting_jobs_per_address", "min_free_disk"),
    ),
    ("hosts that fail: cool-downs", ("host_failures", "host_failure_window", "host_cooldown", "host_cooldown_max")),
    ("logging", ("log_level", "log_format")),
    ("speed", ("event_loop",)),
)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show a default only where there is one and the help does not say it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, "") or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def arrange(p: argparse.ArgumentParser, groups: tuple[tuple[str, tuple[str, ...]], ...]) -> None:
    """Move ``p``'s flags named in ``groups`` (by dest) from argparse's
    "options" group into those groups, listed in that order right after it."""
    general = p._optionals
    made = []
    for title, dests in groups:
        group = p.add_argument_group(title)
        for dest in dests:
            for action in [a for a in general._group_actions if a.dest == dest]:
                general._group_actions.remove(action)
                group._group_actions.append(action)
        made.append(group)
    rest = [g for g in p._action_groups if g not in made]
    at = rest.index(general) + 1
    p._action_groups[:] = rest[:at] + made + rest[at:]
