"""A userspace netem for :class:`tests.helpers.netlab.NetLab`: one node's
cable becomes a Python packet forwarder that can add a fixed delay and drop a
fraction of packets, switched at run time.

Why: this machine's kernel has no ``sch_netem`` (``tc qdisc add ... netem``:
"Specified qdisc kind is unknown") and no iptables/nft. ``/dev/net/tun`` works.

:func:`tun_link` replaces node i's veth pair by two TUN devices: ``rzeth`` in
the node's namespace (same name and address as the veth end it replaces, so
``GLOO_SOCKET_IFNAME=rzeth`` and ``--local-addr`` stay) and ``rzh<i>`` in the
hub (same name as the hub-side veth). A :class:`Forwarder` thread copies IP
packets between the two. The hub routes the node's address (a /32) through
``rzh<i>``, forwards between it and the bridge, and answers ARP for it on the
bridge (proxy ARP), so the server in the hub and the other nodes on the
bridge reach the node through the forwarder; the node reaches the whole
subnet through ``rzeth``.

:meth:`Forwarder.impair` mirrors ``tc qdisc add dev rzeth root netem delay D
loss P`` in the node's namespace: by default the node's *outgoing* packets
(node -> hub) are delayed by D and dropped with probability P, so the round
trip grows by D; ``both=True`` impairs the other direction too. Packets of a
direction keep their order (a fixed delay: a FIFO whose release times never
go back). The queue is bounded (``limit`` packets, as netem's default 1,000,
and ``limit_bytes``): a packet over either bound is dropped and counted.

Differences from kernel netem, named: the forwarder is a user-space thread
(reniced to -10 where allowed), so on a loaded machine its scheduling adds
latency of its own (the bench reports the RTT it measured with the impairment
off); the MTU is the TUN default, 1,500. ``NetLab.cut``/``heal`` are not for a
TUN-linked node (a device set down loses its route, and ``heal`` does not put
it back): ``impair(0, 1.0, both=True)`` pulls its cable, ``clear()`` plugs it.

Needs root, iproute2 and ``/dev/net/tun`` (:func:`tun_unavailable` says why not).
"""

from __future__ import annotations

import fcntl
import os
import random
import select
import socket
import struct
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .netlab import NetLab, _enter_netns, _ip

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
NODE_DEV = "rzeth"
MAX_PACKET = 65536  # one read of a TUN device: one IP packet (the MTU is 1,500)
READ_BURST = 64  # packets read from one side before the other side gets its turn
LIMIT_PACKETS = 1000  # netem's default limit
LIMIT_BYTES = 4 << 20

T = TypeVar("T")


def tun_unavailable() -> str | None:
    """Why a TUN-linked node cannot be made here, or None (namespaces: NetLab's own check)."""
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun on this machine"
    try:
        os.close(os.open("/dev/net/tun", os.O_RDWR))
    except OSError as e:
        return f"cannot open /dev/net/tun: {e}"
    return None


def socket_in(netns: str, kind: int = socket.SOCK_DGRAM) -> socket.socket:
    """An IPv4 socket of ``kind`` opened in namespace ``netns`` (a socket stays
    in the namespace it was born in, whichever thread uses it)."""
    return _in_netns(netns, lambda: socket.socket(socket.AF_INET, kind))


def _in_netns(netns: str, fn: Callable[[], T]) -> T:
    """``fn()`` run in a short-lived thread that entered ``netns``."""
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            _enter_netns(netns)
            out["value"] = fn()
        except BaseException as e:  # handed to the caller
            out["error"] = e

    t = threading.Thread(target=body, name=f"in-{netns}")
    t.start()
    t.join(10)
    if "error" in out:
        raise out["error"]
    if "value" not in out:
        raise RuntimeError(f"{fn!r} in {netns} did not finish")
    return out["value"]  # type: ignore[no-any-return]


def open_tun(netns: str, name: str) -> int:
    """A TUN device ``name`` created in namespace ``netns`` (by a short-lived
    thread that enters it: a device is born in its creator's namespace); its
    non-blocking fd. The device lives as long as the fd is open."""

    def create() -> int:
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
        except OSError:
            os.close(fd)
            raise
        return fd

    return _in_netns(netns, create)


@dataclass
class Direction:
    """One direction's impairment, queue and counters."""

    name: str
    delay_s: float = 0.0
    loss: float = 0.0
    queue: deque[tuple[float, bytes]] = field(default_factory=deque)
    queued_bytes: int = 0
    last_due: float = 0.0
    packets: int = 0  # read from this direction's source
    sent: int = 0  # written to its destination
    lost: int = 0  # dropped at random (``loss``)
    overflow: int = 0  # dropped: the queue was full
    delayed: int = 0  # went through the queue with a delay


class DelayLine:
    """The pure part: what becomes of a packet (drop, send now, send at T) and
    what is due. No I/O; ``now`` is given; the random draws come from ``rng``."""

    def __init__(
        self,
        rng: random.Random,
        directions: list[Direction],
        limit: int = LIMIT_PACKETS,
        limit_bytes: int = LIMIT_BYTES,
    ) -> None:
        if limit < 1 or limit_bytes < 1:
            raise ValueError("the queue's limits must be positive")
        self.rng = rng
        self.directions = directions  # the limits are on all of them together
        self.limit, self.limit_bytes = limit, limit_bytes

    def take(self, d: Direction, pkt: bytes, now: float) -> bool:
        """A packet read in direction ``d``; True: send it at once (nothing
        queued before it, no delay). Otherwise it was queued or dropped."""
        d.packets += 1
        if d.loss > 0 and self.rng.random() < d.loss:
            d.lost += 1
            return False
        if d.delay_s <= 0 and not d.queue:
            return True
        total = sum(len(x.queue) for x in self.directions)
        total_bytes = sum(x.queued_bytes for x in self.directions)
        if total >= self.limit or total_bytes + len(pkt) > self.limit_bytes:
            d.overflow += 1
            return False
        due = max(now + d.delay_s, d.last_due)  # a fixed delay keeps the order
        d.last_due = due
        d.queue.append((due, pkt))
        d.queued_bytes += len(pkt)
        if d.delay_s > 0:
            d.delayed += 1
        return False

    def due(self, d: Direction, now: float) -> list[bytes]:
        """The packets of ``d`` whose time has come, in order."""
        out = []
        while d.queue and d.queue[0][0] <= now:
            _, pkt = d.queue.popleft()
            d.queued_bytes -= len(pkt)
            out.append(pkt)
        return out


class Forwarder:
    """Copies packets between ``node_fd`` (the node's TUN) and ``hub_fd`` (the
    hub's), in a thread; :meth:`impair` / :meth:`clear` switch the impairment."""

    def __init__(
        self, node_fd: int, hub_fd: int, seed: int = 1, limit: int = LIMIT_PACKETS, limit_bytes: int = LIMIT_BYTES
    ) -> None:
        self.fds = (node_fd, hub_fd)
        self.out = Direction("out")  # node -> hub: netem on the node's rzeth
        self.into = Direction("in")  # hub -> node
        self.line = DelayLine(random.Random(seed), [self.out, self.into], limit, limit_bytes)
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        self._stop = False
        self.write_errors = 0
        self._thread = threading.Thread(target=self._run, name="netem-forwarder", daemon=True)
        self._thread.start()

    def impair(self, delay_s: float, loss: float, both: bool = False) -> None:
        """From now on: the node's outgoing packets (and with ``both`` its
        incoming ones) delayed ``delay_s`` and dropped with probability ``loss``."""
        if not (0.0 <= delay_s <= 10.0) or not (0.0 <= loss <= 1.0):
            raise ValueError(f"delay {delay_s!r} s must be in [0, 10], loss {loss!r} in [0, 1]")
        with self._lock:
            self.out.delay_s, self.out.loss = delay_s, loss
            self.into.delay_s, self.into.loss = (delay_s, loss) if both else (0.0, 0.0)
        self._wake()

    def clear(self) -> None:
        """No impairment (packets already queued still leave at their time)."""
        self.impair(0.0, 0.0)

    def counters(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {
                d.name: {k: getattr(d, k) for k in ("packets", "sent", "lost", "overflow", "delayed")}
                for d in (self.out, self.into)
            }

    def close(self) -> None:
        """Stop the thread and close both devices (which deletes them)."""
        self._stop = True
        self._wake()
        self._thread.join(5)
        for fd in (*self.fds, self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _run(self) -> None:
        try:  # kernel netem runs in softirq: the closest a thread gets is a high priority
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), -10)
        except OSError:
            pass
        node_fd, hub_fd = self.fds
        pairs = ((node_fd, hub_fd, self.out), (hub_fd, node_fd, self.into))
        while not self._stop:
            now = time.monotonic()
            with self._lock:
                heads = [d.queue[0][0] for d in (self.out, self.into) if d.queue]
            timeout = max(0.0, min(heads) - now) if heads else 1.0
            try:
                ready, _, _ = select.select([node_fd, hub_fd, self._wake_r], [], [], timeout)
            except (OSError, ValueError):
                return
            if self._wake_r in ready:
                try:
                    os.read(self._wake_r, 4096)
                except OSError:
                    pass
            for src, dst, d in pairs:
                if src not in ready:
                    continue
                for _ in range(READ_BURST):
                    try:
                        pkt = os.read(src, MAX_PACKET)
                    except BlockingIOError:
                        break
                    except OSError:
                        return  # closed under us
                    with self._lock:
                        now_send = self.line.take(d, pkt, time.monotonic())
                    if now_send:
                        self._send(dst, pkt, d)
            now = time.monotonic()
            for _, dst, d in pairs:
                with self._lock:
                    due = self.line.due(d, now)
                for pkt in due:
                    self._send(dst, pkt, d)

    def _send(self, fd: int, pkt: bytes, d: Direction) -> None:
        try:
            os.write(fd, pkt)
            d.sent += 1
        except OSError:  # the device is down (a cut) or full: the packet is lost, as on a wire
            self.write_errors += 1


def _sysctl(ns: str, *settings: str) -> None:
    for s in settings:
        subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", s], check=True, timeout=20)


def tun_link(lab: NetLab, i: int, seed: int = 1) -> Forwarder:
    """Node ``i`` of a set-up ``lab`` linked to the hub through a
    :class:`Forwarder` instead of its veth pair (same device names and
    address). Close the forwarder before ``lab.cleanup()``."""
    ns, hub_dev, addr = lab.node_ns(i), lab.hub_link(i), lab.node_addr(i)
    _ip("-n", lab.hub, "link", "del", hub_dev)  # the veth pair, both ends
    node_fd = open_tun(ns, NODE_DEV)
    try:
        hub_fd = open_tun(lab.hub, hub_dev)
    except BaseException:
        os.close(node_fd)
        raise
    fwd = Forwarder(node_fd, hub_fd, seed=seed)
    try:
        for n, dev in ((ns, NODE_DEV), (lab.hub, hub_dev)):
            _sysctl(n, f"net.ipv6.conf.{dev}.disable_ipv6=1")  # no router solicitations through the line
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", NODE_DEV)
        _ip("-n", ns, "link", "set", NODE_DEV, "up")
        _ip("-n", lab.hub, "link", "set", hub_dev, "up")
        _ip("-n", lab.hub, "route", "add", f"{addr}/32", "dev", hub_dev)
        _sysctl(
            lab.hub,
            "net.ipv4.ip_forward=1",
            "net.ipv4.conf.all.rp_filter=0",
            "net.ipv4.conf.rzbr.rp_filter=0",
            f"net.ipv4.conf.{hub_dev}.rp_filter=0",
            "net.ipv4.conf.rzbr.proxy_arp=1",  # the bridge's nodes reach this one through the hub
            "net.ipv4.neigh.rzbr.proxy_delay=0",  # ... answered at once, not after up to 0.8 s
            "net.ipv4.conf.all.send_redirects=0",
        )
    except BaseException:
        fwd.close()
        raise
    return fwd
