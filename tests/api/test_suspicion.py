"""Suspicion from the peers over the real app (issue 23): an agent's ``suspect``
report makes the server probe the suspect over its own connection (a
WebSocket ping, seen here by the suspect's socket), and only the suspect's
kernel's silence evicts it. On loopback a kernel always acknowledges, so the
eviction path replaces that one verdict (rdzv_server.suspicion.acked_within);
the real silence of a pulled cable is tests/faults/test_host_death.py's."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import WSMsgType

from rdzv_common.protocol import AGENT_PATH, MAX_SUSPECTS, SuspectMsg
from rdzv_server import suspicion
from rdzv_server.keys import STORE
from rdzv_server.rounds.suspicion import PROBE_MIN_S

from .conftest import TIMEOUT, Agent, join_msg

PORTS = {"a": 40001, "b": 40002, "c": 40003}


async def _form(client, connect, job: str = "s"):
    """Three nodes that answer probes; b's connection shows pings (no autoping)."""
    agents = {}
    for node_id in PORTS:
        if node_id == "b":
            agents[node_id] = Agent(await client.ws_connect(AGENT_PATH, autoping=False))
        else:
            agents[node_id] = await connect()
        await agents[node_id].send(join_msg(job, node_id, (3, 3), probe_port=PORTS[node_id]))
    assigned = {}
    for node_id, agent in agents.items():
        await agent.expect("joined")
        assigned[node_id] = (await agent.expect("assigned")).assignment
    return agents, assigned


async def _pings(agent: Agent, wait: float) -> int:
    """Pings the (non-autoping) connection got within ``wait`` seconds; answers them."""
    n = 0
    loop = asyncio.get_running_loop()
    end = loop.time() + wait
    while (left := end - loop.time()) > 0:
        try:
            frame = await asyncio.wait_for(agent.ws.receive(), left)
        except asyncio.TimeoutError:
            break
        if frame.type == WSMsgType.PING:
            n += 1
            await agent.ws.pong(frame.data)
        else:
            assert frame.type == WSMsgType.TEXT and '"status"' in frame.data, frame
    return n


async def test_each_member_watches_the_next_two_with_their_probe_ports(client, connect) -> None:
    _, assigned = await _form(client, connect)
    order = sorted(assigned, key=lambda n: assigned[n].group_rank)
    for a in assigned.values():
        r = a.group_rank
        want = [order[(r + 1) % 3], order[(r + 2) % 3]]
        assert [p.node_id for p in a.watch] == want
        assert [p.port for p in a.watch] == [PORTS[n] for n in want]


def _not_this_hosts() -> str:
    """An IP address that is not one of this machine's (none can be bound to it)."""
    for addr in ("203.0.113.77", "198.51.100.77", "10.254.253.77", "172.31.254.77"):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.bind((addr, 0))
        except OSError:
            return addr
    raise AssertionError("every candidate address is this machine's")


async def _form_claiming(connect, job: str, claims: dict[str, str]):
    agents = {n: await connect() for n in claims}
    for n, addr in claims.items():
        await agents[n].send(join_msg(job, n, (3, 3), addr=addr, probe_port=PORTS[n]))
    for agent in agents.values():
        await agent.expect("joined")
    return {n: (await agent.expect("assigned")).assignment for n, agent in agents.items()}


async def test_peers_probe_the_address_a_node_connected_from_not_the_one_its_join_claims(connect) -> None:
    """A join's ``addr`` is the node's word: a liar could aim its peers' probes
    at another host. These joins claim an address that is not this machine's
    but connect from loopback: the peers are told to probe the loopback
    address, at each node's own probe port; the workers' store address stays
    the claimed one."""
    other = _not_this_hosts()
    assigned = await _form_claiming(connect, "lie", dict.fromkeys(PORTS, other))
    for a in assigned.values():
        assert a.master_addr == other, a
        assert [(p.addr, p.port) for p in a.watch] == [("127.0.0.1", PORTS[p.node_id]) for p in a.watch], a.watch
        assert len(a.watch) == 2


async def test_a_node_on_the_servers_host_is_probed_at_its_claimed_address_of_this_host(connect) -> None:
    """An agent beside the server connects over loopback; its peers could not
    reach 127.0.0.1, so an address of this host that it claims (any of
    127.0.0.0/8 here: the kernel binds them all) is the one they probe; a
    claim of another host's address from loopback is not."""
    other = _not_this_hosts()
    assigned = await _form_claiming(connect, "beside", {"a": "127.0.0.2", "b": other, "c": "127.0.0.3"})
    probed = {p.node_id: p.addr for a in assigned.values() for p in a.watch}
    assert probed == {"a": "127.0.0.2", "b": "127.0.0.1", "c": "127.0.0.3"}


async def test_the_members_of_a_round_share_its_probe_key_and_the_next_round_has_another(client, connect) -> None:
    agents, assigned = await _form(client, connect)
    keys = {a.probe_key for a in assigned.values()}
    assert len(keys) == 1 and None not in keys
    loner = await connect()  # a node that answers no probes gets no key
    await loner.send(join_msg("s2", "z", (1, 1)))
    await loner.expect("joined")
    assert (await loner.expect("assigned")).assignment.probe_key is None
    await agents["c"].ws.close()  # c leaves: round 1 for a and b
    for node_id in ("a", "b"):
        await agents[node_id].expect("restart")
        await agents[node_id].send(join_msg("s", node_id, (3, 3), probe_port=PORTS[node_id]))
        await agents[node_id].expect("joined")
    agents["n"] = await connect()
    await agents["n"].send(join_msg("s", "n", (3, 3), probe_port=40004))
    await agents["n"].expect("joined")
    later = {(await agents[n].expect("assigned")).assignment.probe_key for n in ("a", "b", "n")}
    assert len(later) == 1 and later.isdisjoint(keys) and None not in later


async def test_a_suspect_whose_host_answers_the_probe_is_kept(client, connect) -> None:
    agents, _ = await _form(client, connect)
    await agents["a"].send(SuspectMsg(round=0, nodes=["b"]))
    await agents["c"].send(SuspectMsg(round=0, nodes=["b"]))
    # one probe for both reports; the suspect's kernel acknowledges it: nothing changes
    assert await _pings(agents["b"], PROBE_MIN_S + 1.0) == 1
    view = await (await client.get("/v1/jobs/s")).json()
    assert (view["round"], view["restarts"], len(view["nodes"])) == (0, 0, 3), view["history"]
    # answered: left alone for a while, whoever reports it again
    for _ in range(3):
        await agents["a"].send(SuspectMsg(round=0, nodes=["b"]))
    assert await _pings(agents["b"], 0.5) == 0
    store = client.app[STORE]
    assert not store.suspicion.table.probes and ("s", "b") in store.suspicion.table.cleared


async def test_a_suspect_whose_host_does_not_answer_is_evicted_at_once(
    client, connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(suspicion, "acked_within", lambda sock, seconds: False)  # a pulled cable's verdict
    agents, _ = await _form(client, connect)
    await agents["a"].send(SuspectMsg(round=0, nodes=["b"]))
    restart = await agents["a"].expect("restart", TIMEOUT + PROBE_MIN_S)
    assert "node b" in restart.reason and "suspected by 1 peer(s), no answer to probe in" in restart.reason
    assert (await agents["c"].expect("restart")).round == 1
    view = await (await client.get("/v1/jobs/s")).json()
    assert "b" not in {n["node_id"] for n in view["nodes"]} and view["restarts"] == 0
    host = await (await client.get("/v1/hosts/b")).json()
    assert any("suspected by" in str(f) for f in host["failures"]), (
        host
    )  # counted against the host, as a heartbeat eviction is


async def test_reports_that_cannot_count_change_nothing(client, connect) -> None:
    agents, _ = await _form(client, connect)
    await agents["a"].send(SuspectMsg(round=0, nodes=["a"]))  # itself: no race explains it
    err = await agents["a"].expect("error")
    assert "cannot suspect itself" in err.message
    await agents["a"].send(SuspectMsg(round=7, nodes=["b"]))  # a round that is not running
    await agents["a"].send(SuspectMsg(round=0, nodes=["nobody"]))  # not a member
    too_many = {"op": "suspect", "round": 0, "nodes": [f"n{i}" for i in range(MAX_SUSPECTS + 1)]}
    await agents["a"].send(too_many)
    assert (await agents["a"].expect("error")).code.value == "validation_error"
    assert await _pings(agents["b"], PROBE_MIN_S + 0.5) == 0
    view = await (await client.get("/v1/jobs/s")).json()
    assert (view["round"], len(view["nodes"])) == (0, 3)


async def test_a_node_that_has_not_joined_cannot_report(client, connect) -> None:
    stranger = await connect()
    await stranger.send(SuspectMsg(round=0, nodes=["b"]))
    assert (await stranger.expect("error")).code.value == "not_joined"
