"""Durations on a command line (``90s``, ``30m``, ``12h``): rdzv-server's flags and the ``rdzv``
command read them the same way. Standard library only."""

from __future__ import annotations

import argparse

_UNITS_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``30m``, ``12h``, ``7d``, ``2w`` -> seconds (> 0, at most 10 years)."""
    t = text.strip().lower()
    unit = t[-1:] if t[-1:] in _UNITS_S else ""
    try:
        value = float(t[: len(t) - len(unit)]) * _UNITS_S.get(unit, 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (e.g. 90s, 30m, 12h, 7d)") from None
    if not 0 < value <= 10 * 365 * 86400:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0 and at most 10 years")
    return value
