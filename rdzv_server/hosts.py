"""Host records across jobs: failures, cool-downs, cordons. Pure: no I/O, no
clock; every operation takes ``now``. The store persists what changed.

A host is blocked (its next join becomes a spare that waits, with the reason
sent to its agent and shown in the job view) while it is

* **cooled down**: ``failures`` failures (worker failures of the root-cause
  node on it, evictions for silence, failed health checks) within ``window_s``
  cool it down for ``cooldown_s * 2**n`` seconds, capped at
  ``cooldown_max_s``; ``n`` is how many times it was cooled down before
  (Horovod's blacklist). Failures before a cool-down do not count again.
* **cordoned** by an operator (``reason``, optional ``until``; ``drain``: its
  running nodes are replaced at once).

Bounded: at most ``MAX_FAILURES_KEPT`` failures per host and ``max_hosts``
records. Host names come from clients and can be invented: when the table is
full the oldest record that blocks nothing is evicted, and when every record
blocks something a new one is not created for a failure (it is dropped). An
operator's cordon always finds room unless every record is a cordon: it
evicts the oldest record that is not one (a cool-down that reports made
included), so made-up health reports cannot keep a real host from being
cordoned. (Reports are rate-limited per address: rdzv_server.quotas.)
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

MAX_FAILURES_KEPT = 20
MAX_REASON = 300
DEFAULT_MAX_HOSTS = 10_000
DEFAULT_HOST_FAILURES = 3
DEFAULT_HOST_FAILURE_WINDOW_S = 600.0
DEFAULT_HOST_COOLDOWN_S = 60.0
DEFAULT_HOST_COOLDOWN_MAX_S = 1800.0
MAX_COOLDOWN_EXPONENT = 30  # 2**30 * any base is past any cap: no float overflow


@dataclass
class HostRules:
    failures: int = DEFAULT_HOST_FAILURES  # this many within window_s cool a host down (0: never)
    window_s: float = DEFAULT_HOST_FAILURE_WINDOW_S
    cooldown_s: float = DEFAULT_HOST_COOLDOWN_S
    cooldown_max_s: float = DEFAULT_HOST_COOLDOWN_MAX_S
    max_hosts: int = DEFAULT_MAX_HOSTS

    def cooldown(self, n: int) -> float:
        """The n-th cool-down (n from 0): base * 2**n, capped."""
        return float(min(self.cooldown_s * 2 ** min(n, MAX_COOLDOWN_EXPONENT), self.cooldown_max_s))


@dataclass
class Failure:
    at: float
    job_id: str
    reason: str


@dataclass
class HostRecord:
    host: str
    updated_at: float
    failures: list[Failure] = field(default_factory=list)  # newest last, at most MAX_FAILURES_KEPT
    failures_total: int = 0
    counted_from: float = 0.0  # failures before this (the last cool-down's start) do not count again
    cooldowns: int = 0  # how many times it was cooled down
    cooled_until: float | None = None
    cooled_reason: str | None = None
    cordoned: bool = False
    cordon_reason: str | None = None
    cordon_until: float | None = None  # None: until uncordoned
    cordon_at: float | None = None
    drain: bool = False

    def cooling(self, now: float) -> bool:
        return self.cooled_until is not None and now < self.cooled_until

    def cordon_active(self, now: float) -> bool:
        return self.cordoned and (self.cordon_until is None or now < self.cordon_until)

    def blocked(self, now: float) -> str | None:
        """Why a join from this host waits (None: it may join)."""
        if self.cordon_active(now):
            # a span, not a time: the reader's clock and zone are not the server's (issue 25: raw unix times)
            until = f" for {span_text(self.cordon_until - now)} more" if self.cordon_until is not None else ""
            return f"host {self.host} is cordoned{until}: {self.cordon_reason or 'no reason given'}"
        if self.cooling(now):
            assert self.cooled_until is not None
            return (
                f"host {self.host} is cooled down for {span_text(self.cooled_until - now)} more: {self.cooled_reason}"
            )
        return None

    def to_record(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in HostRecord.__dataclass_fields__ if k != "failures"}
        d["failures"] = [vars(f).copy() for f in self.failures]
        return d

    @staticmethod
    def from_record(d: dict[str, Any]) -> HostRecord:
        d = dict(d)
        failures = [Failure(**f) for f in d.pop("failures")]
        return HostRecord(failures=failures, **d)


def _clip(text: str) -> str:
    text = " ".join(text.split())  # one line
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 3] + "..."


class Hosts:
    """Every host record of one server, oldest change first (eviction order)."""

    def __init__(self, rules: HostRules | None = None) -> None:
        self.rules = rules or HostRules()
        self.records: OrderedDict[str, HostRecord] = OrderedDict()

    def load(self, records: list[HostRecord]) -> None:
        for rec in sorted(records, key=lambda r: r.updated_at):
            self.records[rec.host] = rec

    def get(self, host: str) -> HostRecord | None:
        return self.records.get(host)

    def blocked(self, host: str, now: float) -> str | None:
        rec = self.records.get(host)
        return rec.blocked(now) if rec is not None else None

    def cordoned(self, host: str, now: float) -> bool:
        rec = self.records.get(host)
        return rec is not None and rec.cordon_active(now)

    def cools_down(self, host: str, now: float) -> bool:
        rules, rec = self.rules, self.records.get(host)
        if rules.failures <= 0 or (rec is not None and rec.cooling(now)):
            return False
        return (len(self._recent(rec, now)) if rec is not None else 0) + 1 >= rules.failures

    def _recent(self, rec: HostRecord, now: float) -> list[Failure]:
        """The failures of ``rec`` that count towards its next cool-down."""
        return [f for f in rec.failures if f.at > now - self.rules.window_s and f.at >= rec.counted_from]

    def draining(self, host: str, now: float) -> bool:
        rec = self.records.get(host)
        return rec is not None and rec.drain and rec.cordon_active(now)

    def _touch(self, host: str, now: float, cordon: bool = False) -> tuple[HostRecord | None, list[str]]:
        """The record of ``host`` (created if room), moved to the newest end;
        and the hosts evicted to make room. For a ``cordon``, a record that
        only a cool-down blocks may go too (the oldest that blocks nothing first)."""
        rec = self.records.get(host)
        evicted: list[str] = []
        if rec is None:
            if len(self.records) >= self.rules.max_hosts:
                victim = next((h for h, r in self.records.items() if r.blocked(now) is None), None)
                if victim is None and cordon:
                    victim = next((h for h, r in self.records.items() if not r.cordon_active(now)), None)
                if victim is None:
                    return None, evicted  # every record blocks a host: keep them
                del self.records[victim]
                evicted.append(victim)
            rec = self.records[host] = HostRecord(host=host, updated_at=now)
        rec.updated_at = now
        self.records.move_to_end(host)
        return rec, evicted

    def record_failure(
        self, host: str, job_id: str, reason: str, now: float
    ) -> tuple[HostRecord | None, bool, list[str]]:
        """A failure counted against ``host``: (its record or None if there was
        no room, whether it is cooled down by this failure, evicted hosts)."""
        rec, evicted = self._touch(host, now)
        if rec is None:
            return None, False, evicted
        rec.failures.append(Failure(at=now, job_id=job_id, reason=_clip(reason)))
        del rec.failures[:-MAX_FAILURES_KEPT]
        rec.failures_total += 1
        rules = self.rules
        if rules.failures <= 0 or rec.cooling(now):
            return rec, False, evicted
        recent = self._recent(rec, now)
        if len(recent) < rules.failures:
            return rec, False, evicted
        span = rules.cooldown(rec.cooldowns)
        rec.cooldowns += 1
        rec.cooled_until = now + span
        rec.counted_from = now + span  # what happened before (and during) this cool-down is settled
        rec.cooled_reason = (
            f"{len(recent)} failures within {rules.window_s:g}s (--host-failures "
            f"{rules.failures}), cool-down {rec.cooldowns} of {span:g}s; "
            f"last: {rec.failures[-1].reason}"
        )
        return rec, True, evicted

    def cordon(
        self, host: str, reason: str, ttl_s: float | None, drain: bool, now: float
    ) -> tuple[HostRecord | None, list[str]]:
        rec, evicted = self._touch(host, now, cordon=True)
        if rec is None:
            return None, evicted
        rec.cordoned, rec.cordon_reason, rec.drain = True, _clip(reason), drain
        rec.cordon_until = now + ttl_s if ttl_s is not None else None
        rec.cordon_at = now
        return rec, evicted

    def uncordon(self, host: str, now: float) -> HostRecord | None:
        """Lift a cordon and a cool-down (an operator vouches for the host)."""
        rec = self.records.get(host)
        if rec is None:
            return None
        rec.cordoned, rec.cordon_reason, rec.cordon_until, rec.cordon_at, rec.drain = False, None, None, None, False
        if rec.cooling(now):
            rec.cooled_until = now
            rec.counted_from = now
        rec.updated_at = now
        self.records.move_to_end(host)
        return rec

    def next_unblock(self, now: float) -> float | None:
        """The earliest time a block that holds now ends (None: none ends)."""
        best: float | None = None
        for rec in self.records.values():
            for t in (
                rec.cooled_until if rec.cooling(now) else None,
                rec.cordon_until if rec.cordon_active(now) else None,
            ):
                if t is not None and (best is None or t < best):
                    best = t
        return best


def span_text(seconds: float) -> str:
    """Seconds for people: 42s, 7m 5s, 2h 0m, 3d 4h."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"
