"""The documentation holds together: README.md is a short front door, every relative link and
#anchor in the Markdown pages resolves, every docs/ page is reachable from README, and
docs/architecture.md has a row for every module (issue 21: one fact, one place, found in one step)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
README_MAX_LINES = 350
# the pages whose links are checked: README, every docs/ page, and the two other front pages
PAGES = [README, *sorted(DOCS.glob("*.md")), REPO / "CONTRIBUTING.md", REPO / "deploy" / "README.md"]
MODULE_DIRS = ["rdzv_common", "rdzv_server", "rdzv_server/rounds", "rdzv_client"]

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a `# comment` in a shell block is no heading)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lowercase, punctuation but '-' and '_' dropped,
    each space a '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor on the page; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(page.read_text()):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    """Every link target outside code; a link's text may run over a line break."""
    prose = "\n".join(prose_lines(page.read_text()))
    prose = re.sub(r"``.*?``|`[^`]*`", "", prose, flags=re.S)  # a link inside `code` is no link
    return [m.group(1) for m in LINK.finditer(prose)]


def shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def broken_links(page: Path) -> list[str]:
    bad = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no file {shown(dest)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {shown(dest)}")
    return bad


def test_slug_follows_githubs_rules():
    assert slug("High availability: replicas on etcd v3 (`--etcd`)") == "high-availability-replicas-on-etcd-v3---etcd"
    assert slug("See it live: /ui and the event stream") == "see-it-live-ui-and-the-event-stream"
    assert slug("Exit codes of rdzv-agent") == "exit-codes-of-rdzv-agent"
    assert slug("store_hosts and [the table](x.md)") == "store_hosts-and-the-table"


def test_broken_links_are_found(tmp_path):
    """The checker itself: a missing file and a missing heading are both reported."""
    page = tmp_path / "a.md"
    (tmp_path / "b.md").write_text("# B\n\n## Here it is\n")
    page.write_text(
        "# A\n[ok](b.md#here-it-is) [self](#a) [no file](c.md) [no\nheading](b.md#gone)\n"
        "```\n[in code](nowhere.md)\n```\n`[in a span](nowhere.md)` [web](https://example.com/x)\n"
    )
    assert sorted(broken_links(page)) == [
        "b.md#gone: no heading #gone in " + str((tmp_path / "b.md").resolve()),
        "c.md: no file " + str((tmp_path / "c.md").resolve()),
    ]


def test_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md: {len(lines)} lines (max {README_MAX_LINES}); move it to docs/"


def test_readme_keeps_the_two_commands():
    text = README.read_text()
    assert "## The two commands" in text
    assert re.search(r"^scripts/demo\s", text, re.M) and re.search(r"^scripts/test\s", text, re.M)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(page: Path):
    assert broken_links(page) == []


def test_every_docs_page_is_linked_from_readme():
    targets = {(README.parent / t.partition("#")[0]).resolve() for t in links(README) if t.partition("#")[0]}
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if p.resolve() not in targets]
    assert missing == [], f"docs pages README.md does not link: {missing}"


def test_architecture_has_a_row_for_every_module():
    text = (DOCS / "architecture.md").read_text()
    modules = [
        f"{d}/{p.name}"
        for d in MODULE_DIRS
        for p in sorted((REPO / d).iterdir())
        if p.suffix == ".py" and p.name != "__init__.py"
    ]
    missing = [m for m in modules if f"`{m}`" not in text]
    assert missing == [], f"docs/architecture.md has no row for {missing}"
