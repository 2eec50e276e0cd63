"""A follower's probe of the leader's process (rdzv_server.ha's docstring: a
leader whose process died leaves its key until its lease expires; the
followers see it sooner). Beside each poll of the leader key, a TCP connect
to the leader's ``--advertise-url`` (its name resolved once a term; the
address that answered is probed after that); once one succeeded in this
term, ``TAKEOVER_REFUSALS`` refused connections in a row (``REPROBE_S``
apart; nothing listens: the process is gone) revoke the leader's lease, and
the campaign polls at once (the successor is elected; rdzv_server.ha_peers).
Safety does not rest on it: see rdzv_server.ha."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable
from urllib.parse import urlsplit

from rdzv_common.tasks import cancel_and_wait

from . import etcd

log = logging.getLogger("rdzv_server.ha")

PROBE_TIMEOUT_S = 0.3  # a follower's TCP connect to the leader (refused at once when nothing listens)
TAKEOVER_REFUSALS = 2  # refused connections in a row, after one that succeeded, that revoke the leader's lease
REPROBE_S = 0.02  # after a refusal, the next probe comes this soon (not at the next poll)


class LeaderProbe:
    """The probe of one follower: at most one in flight (:meth:`beside`), its
    state kept from one to the next (the term probed, its address, refusals)."""

    def __init__(self, client: etcd.EtcdClient, error: Callable[[str, Exception], None]) -> None:
        self.client = client
        self._error = error  # says an etcd error (rate-limited by the replica)
        self._task: asyncio.Task[None] | None = None  # a probe in flight
        # the leader we probe (its key's lease and create revision), the address of it we reached, refusals in a row
        self._probed: tuple[int, int] = (0, 0)
        self._addr: tuple[str, int] | None = None
        self._lookup: tuple[str, asyncio.Future[list[tuple[str, int]]]] | None = None  # (url, its lookup)
        self._refused = 0

    @property
    def refusing(self) -> bool:
        """The leader's address refused the last probe (its process is likely gone)."""
        return self._refused > 0

    def beside(self, kv: etcd.KeyValue, url: str | None, revoked: Callable[[str], None]) -> None:
        """Probe the leader of ``kv`` at ``url`` unless a probe is in flight (a slow
        probe must not slow the poll); ``revoked(url)`` once its lease was revoked."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(kv, url, revoked), name="rdzv-ha-probe")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self, kv: etcd.KeyValue, url: str | None, revoked: Callable[[str], None]) -> None:
        """A task of its own (nobody awaits it): it says its errors itself."""
        try:
            while not await self._once(kv, url):
                if not 0 < self._refused < TAKEOVER_REFUSALS:
                    return
                await asyncio.sleep(REPROBE_S)  # refused once: confirm it now, not a poll later
            revoked(url or "")
        except Exception:  # a bug here must not go unsaid
            log.exception("probing the leader")

    async def _once(self, kv: etcd.KeyValue, url: str | None) -> bool:
        """True when this probe revoked the leader's lease, or tried to and failed (another
        replica may have revoked it first: the campaign should look now)."""
        if url is None or not kv.lease:
            return False
        if self._probed != (kv.lease, kv.create_revision):  # a new term: find its address again
            self._probed, self._addr, self._refused = (kv.lease, kv.create_revision), None, 0
        if self._addr is None:
            # Resolved once a term, then that one address is probed: a name with several
            # addresses (IPv6 and IPv4) gives no plain "refused" for the name as a whole.
            # One lookup at a time, in a daemon thread (a resolver that hangs must not
            # hold the process's exit); a probe waits for it PROBE_TIMEOUT_S at most.
            if self._lookup is None or self._lookup[0] != url:
                self._lookup = (url, addresses(url))
            found = self._lookup[1]
            await asyncio.wait([found], timeout=PROBE_TIMEOUT_S)
            if not found.done():
                return False
            self._lookup = None
            for addr in found.result():
                if await listening(addr):
                    self._addr = addr
                    return False
            return False  # never reached: a wrong --advertise-url must not cost a leadership
        if await listening(self._addr) is not False:  # alive, or no answer in time: a host that died or a
            self._refused = 0  # partition is not a dead process
            return False
        self._refused += 1
        if self._refused < TAKEOVER_REFUSALS:
            return False
        log.warning(
            "the leader %s refuses connections (its process is gone): revoking its lease %x so that a replica "
            "takes over now",
            url,
            kv.lease,
        )
        try:
            await self.client.revoke(kv.lease)
        except etcd.EtcdError as e:  # gone already (it expired, another replica revoked it), or etcd is away
            self._error("revoking the lease of a leader that is gone", e)
            return True  # the campaign looks at once; the next refusal tries again (until the key read changes)
        self._addr, self._refused = None, 0
        return True


def addresses(url: str) -> asyncio.Future[list[tuple[str, int]]]:
    """The addresses ``url``'s host resolves to, with its port (none when it
    does not parse or resolve), looked up in a daemon thread of its own."""
    loop = asyncio.get_running_loop()
    found: asyncio.Future[list[tuple[str, int]]] = loop.create_future()
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        host, port = None, 0
    if not host:
        found.set_result([])
        return found

    def settle(addrs: list[tuple[str, int]]) -> None:
        if not found.done():
            found.set_result(addrs)

    def lookup() -> None:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            addrs = list(dict.fromkeys((str(info[4][0]), int(info[4][1])) for info in infos))
        except (OSError, ValueError):  # UnicodeError (a ValueError): a label too long, an empty one
            addrs = []
        try:
            loop.call_soon_threadsafe(settle, addrs)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    threading.Thread(target=lookup, name="rdzv-ha-lookup", daemon=True).start()
    return found


async def listening(addr: tuple[str, int]) -> bool | None:
    """Whether a process listens at ``addr`` (an IP address and port): True (a
    TCP connection opened; it is reset at once, nothing is sent), False
    (refused), None (no answer within PROBE_TIMEOUT_S, or another error)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(*addr), PROBE_TIMEOUT_S)
    except ConnectionRefusedError:
        return False
    except (OSError, asyncio.TimeoutError):
        return None
    writer.transport.abort()  # a reset: no TIME_WAIT left behind at 10 probes a second
    return True
