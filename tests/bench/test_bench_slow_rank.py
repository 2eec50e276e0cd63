"""Row 15 of ``python -m bench`` (bench/slow_rank.py's ``rows``) renders what
``run_one`` returns: it comes at the end of a long run, where a crash costs
the whole table. No processes: the dict is run_one's, as recorded."""

from __future__ import annotations

from bench import slow_rank

RESULT = {
    "factor": 1.5,
    "window_s": 5.0,
    "flag_s": 9.8,
    "replaced_s": 9.9,
    "flag_windows": 1.96,
    "members": ["h0", "h2", "h3"],
    "reason": "straggler: node(s) n1 (h1) replaced by a spare",
    "restarts": 0,
}


def test_row_15_says_flag_and_replacement_per_factor() -> None:
    (row,) = slow_rank.rows([RESULT])
    assert row[0].startswith("15. Lock-step straggler") and "turns 1.5x longer" in row[0]
    assert "--straggler-window-s 5`" in row[0]
    assert row[1:] == ["9.8 s (1.96 windows) / 9.9 s, 0 restart(s) charged", "n/a", "no straggler detection"]
