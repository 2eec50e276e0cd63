"""Shared by every test folder."""

import pytest


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Keep the call phase's report on the item, so fixtures can tell a failed
    test at teardown (and print the logs that explain it)."""
    rep = yield
    if rep.when == "call":
        item.rep_call = rep
    return rep
