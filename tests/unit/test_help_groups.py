"""``rdzv-agent --help`` grouped, the essentials first, each default stated
once (issue 25: ~40 flags in one list, some defaults said twice)."""

from __future__ import annotations

import argparse
import re

from rdzv_client import help_groups
from rdzv_client.config import _HelpFormatter, build_parser
from rdzv_client.spec_flags import SPEC_GROUP


def _groups(p: argparse.ArgumentParser) -> list[tuple[str, list[str]]]:
    return [(g.title or "", [a.dest for a in g._group_actions]) for g in p._action_groups]


def test_the_essentials_come_first_and_every_flag_of_configs_own_is_in_a_group() -> None:
    p = build_parser()
    groups = _groups(p)
    titles = [t for t, _ in groups]
    assert titles[:3] == ["positional arguments", "options", "essentials"]
    assert titles.index(SPEC_GROUP) > titles.index(help_groups.GROUPS[-1][0])
    assert dict(groups)["options"] == ["help", "version"]  # nothing left ungrouped
    named = [d for _, dests in help_groups.GROUPS for d in dests]
    assert len(named) == len(set(named))
    listed = [d for t, dests in groups if t in dict(help_groups.GROUPS) for d in dests]
    assert list(dict.fromkeys(listed)) == named  # each named flag exists, in the table's order


def test_the_help_shows_the_groups_in_that_order() -> None:
    text = build_parser().format_help()
    heads = [m.group(1) for m in re.finditer(r"^(\S[^\n]*):$", text, re.M)]
    assert heads[:3] == ["positional arguments", "options", "essentials"]
    essentials = text.split("\nessentials:\n", 1)[1].split("\n\n", 1)[0]
    for flag in ("--endpoint", "--job-id", "--nnodes", "--nproc-per-node", "--standalone"):
        assert flag in essentials


def test_each_default_is_stated_once() -> None:
    p = build_parser()
    fmt = _HelpFormatter(prog="rdzv-agent")
    for action in p._actions:
        text = (fmt._get_help_string(action) or "").replace("%(default)s", "VALUE")
        assert len(re.findall(r"\bdefaults?\b", text)) <= 1, (action.dest, text)
        if action.dest in {d for _, dests in help_groups.GROUPS for d in dests} and "default" in text:
            assert "default:" in text, (action.dest, text)  # one form: "(default: ...)"
