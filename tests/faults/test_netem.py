"""The userspace netem (tests/helpers/netem.py) delays and drops as told.

This machine's kernel has no ``sch_netem``; bench/host_soak.py's 300 ms / 5 %
phase runs through this forwarder instead, so it must be shown to do what
netem would. Node 0 of a 2-node NetLab is linked to the hub through the
forwarder; UDP echo servers run in the hub (where rdzv-server runs) and on
node 1 (a peer on the bridge, reached through the hub's proxy ARP). The
assertions are lower bounds and counts, never an upper bound on time: a
loaded machine only makes packets later.
"""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest

from tests.helpers.netem import DelayLine, Direction, socket_in, tun_link, tun_unavailable
from tests.helpers.netlab import NetLab

DELAY = 0.3
LOSS = 0.05
# the forwarder releases a packet when its time has come, never before: with the
# monotonic clock's and select's granularity, a round trip is at least this
AT_LEAST = DELAY - 0.005


def test_the_delay_line_keeps_order_bounds_its_queue_and_drops_at_random() -> None:
    out, back = Direction("out"), Direction("in")
    line = DelayLine(random.Random(1), [out, back], limit=3, limit_bytes=1000)
    out.delay_s = 0.3
    assert not line.take(out, b"a", 10.0) and not line.take(out, b"b", 10.1)
    out.delay_s = 0.0  # switched off with packets queued: the next one waits its turn
    assert not line.take(out, b"c", 10.2)
    back.delay_s = 0.3
    assert not line.take(back, b"d", 10.2) and back.overflow == 1  # 3 queued in all directions: full
    assert line.due(out, 10.29) == [] and line.due(out, 10.3) == [b"a"]
    assert line.due(out, 10.4) == [b"b", b"c"] and out.queued_bytes == 0
    assert line.take(out, b"e", 10.5)  # queue empty, no delay: sent at once
    out.delay_s = 0.3
    assert not line.take(out, b"x" * 1001, 10.5) and out.overflow == 1  # over the byte bound
    out.loss = 1.0
    assert not line.take(out, b"f", 10.6) and out.lost == 1 and not out.queue
    with pytest.raises(ValueError):
        DelayLine(random.Random(1), [out], limit=0)


def _echo(sock: socket.socket) -> None:
    while True:
        try:
            data, src = sock.recvfrom(128)
            sock.sendto(data, src)
        except OSError:
            return


def _rtts(client: socket.socket, target: tuple[str, int], n: int) -> list[float]:
    """``n`` echoes one after the other; each must come back (the socket's timeout is the deadline)."""
    out = []
    for k in range(n):
        tag = f"seq{k}-{random.random()}".encode()
        t = time.monotonic()
        client.sendto(tag, target)
        while True:
            data, _ = client.recvfrom(128)
            if data == tag:
                break
        out.append(time.monotonic() - t)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("netlab", [2], indirect=True)
@pytest.mark.timeout(60)
def test_the_userspace_netem_delays_and_drops_as_told(netlab: NetLab) -> None:
    why = tun_unavailable()
    if why:
        pytest.skip(why)
    fwd = tun_link(netlab, 0)
    socks: list[socket.socket] = []
    try:
        hub = netlab.in_hub(socket.socket, socket.AF_INET, socket.SOCK_DGRAM)
        peer = socket_in(netlab.node_ns(1))
        client = socket_in(netlab.node_ns(0))
        listener = netlab.in_hub(socket.socket, socket.AF_INET, socket.SOCK_STREAM)
        socks += [hub, peer, client, listener]
        hub.bind((netlab.hub_addr, 0))
        peer.bind((netlab.node_addr(1), 0))
        client.bind((netlab.node_addr(0), 0))
        listener.bind((netlab.hub_addr, 0))
        listener.listen(8)
        for s in (hub, client):  # room for the whole burst below, whoever is slow to read
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        for s in (hub, peer):
            threading.Thread(target=_echo, args=(s,), daemon=True).start()
        client.settimeout(10.0)
        targets = [hub.getsockname(), peer.getsockname()]

        # off: everything comes back, nothing is delayed
        for t in targets:
            _rtts(client, t, 10)
        assert fwd.counters()["out"]["delayed"] == 0

        # on, delay only: every round trip (to the hub and to the peer) is at least the delay
        fwd.impair(DELAY, 0.0)
        for t in targets:
            rtts = _rtts(client, t, 4)
            print(f"with {DELAY * 1000:.0f} ms to {t}: RTT {min(rtts) * 1000:.1f}-{max(rtts) * 1000:.1f} ms")
            assert min(rtts) >= AT_LEAST, rtts
        tcp = socket_in(netlab.node_ns(0), socket.SOCK_STREAM)
        socks.append(tcp)
        tcp.settimeout(10.0)
        t0 = time.monotonic()
        tcp.connect(listener.getsockname())  # the SYN is delayed: connect's RTT too
        took = time.monotonic() - t0
        print(f"TCP connect through the impaired link: {took * 1000:.1f} ms")
        assert took >= AT_LEAST

        # on, delay and loss: a burst of echoes; what is missing is what the forwarder dropped
        fwd.impair(DELAY, LOSS)
        before = fwd.counters()["out"]
        n = 400
        for k in range(n):
            client.sendto(b"burst%d" % k, targets[0])
            time.sleep(0.002)
        # wait until every echo the forwarder let through is back (a deadline, not a timing)
        client.settimeout(0.2)
        got = set()
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            c = fwd.counters()["out"]
            if c["packets"] - before["packets"] >= n and len(got) >= n - (c["lost"] - before["lost"]):
                break
            try:
                data, _ = client.recvfrom(128)
            except TimeoutError:
                continue
            if data.startswith(b"burst"):
                got.add(data)
        after = fwd.counters()["out"]
        lost = after["lost"] - before["lost"]
        print(f"burst of {n} with {LOSS:.0%} loss: {n - len(got)} missing, the forwarder dropped {lost}")
        assert lost == n - len(got) and after["overflow"] == before["overflow"]
        assert n * LOSS / 5 <= lost <= n * LOSS * 2.5  # binomial: mean 20, sd 4.4

        # off again: nothing more is delayed or lost
        fwd.clear()
        client.settimeout(10.0)
        delayed = fwd.counters()["out"]["delayed"]
        for t in targets:
            _rtts(client, t, 10)
        c = fwd.counters()["out"]
        assert c["delayed"] == delayed and c["lost"] == after["lost"]
    finally:
        for s in socks:
            s.close()
        fwd.close()
