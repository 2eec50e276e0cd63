"""``rdzv-server --help`` grouped, the essentials first, every flag with help,
each default stated once and none as "(default: None)" (issue 25)."""

from __future__ import annotations

import argparse
import re

from rdzv_common import help_format
from rdzv_server.flags import build_parser


def _groups(p: argparse.ArgumentParser) -> list[tuple[str, list[str]]]:
    return [(g.title or "", [a.dest for a in g._group_actions]) for g in p._action_groups]


def test_every_flag_has_help_and_no_default_is_none_or_said_twice() -> None:
    p = build_parser()
    text = p.format_help()
    assert "(default: None)" not in text and "(default: False)" not in text, text
    fmt = help_format.HelpFormatter(prog="rdzv-server")
    for action in p._actions:
        assert (action.help or "").strip(), f"--{action.dest} has no help"
        shown = (fmt._get_help_string(action) or "").replace("%(default)s", "VALUE")
        assert len(re.findall(r"\bdefaults?\b", shown)) <= 1, (action.dest, shown)
        if "default" in shown:
            assert "(default: " in shown, (action.dest, shown)  # one form


def test_a_real_default_is_shown() -> None:
    p = build_parser()
    fmt = help_format.HelpFormatter(prog="rdzv-server")
    shown = {a.dest: fmt._get_help_string(a) or "" for a in p._actions}
    for dest in ("port", "retain_finished", "host_failure_window", "host_cooldown_max", "disconnect_grace"):
        assert shown[dest].endswith("(default: %(default)s)"), (dest, shown[dest])
    assert "(default: 29400)" in p.format_help()


def test_the_essentials_come_first_and_every_flag_is_in_a_group() -> None:
    p = build_parser()
    groups = _groups(p)
    titles = [t for t, _ in groups]
    assert titles[:3] == ["positional arguments", "options", "essentials"]
    assert dict(groups)["options"] == ["help", "version"]  # nothing left ungrouped
    named = [d for _, dests in help_format.GROUPS for d in dests]
    assert len(named) == len(set(named))
    listed = [d for t, dests in groups if t in dict(help_format.GROUPS) for d in dests]
    assert listed == named  # each named flag exists, in the table's order
    heads = [m.group(1) for m in re.finditer(r"^(\S[^\n]*):$", p.format_help(), re.M)]
    assert heads[:2] == ["options", "essentials"], heads
    essentials = p.format_help().split("\nessentials:\n", 1)[1].split("\n\n", 1)[0]
    for flag in ("--host", "--port", "--data-dir", "--token"):
        assert flag in essentials
