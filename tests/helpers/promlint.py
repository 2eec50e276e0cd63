"""Checks of a /metrics text: it parses with prometheus_client's parser and
passes the rules of ``promtool check metrics`` (which runs too, when the
``promtool`` binary is on PATH: Debian's ``prometheus`` package has it), plus
Prometheus' naming conventions (https://prometheus.io/docs/practices/naming/).

:func:`lint` returns the problems, one line each; empty is clean.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

NAME_RE = re.compile(r"^[a-z_:][a-z0-9_:]*$")
# promtool's list of units that are not base units, and abbreviations it refuses
NON_BASE_UNITS = (
    "milliseconds",
    "microseconds",
    "nanoseconds",
    "minutes",
    "hours",
    "days",
    "weeks",
    "kilobytes",
    "megabytes",
    "gigabytes",
    "celsius",
    "percent",
    "millis",
    "micros",
    "nanos",
)
ABBREVIATIONS = ("sec", "secs", "msec", "usec", "ms", "us", "ns", "min", "mins", "hr", "hrs", "kb", "mb", "gb")
TIME_WORDS = ("seconds", "duration", "latency", "time", "age", "elapsed")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}


def _declared(text: str) -> tuple[dict[str, str], dict[str, str]]:
    helps: dict[str, str] = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        m = re.match(r"^# (HELP|TYPE) (\S+) ?(.*)$", line)
        if m:
            (helps if m[1] == "HELP" else types)[m[2]] = m[3]
    return helps, types


def lint(text: str) -> list[str]:
    problems: list[str] = []
    helps, types = _declared(text)
    families = list(text_string_to_metric_families(text))  # raises on what does not parse
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    for fam in families:
        name, kind = fam.name, fam.type
        # prometheus_client strips _total from a counter's family name; the TYPE line has it
        declared = name + "_total" if kind == "counter" and name + "_total" in types else name
        if declared not in helps and name not in helps:
            problems.append(f"{name}: no HELP")
        elif not (helps.get(declared) or helps.get(name) or "").strip():
            problems.append(f"{name}: empty HELP")
        if declared not in types and name not in types:
            problems.append(f"{name}: no TYPE")
        if not NAME_RE.match(name):
            problems.append(f"{name}: not snake_case")
        words = name.split("_")
        for unit in NON_BASE_UNITS:
            if unit in words:
                problems.append(f"{name}: {unit} is not a base unit (use seconds, bytes, ratios)")
        for abbr in ABBREVIATIONS:
            if abbr in words:
                problems.append(f"{name}: abbreviated unit {abbr!r}")
        if kind != "counter" and name.endswith("_total"):
            problems.append(f"{name}: a {kind} must not end in _total")
        if kind in ("gauge", "histogram", "summary") and "seconds" in words and not name.endswith("_seconds"):
            problems.append(f"{name}: the unit goes last (..._seconds)")
        if kind == "histogram" and not name.endswith("_seconds") and any(w in words for w in TIME_WORDS):
            problems.append(f"{name}: a histogram of times must be in seconds (..._seconds)")
        if kind == "info" or name.endswith("_info"):
            for s in fam.samples:
                if s.value != 1:
                    problems.append(f"{s.name}: an _info metric must be 1")
        for s in fam.samples:
            allowed = SUFFIXES.get(kind, ()) + (("_info",) if kind == "info" else ())
            if s.name != name and not any(s.name == name + suf for suf in allowed):
                problems.append(f"{s.name}: sample name does not belong to {kind} {name}")
            if kind == "counter" and not s.name.endswith("_total"):
                problems.append(f"{s.name}: a counter's sample must end in _total")
            key = (s.name, tuple(sorted(s.labels.items())))
            if key in seen:
                problems.append(f"{s.name}{dict(s.labels)}: duplicate series")
            seen.add(key)
            for label in s.labels:
                if not NAME_RE.match(label) or label.startswith("__"):
                    problems.append(f"{s.name}: bad label name {label!r}")
    if shutil.which("promtool"):
        problems += promtool_check_metrics(text)
    return problems


def promtool_check_metrics(text: str) -> list[str]:
    """``promtool check metrics`` on ``text``: its complaints (empty: none)."""
    run = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60, check=False
    )
    out = (run.stdout + run.stderr).strip()
    return [f"promtool: {ln}" for ln in out.splitlines() if ln.strip()] if run.returncode or out else []


def series(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample of ``text`` by sample name: [(labels, value)]."""
    out: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name].append((dict(s.labels), s.value))
    return out


def value(text: str, name: str, **labels: str) -> float | None:
    """The value of the one sample ``name{labels}`` (None: no such sample)."""
    for got, v in series(text).get(name, []):
        if got == labels:
            return v
    return None
