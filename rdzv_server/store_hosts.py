"""The host side of the store: failures counted against hosts, cool-downs,
cordons and health reports (REST ``/v1/hosts``), kept durable and told to
every active job (:func:`rdzv_server.rounds.hosts_changed`).

:class:`StoreHosts` is a collaborator of :class:`rdzv_server.store.Store`
(``store.host_side``), split out to keep one module readable; it owns when the
next host block ends and uses the store's host table, jobs, storage backend and
effects.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from rdzv_common.protocol import (
    ErrorCode,
    HostFailureView,
    HostView,
    RequestError,
    UnavailableError,
    is_valid_host,
    printable,
)

from . import rounds
from .cursors import decode_host_cursor, encode_host_cursor
from .hosts import HostRecord

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger("rdzv_server.store")  # the store's log, as before the split


class StoreHosts:
    """Host records of a :class:`~rdzv_server.store.Store` (its methods run on the event loop).
    The store's tables are read through it each time: a step-down replaces them."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.unblock_at: float | None = None  # when the next host block ends (hosts.next_unblock)

    def rearm(self, now: float) -> None:
        """When the next host block ends, from the host table as it is now."""
        self.unblock_at = self._store.hosts.next_unblock(now)

    def clear(self) -> None:
        """The host table was replaced by an empty one (a step-down): no block to wait for."""
        self.unblock_at = None

    def tick(self, now: float) -> None:
        """A cool-down or a cordon's ttl that ended: its spares may be admitted."""
        if self.unblock_at is not None and now >= self.unblock_at:
            self.rearm(now)
            self._hosts_changed(now)

    def host_failure(self, host: str, job_id: str, reason: str, now: float | None = None) -> HostRecord | None:
        """A failure counted against ``host``; a host that reaches the limit is
        cooled down and every job hears of it (its waiting nodes become spares)."""
        hosts = self._store.hosts
        now = self._store.clock() if now is None else now
        rec, cooled, evicted = hosts.record_failure(host, job_id, reason, now)
        if rec is None:
            log.warning(
                "host table full of blocked hosts (%d): failure on %s not recorded: %s",
                len(hosts.records),
                printable(host, limit=255),
                printable(reason),
            )
            return None
        self._store.backend.write_hosts([rec], evicted)
        if cooled:
            log.warning(
                "host %s cooled down: %s",
                printable(host),
                printable(rec.cooled_reason),
                extra={"rdzv": {"host": host, "reason": rec.cooled_reason}},
            )
            self.rearm(now)
            self._hosts_changed(now)
        return rec

    def _hosts_changed(self, now: float, drain: set[str] | None = None) -> None:
        store = self._store
        for job_id in list(store.active):
            job = store.jobs.get(job_id)
            if job is None:
                continue
            fx = rounds.hosts_changed(job, now, drain or set())
            if fx.sends or fx.persist or fx.logs:
                try:
                    store._apply(job, fx, now)
                except UnavailableError:
                    pass  # the job was put back as saved; its agents reconnect and meet the block on join

    def check_host(self, host: str) -> str:
        if not is_valid_host(host):
            raise RequestError(
                f"host {host[:64]!r} is not valid: 1-255 characters of [A-Za-z0-9._:[]%-]", ErrorCode.VALIDATION_ERROR
            )
        return host

    def host_view(self, host: str) -> HostView:
        rec = self._store.hosts.get(self.check_host(host))
        if rec is None:
            raise RequestError(f"no record of host {host!r}: it had no failures and no cordon", ErrorCode.NOT_FOUND)
        return self._host_view(rec, self._store.clock())

    def report_health(self, host: str, job_id: str | None, reason: str) -> HostView:
        """A failed health check on ``host`` (POST /v1/hosts/{host}/health)."""
        rec = self.host_failure(self.check_host(host), job_id or "-", f"health check failed: {reason}")
        if rec is None:
            raise UnavailableError(
                f"the host table is full ({len(self._store.hosts.records)} records, all blocking a "
                "host); the report is not recorded",
                ErrorCode.UNAVAILABLE,
            )
        return self._host_view(rec, self._store.clock())

    @staticmethod
    def _host_view(rec: HostRecord, now: float) -> HostView:
        why = rec.blocked(now)
        state = "cordoned" if rec.cordon_active(now) else "cooled_down" if rec.cooling(now) else "ok"
        return HostView(
            host=rec.host,
            state=state,
            reason=why,
            cordoned=rec.cordon_active(now),
            cordon_reason=rec.cordon_reason,
            cordon_until=rec.cordon_until,
            drain=rec.drain,
            cooled_until=rec.cooled_until,
            cooldowns=rec.cooldowns,
            failures_total=rec.failures_total,
            failures=[HostFailureView(at=f.at, job_id=f.job_id, reason=f.reason) for f in rec.failures],
            updated_at=rec.updated_at,
        )

    def host_views(self, limit: int = 100, cursor: str | None = None) -> tuple[list[HostView], str | None]:
        """One page of host records by host name: (views, next_cursor)."""
        after = decode_host_cursor(cursor) if cursor is not None else None
        records = self._store.hosts.records
        names = sorted(h for h in records if after is None or h > after)
        now = self._store.clock()
        page = [self._host_view(records[h], now) for h in names[:limit]]
        more = len(names) > limit
        return page, (encode_host_cursor(names[limit - 1]) if more else None)

    def cordon(self, host: str, reason: str, ttl_s: float | None, drain: bool) -> HostView:
        store = self._store
        now = store.clock()
        rec, evicted = store.hosts.cordon(self.check_host(host), reason, ttl_s, drain, now)
        if rec is None:
            raise UnavailableError(
                f"the host table is full ({len(store.hosts.records)} records, all cordons); uncordon a host first",
                ErrorCode.UNAVAILABLE,
            )
        store.backend.write_hosts([rec], evicted)
        self.rearm(now)
        store.events.emit("host_cordoned", None, host=host, reason=reason, ttl_s=ttl_s, drain=drain)
        self._hosts_changed(now, drain={host} if drain else None)
        return self._host_view(rec, now)

    def uncordon(self, host: str) -> HostView:
        store = self._store
        now = store.clock()
        rec = store.hosts.uncordon(self.check_host(host), now)
        if rec is None:
            raise RequestError(f"no record of host {host!r}: it is not cordoned", ErrorCode.NOT_FOUND)
        store.backend.write_hosts([rec], [])
        self.rearm(now)
        store.events.emit("host_uncordoned", None, host=host)
        self._hosts_changed(now)
        return self._host_view(rec, now)
