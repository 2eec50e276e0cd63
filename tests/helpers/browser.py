"""Headless Chromium for the /ui tests, scripts/screenshot and the page-load
bench: Debian's ``chromium`` driven by Playwright (from PyPI) through
``executable_path``; no browser is ever downloaded."""

from __future__ import annotations

import os

CHROMIUM = os.environ.get("RDZV_CHROMIUM", "/usr/bin/chromium")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
HOW_TO_GET = (
    f"no chromium at {CHROMIUM}: the browser tests need Debian's chromium "
    "(apt-get install chromium; scripts/test installs it when run as root)"
)


def available() -> bool:
    return os.access(CHROMIUM, os.X_OK)


def launch(playwright):  # -> playwright Browser
    return playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
