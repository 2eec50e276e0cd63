"""Heartbeats that fit the job over the real app (issue 23, item 2): a small
job is told a fast interval; a running member that stops heartbeating while
its connection stays open is probed (a WebSocket ping over its own
connection) after about a second instead of waiting for the heartbeat
timeout, and kept, since its kernel acknowledges; only a probe its kernel
does not acknowledge evicts it, with a reason of its own. On loopback a kernel
always acknowledges, so the eviction case replaces that one verdict
(rdzv_server.suspicion.acked_within), as tests/api/test_suspicion.py does;
the real silence of a pulled cable is tests/faults/test_host_death.py's."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from aiohttp import WSMsgType

from rdzv_common.wire import HEARTBEAT_FRAME
from rdzv_server import suspicion
from rdzv_server.app import Settings
from rdzv_server.keys import STORE
from rdzv_server.pacing import SWEEP_S
from rdzv_server.rounds.pace import FAST_HEARTBEAT_S

from .conftest import TIMEOUT, Agent, join_msg

DEADLINE = 15.0  # generous: a silence is judged after ~1 s; the heartbeat timeout (6 s) is not reached by then


class Beats:
    """Heartbeats every ``every`` seconds on ``agent`` while ``beating``;
    ``read``: reads its frames, counting (and answering) the pings a
    non-autoping connection gets."""

    def __init__(self, agent: Agent, every: float, read: bool = False) -> None:
        self.agent, self.every = agent, every
        self.pings = 0
        self.beating = True
        self.tasks = [asyncio.create_task(self._beat())] + ([asyncio.create_task(self._read())] if read else [])

    async def _beat(self) -> None:
        while True:
            if self.beating:
                await self.agent.ws.send_str(HEARTBEAT_FRAME)
            await asyncio.sleep(self.every)

    async def _read(self) -> None:
        while True:
            frame = await self.agent.ws.receive()
            if frame.type == WSMsgType.PING:
                self.pings += 1
                await self.agent.ws.pong(frame.data)
            elif frame.type != WSMsgType.TEXT:
                return

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        for t in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t


async def _form(client, connect, job: str = "q"):
    """Two members; b's connection shows pings (no autoping). Both heartbeat
    at the interval they were told."""
    a = await connect(on=client)
    b = await connect(on=client, autoping=False)
    told = []
    for node_id, agent in (("a", a), ("b", b)):
        await agent.send(join_msg(job, node_id, (2, 2)))
    for agent in (a, b):
        told.append((await agent.expect("joined")).heartbeat_s)
        await agent.expect("assigned")
    return a, b, told


async def _until(what, check, deadline: float = DEADLINE) -> None:
    end = time.monotonic() + deadline
    while not check():
        assert time.monotonic() < end, f"not within {deadline:g}s: {what}"
        await asyncio.sleep(0.05)


async def test_a_small_job_is_told_the_fast_interval(client, connect) -> None:
    _, _, told = await _form(client, connect)
    assert told == [FAST_HEARTBEAT_S, FAST_HEARTBEAT_S]


async def test_a_silent_member_whose_kernel_answers_is_probed_and_kept(client, connect) -> None:
    a, b, told = await _form(client, connect)
    beats = [Beats(a, told[0]), Beats(b, told[1], read=True)]
    try:
        await asyncio.sleep(4 * told[1])
        beats[1].beating = False  # b's process stops sending; its socket (and kernel) stay
        store = client.app[STORE]
        await _until("b probed", lambda: beats[1].pings >= 1)
        await _until("the probe cleared", lambda: ("q", "b") in store.suspicion.table.cleared)
        view = await (await client.get("/v1/jobs/q")).json()
        assert (view["round"], view["restarts"], len(view["nodes"])) == (0, 0, 2), view["history"]
        beats[1].beating = True  # back: heard again, nothing happened
        await asyncio.sleep(4 * told[1])
        view = await (await client.get("/v1/jobs/q")).json()
        assert (view["round"], len(view["nodes"])) == (0, 2), view["history"]
    finally:
        for beat in beats:
            await beat.stop()


async def test_a_silent_member_whose_kernel_does_not_answer_is_a_lost_connection_with_its_own_reason(
    client, connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No peer reported it: its connection is cut, and it is lost after the
    disconnect grace (0.5 s), as any lost connection, saying why."""
    monkeypatch.setattr(suspicion, "acked_within", lambda sock, seconds: False)  # a pulled cable's verdict
    a, b, told = await _form(client, connect)
    beats = [Beats(a, told[0]), Beats(b, told[1], read=True)]
    try:
        await asyncio.sleep(4 * told[1])
        beats[1].beating = False
        restart = await a.expect("restart", DEADLINE)
        assert "node b" in restart.reason and "silent for" in restart.reason, restart.reason
        assert "no answer to probe in" in restart.reason and "no heartbeat" not in restart.reason
        assert b.ws.closed  # the server cut it
    finally:
        for beat in beats:
            await beat.stop()


async def _cut_off(make_client, connect, monkeypatch: pytest.MonkeyPatch):
    """b's silence is probed and its kernel does not answer (a pulled cable's
    verdict): its connection is cut, and a disconnect grace longer than the test
    keeps it. Returns the server, a, b's node secret, the intervals told and a's heartbeats."""
    monkeypatch.setattr(suspicion, "acked_within", lambda sock, seconds: False)
    client = await make_client(Settings(disconnect_grace_s=DEADLINE))
    a, b, told = await _form(client, connect, "g")
    beats = [Beats(a, told[0]), Beats(b, told[1], read=True)]
    try:
        await asyncio.sleep(4 * told[1])
        beats[1].beating = False
        await _until("b's connection cut", lambda: b.ws.closed)
    finally:
        await beats[1].stop()
    return client, a, b.node_secret, told, beats[0]


async def test_a_cut_off_member_that_is_back_within_the_disconnect_grace_is_kept(
    make_client, connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A partition between the server and a node that heals within the grace
    costs nothing, as with any lost connection: the silence probe only found
    sooner what the keep-alive would have."""
    client, a, secret, told, beat = await _cut_off(make_client, connect, monkeypatch)
    try:
        back = await connect(on=client)
        await back.send(join_msg("g", "b", (2, 2), resume_round=0, node_secret=secret))
        assert (await back.expect("assigned")).assignment.round == 0
        view = await (await client.get("/v1/jobs/g")).json()
        assert (view["round"], view["restarts"], len(view["nodes"])) == (0, 0, 2), view["history"]
    finally:
        await beat.stop()


async def test_a_member_back_on_a_new_connection_is_not_judged_on_its_old_silence(
    make_client, connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its silence before the reconnect was judged already (its connection was
    cut): on the new one it is judged again only once heard there, not probed at
    the next sweep for the old gap (here, where the probe goes unanswered, it would
    be cut again though it heartbeats)."""
    client, a, secret, told, beat = await _cut_off(make_client, connect, monkeypatch)
    reading = None
    try:
        back = await connect(on=client, autoping=False)
        await back.send(join_msg("g", "b", (2, 2), resume_round=0, node_secret=secret))
        assert (await back.expect("assigned")).assignment.round == 0
        reading = Beats(back, told[1], read=True)
        reading.beating = False  # the real link sleeps an interval before its first heartbeat (up to 2 s)
        await asyncio.sleep(3 * SWEEP_S)  # sweeps before it: the old gap (over a second) would have been probed
        reading.beating = True
        await asyncio.sleep(4 * told[1])
        assert reading.pings == 0 and not back.ws.closed
        view = await (await client.get("/v1/jobs/g")).json()
        assert (view["round"], view["restarts"], len(view["nodes"])) == (0, 0, 2), view["history"]
    finally:
        await beat.stop()
        if reading is not None:
            await reading.stop()


async def test_a_replica_that_steps_down_keeps_no_arrival_or_probe_of_its_term(client, connect) -> None:
    """An HA replica that stops leading forgets every job and connection (the
    next term reloads them from etcd, the agents reconnect): the arrivals it
    learned and the probe it had open go too, so neither judges a node of a
    later term on a connection of this one."""
    a, b, told = await _form(client, connect)
    beats = [Beats(a, told[0]), Beats(b, told[1], read=True)]
    store = client.app[STORE]
    try:
        await asyncio.sleep(4 * told[1])
        beats[1].beating = False
        await _until("b's silence probed", lambda: ("q", "b") in store.suspicion.table.probes)
        assert store.pacing.arrivals
        store.step_down("a test: another replica leads", quiet=True)
        assert not store.pacing.arrivals and not store.suspicion.table.probes
    finally:
        for beat in beats:
            await beat.stop()


async def test_no_silence_is_judged_across_the_servers_own_stall(client, connect) -> None:
    """The loop that serves both sides is blocked (as a busy server's would be):
    nobody's heartbeats were read meanwhile, so nobody is probed for it."""
    a, b, told = await _form(client, connect)
    beats = [Beats(a, told[0]), Beats(b, told[1], read=True)]
    try:
        await asyncio.sleep(4 * told[1])
        time.sleep(1.6)  # blocking on purpose (the point: the server's loop does not run)
        await asyncio.sleep(1.0)  # heartbeats flow again; a judgment of the stall would have probed by now
        assert beats[1].pings == 0
        view = await (await client.get("/v1/jobs/q")).json()
        assert (view["round"], len(view["nodes"])) == (0, 2), view["history"]
    finally:
        for beat in beats:
            await beat.stop()


async def test_a_member_that_never_heartbeats_is_left_to_the_timeout(client, connect) -> None:
    """Judged only once heard since it was told: nothing to learn from otherwise."""
    a, b, told = await _form(client, connect)
    beat = Beats(b, told[1], read=True)
    beat.beating = False
    try:
        await asyncio.sleep(3 * TIMEOUT / 2)
        assert beat.pings == 0
    finally:
        await beat.stop()


async def _real_link(client, job_id: str, heartbeat_s: float):
    """The agent's real AgentLink, started, and a one-node session on it as node1 of ``job_id``."""
    from rdzv_client.client import AgentLink
    from rdzv_client.session import NodeSession
    from rdzv_common.protocol import JobSpec

    link = AgentLink(f"127.0.0.1:{client.server.port}", heartbeat_s=heartbeat_s)
    session = NodeSession(job_id=job_id, host="h", nproc=1, spec=JobSpec(min_nodes=1, max_nodes=1), addr="127.0.0.1")
    session.node_id = "node1"
    session.link = link
    await link.start()
    return link, session


async def test_the_agent_link_takes_up_a_faster_interval_at_once(client) -> None:
    """The real AgentLink (the agent's and the torchrun plugin's): its first
    interval is the spec's (an hour here, so that its sleep in progress cannot
    be what ends); ``joined`` tells 0.25 s, and heartbeats come at that pace
    from then, so the node is judged from about a second after it joined."""
    link, session = await _real_link(client, "paced", heartbeat_s=3600.0)
    try:
        session.join()
        joined = await asyncio.wait_for(link.recv(), TIMEOUT)
        assert joined.op == "joined" and joined.heartbeat_s == FAST_HEARTBEAT_S
        assert link.heartbeat_s == FAST_HEARTBEAT_S
        store = client.app[STORE]
        chan = store.channels[("paced", "node1")]
        arrivals = store.pacing.arrivals
        await _until("heartbeats at the told pace", lambda: (arr := arrivals.get(("paced", "node1"))) and arr.mean)
        assert store.channels[("paced", "node1")] is chan  # on that connection (a new one starts at the new pace)
    finally:
        await link.close()


async def test_nodes_told_a_fast_interval_are_told_a_slower_one_when_the_server_grows(
    client, connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real AgentLink joins a small server and is told a fast interval;
    then a bigger job arrives: the total rate would pass the budget (4 a
    second here), so the link is told (``pace``) the interval a join would be
    told now, and takes it; the message is the link's own (its agent never sees it)."""
    from rdzv_server.rounds import pace

    monkeypatch.setattr(pace, "HEARTBEAT_BUDGET", 4.0)
    link, session = await _real_link(client, "small", heartbeat_s=2.0)
    try:
        session.join()
        joined = await asyncio.wait_for(link.recv(), TIMEOUT)
        assert joined.op == "joined" and joined.heartbeat_s == FAST_HEARTBEAT_S  # 1 node / 4: the floor
        assert (await asyncio.wait_for(link.recv(), TIMEOUT)).op == "assigned"
        big = [await connect() for _ in range(4)]
        for i, agent in enumerate(big):
            await agent.send(join_msg("big", f"b{i}", (4, 4)))
        for agent in big:
            assert (await agent.expect("joined")).heartbeat_s == 1.25  # 5 nodes / 4
        await _until("the small job's node told the slower interval", lambda: link.heartbeat_s == 1.25)
        arr = client.app[STORE].pacing.arrivals[("small", "node1")]
        assert arr.told == 1.25  # judged on it at once
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(link.recv(), 0.5)  # nothing for the agent
    finally:
        await link.close()
