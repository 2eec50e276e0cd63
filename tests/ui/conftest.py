"""The /ui page in a real browser: Playwright driving Debian's chromium
(tests/helpers/browser.py), against a real ``rdzv-server`` with real
``rdzv-agent`` processes (``cluster``, as in tests/e2e). Without chromium these
tests skip with one line saying how to get it (the only skip in the suite)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import browser as chromium
from tests.helpers.cluster import Cluster, managed


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest):
    yield from managed(Cluster(tmp=tmp_path), request)


@pytest.fixture(scope="module")
def browser():
    """Per module, not per session: Playwright's sync API runs an event loop of
    its own while it is open, and the async tests of later folders need none."""
    if not chromium.available():
        pytest.skip(chromium.HOW_TO_GET)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = chromium.launch(pw)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    p = context.new_page()
    p.set_default_timeout(20_000)
    yield p
    context.close()
