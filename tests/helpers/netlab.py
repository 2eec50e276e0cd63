"""A private network for partition tests: :class:`NetLab` makes network
namespaces joined by a bridge, pulls and plugs a node's cable, and deletes
everything it made. Needs root and iproute2 (:func:`netns_unavailable` says
why not)."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

_CLONE_NEWNET = 0x40000000


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def netns_unavailable() -> str | None:
    """Why namespaces cannot be used here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); running as uid %d" % os.geteuid()
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) on this machine"
    probe = f"rzprobe{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    try:
        r = _ip("-n", probe, "link", "add", "rzb", "type", "bridge", check=False)
        if r.returncode != 0:
            return f"cannot create a bridge in a namespace: {r.stderr.strip()}"
        r = _ip("-n", probe, "link", "add", "rzv0", "type", "veth", "peer", "name", "rzv1", check=False)
        if r.returncode != 0:
            return f"cannot create a veth pair: {r.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


@contextmanager
def netlab_or_skip(n: int, **kw: str) -> Iterator[NetLab]:
    """A set-up :class:`NetLab` of ``n`` nodes for one test, deleted after it
    (fails the test if it cannot be); skips the test, saying why, where
    namespaces cannot be made (not root, no iproute2)."""
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    lab = NetLab(n, **kw)
    try:
        lab.setup()
        yield lab
    finally:
        errors = lab.cleanup()
        assert not errors, f"could not delete namespaces: {errors}"


@dataclass
class NetLab:
    """A private network: a hub namespace with a bridge at ``SUBNET.1``, and
    one namespace per node, each joined to the bridge by a veth pair (node
    side ``rzeth`` at ``SUBNET.(10+i)``, hub side ``rzh<i>``). Every address
    exists only inside these namespaces; nothing is created in the caller's
    namespace, and deleting the namespaces deletes every link."""

    n: int
    subnet: str = "10.213.7"
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    created: list[str] = field(default_factory=list)
    _pool: ThreadPoolExecutor | None = None

    @property
    def hub(self) -> str:
        return f"rzf-{self.tag}-hub"

    def node_ns(self, i: int) -> str:
        return f"rzf-{self.tag}-n{i}"

    def node_addr(self, i: int) -> str:
        return f"{self.subnet}.{10 + i}"

    @property
    def hub_addr(self) -> str:
        return f"{self.subnet}.1"

    def hub_link(self, i: int) -> str:
        return f"rzh{i}"

    def setup(self) -> None:
        for ns in [self.hub, *(self.node_ns(i) for i in range(self.n))]:
            _ip("netns", "add", ns)
            self.created.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", self.hub, "link", "add", "rzbr", "type", "bridge")
        _ip("-n", self.hub, "addr", "add", f"{self.hub_addr}/24", "dev", "rzbr")
        _ip("-n", self.hub, "link", "set", "rzbr", "up")
        for i in range(self.n):
            ns, hub_side = self.node_ns(i), self.hub_link(i)
            # both ends are born inside namespaces: nothing appears in ours
            _ip("-n", self.hub, "link", "add", hub_side, "type", "veth", "peer", "name", "rzeth", "netns", ns)
            _ip("-n", self.hub, "link", "set", hub_side, "master", "rzbr")
            _ip("-n", self.hub, "link", "set", hub_side, "up")
            _ip("-n", ns, "addr", "add", f"{self.node_addr(i)}/24", "dev", "rzeth")
            _ip("-n", ns, "link", "set", "rzeth", "up")
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="in-hub", initializer=_enter_netns, initargs=(self.hub,))

    def cut(self, i: int) -> None:
        """Node i's cable is pulled: silent loss, no RST, no ICMP."""
        _ip("-n", self.hub, "link", "set", self.hub_link(i), "down")

    def heal(self, i: int) -> None:
        _ip("-n", self.hub, "link", "set", self.hub_link(i), "up")

    def in_hub(self, fn, *args):
        """Run ``fn(*args)`` in a thread that lives in the hub namespace (sockets it opens are there)."""
        assert self._pool is not None
        return self._pool.submit(fn, *args).result()

    def cleanup(self) -> list[str]:
        """Delete every namespace created (and with them every veth and the bridge); return errors."""
        errors = []
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for ns in reversed(self.created):
            r = _ip("netns", "del", ns, check=False)
            if r.returncode != 0:
                errors.append(f"{ns}: {r.stderr.strip()}")
        self.created.clear()
        return errors


def _enter_netns(name: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:  # a thread can change its own network namespace
            err = ctypes.get_errno()
            raise OSError(err, f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)
