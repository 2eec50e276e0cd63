"""The /metrics lint (tests/helpers/promlint.py) finds what it is there to find."""

from __future__ import annotations

import pytest

from tests.helpers.promlint import lint

GOOD = """# HELP rdzv_x_total Things.
# TYPE rdzv_x_total counter
rdzv_x_total{job_id="a"} 1.0
# HELP rdzv_wait_seconds Waited.
# TYPE rdzv_wait_seconds gauge
rdzv_wait_seconds 2.0
"""


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("# HELP x_sec_total h\n# TYPE x_sec_total counter\nx_sec_total 1\n", "abbreviated unit"),
        ("# HELP x_milliseconds h\n# TYPE x_milliseconds gauge\nx_milliseconds 1\n", "not a base unit"),
        ("# HELP x_max_seconds_since h\n# TYPE x_max_seconds_since gauge\nx_max_seconds_since 1\n", "unit goes last"),
        ("# HELP x_total h\n# TYPE x_total gauge\nx_total 1\n", "must not end in _total"),
        ("# TYPE x gauge\nx 1\n", "no HELP"),
        ('# HELP x h\n# TYPE x gauge\nx{a="1"} 1\nx{a="1"} 2\n', "duplicate series"),
        ("# HELP x_info h\n# TYPE x_info gauge\nx_info 2\n", "must be 1"),
        ("# HELP xY h\n# TYPE xY gauge\nxY 1\n", "snake_case"),
    ],
)
def test_lint_finds_each_problem(text: str, problem: str) -> None:
    found = lint(text)
    assert any(problem in p for p in found), found


def test_clean_text_has_no_problems() -> None:
    assert lint(GOOD) == []
