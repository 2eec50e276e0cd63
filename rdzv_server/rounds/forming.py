"""A forming round completes: when its membership freezes, who gets which rank,
and what each member is told. Pure, no I/O, no clock (see :mod:`.machine`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from rdzv_common.protocol import Assignment, JobState, SpareMsg

from . import events
from .model import REJOINING, RUNNING, SPARE, WAITING, Effects, Job, Node, blocked, count, move, natural_key
from .probe_addr import round_key
from .suspicion import as_peer, peer_at, probed, watched
from .templates import Prepared, RoundTemplate, peer_text

T = TypeVar("T")


def _check_complete(job: Job, now: float) -> Effects:
    if not job.forming:
        return Effects()
    spec = job.spec
    waiting = count(job, WAITING)
    if job.prev_order:  # a re-formed round: no last call, the server knows who lives
        # Wait for every live previous member even when max_nodes already wait
        # (promoted spares): otherwise a spare takes its slot and rank 0 moves.
        if count(job, REJOINING) == 0 and waiting >= spec.min_nodes:
            return _complete(job, now)
        return Effects()
    if waiting >= spec.max_nodes:
        return _complete(job, now)
    if waiting >= spec.min_nodes:
        if job.last_call_deadline is None:
            job.last_call_deadline = now + spec.last_call_s
            job.status_dirty = True
    else:
        job.last_call_deadline = None
    return Effects()


def direct(job: Job, rejoining: list[Node], now: float) -> bool:
    """Whether a round just opened can complete at once (:func:`reform_directly`):
    every member left (``rejoining``) offered direct ports, none is a replaced
    straggler, no host of a node to place is blocked, and ``min_nodes`` are
    there. The server knows who lives: a member's join again would tell it nothing."""
    if not rejoining or any(n.direct_ports is None or n.replaced is not None for n in rejoining):
        return False
    if count(job, WAITING) + len(rejoining) < job.spec.min_nodes:
        return False
    return job.gate is None or all(
        blocked(job, n, now) is None for n in job.nodes.values() if n.state in (WAITING, REJOINING)
    )


def reform_directly(job: Job, rejoining: list[Node], reason: str, now: float) -> Effects:
    """Complete a round just opened (``reason``) at once, :func:`direct` said it can:
    each member's ``restart`` carries its place (one message where three were:
    restart, join, assigned); newcomers and promoted spares get ``assigned``."""
    for node in rejoining:
        move(job, node, WAITING)
    fx = _complete(job, now, restart=reason, carried={n.node_id for n in rejoining})
    assert not job.forming  # every candidate admissible, min_nodes of them
    return fx


def assign_ranks(prev_order: list[str], candidates: list[Node], world: int) -> tuple[list[Node], list[Node]]:
    """Pick ``world`` members and order them; return (members by group rank, spares).

    1. previous members first, in their previous order, then new nodes in
       natural host order, then node id; the first ``world`` are members;
    2. a surviving previous rank 0 keeps rank 0 (MASTER_ADDR does not move);
    3. a requested rank is honoured when free and < world;
    4. the rest fill the free slots in the order of 1.
    """
    prev_pos = {nid: i for i, nid in enumerate(prev_order)}
    old = sorted((n for n in candidates if n.node_id in prev_pos), key=lambda n: prev_pos[n.node_id])
    new = sorted((n for n in candidates if n.node_id not in prev_pos), key=natural_key)
    ordered = old + new
    members, spares = ordered[:world], ordered[world:]
    slots: list[Node | None] = [None] * len(members)
    placed: set[str] = set()
    if prev_order and members and members[0].node_id == prev_order[0]:
        slots[0] = members[0]
        placed.add(members[0].node_id)
    for node in members:
        r = node.requested_rank
        if node.node_id not in placed and r is not None and r < len(slots) and slots[r] is None:
            slots[r] = node
            placed.add(node.node_id)
    rest = iter(n for n in members if n.node_id not in placed)
    result = [s if s is not None else next(rest) for s in slots]
    return result, spares


def _complete(job: Job, now: float, restart: str = "", carried: set[str] | None = None) -> Effects:
    """Freeze the membership: ranks, master, everyone told. A waiting node
    whose host was blocked meanwhile becomes a spare, told why. ``carried``:
    the members placed without a join (:func:`reform_directly`), told with
    the ``restart`` of this round (its reason), not ``assigned``."""
    candidates = [n for n in job.nodes.values() if n.state == WAITING]
    held = Effects()
    if job.gate is not None:
        for node in candidates:
            why = blocked(job, node, now)
            if why is not None:
                move(job, node, SPARE)
                node.note = why
                held.send(node.node_id, SpareMsg(round=job.round, reason=why))
        candidates = [n for n in candidates if n.state == WAITING]
        if len(candidates) < job.spec.min_nodes:  # not enough admissible nodes: keep forming
            job.last_call_deadline = None
            return held
    members, spares = assign_ranks(job.prev_order, candidates, min(len(candidates), job.spec.max_nodes))
    job.order = [n.node_id for n in members]
    job.state = JobState.RUNNING
    job.world_size = sum(n.local_world_size for n in members)
    head = members[0]
    job.master_addr, job.master_port = head.addr, head.master_port
    # the next round it holds rank 0 in without a join needs a port no store of this one listens on
    if head.direct_ports:
        head.master_port = head.direct_ports.pop(0)
    else:
        head.direct_ports = None  # none left: it joins again (a fresh master_port) first
    job.last_call_deadline = job.join_deadline = job.scale_up_deadline = None
    rec = job.history[-1]
    rec.completed_at, rec.world_size, rec.nodes = now, job.world_size, len(members)
    job.round_step = job.max_step  # progress in this round: a step beyond it (see storm)
    fx = Effects(persist=True).merge(held)
    offset = 0
    for rank, node in enumerate(members):
        move(job, node, RUNNING)
        node.group_rank, node.rank_offset = rank, offset
        offset += node.local_world_size
    for node in spares:
        move(job, node, SPARE)
    for node, msg in zip(members, messages(job, members, restart, carried or set()), strict=True):
        fx.send(node.node_id, msg)
    spare = SpareMsg(round=job.round)  # one message for all spares
    for node in spares:
        fx.send(node.node_id, spare)
    fx.event(events.round_completed(job, rec, members, len(spares)))
    fx.event(events.job_state(job, "waiting"))
    return fx


def messages(
    job: Job, members: list[Node], reason: str = "", carried: set[str] | frozenset[str] = frozenset()
) -> list[Prepared]:
    """Each member's message of the round just formed, in the order of
    ``members`` (the running round's): ``assigned``, or for the members in
    ``carried`` the ``restart`` of this round (``reason``) with their place.

    What every member is told alike (the job, round, world, master, restart
    budget) is validated once, in the first member's assignment, and written
    once; each member's text is that template with its own fields
    (:mod:`.templates`), which this completion set within their bounds (its
    rank and offset among the members, its validated size, its watch peers,
    the round's probe key). In process at 16,384 members (``bench.join_cost``):
    6.6-7.9 us a member in all, with each member's watch peer made and written
    once, where a model per member built and serialized cost ~13."""
    if not members:
        return []
    text = peer_texts(job)
    texts = [text(i) for i in range(len(job.order))]  # each member's, written once for its MAX_WATCH watchers
    held = job.peer_texts  # ... and kept for the next round: the members of this one only
    job.peer_texts = {node_id: got for node_id in job.order if (got := held.get(node_id)) is not None}
    tpl = RoundTemplate(_assignment(job, members[0]), _round_key(job), reason if carried else None)
    out = []
    for node in members:
        a = tpl.assignment(*_own(job, node, texts.__getitem__))
        out.append(tpl.restart(a) if node.node_id in carried else tpl.assigned(a))
    return out


def _assignment(job: Job, node: Node) -> Assignment:
    """``node``'s assignment, validated whole (its watch peers made here)."""
    rank, size, offset, watch, keyed = _own(job, node, peer_at(job))
    return Assignment(
        **_shared(job),
        group_rank=rank,
        local_world_size=size,
        rank_offset=offset,
        watch=watch,
        probe_key=_round_key(job) if keyed else None,
    )


def _shared(job: Job) -> dict[str, Any]:
    """The fields of the running round's assignments that every member is told alike."""
    # set when the round's membership froze, which is when assignments are made
    assert job.master_addr is not None and job.master_port is not None
    return {
        "job_id": job.job_id,
        "round": job.round,
        "group_world_size": len(job.order),
        "world_size": job.world_size,
        "master_addr": job.master_addr,
        "master_port": job.master_port,
        "max_restarts": job.spec.max_restarts,
        "restarts": job.restarts,
    }


def told_again(job: Job, node: Node, restart: bool = False) -> Prepared:
    """A member's message of the running round, told once more (a reconnect, a resume): its
    ``assigned``, or (``restart``) the ``restart`` that placed it, which it missed. Written from
    the round's template (:class:`RoundTexts`), as the completion wrote them."""
    reason = job.history[-1].reason if job.history else ""
    key = (*_shared(job).values(), job.run, job.probe_seed, reason)  # (the round's probe key derives from these)
    texts = job.texts
    if not isinstance(texts, RoundTexts) or texts.key != key:
        texts = job.texts = RoundTexts(key, RoundTemplate(_assignment(job, node), _round_key(job), reason))
    a = texts.tpl.assignment(*_own(job, node, peer_texts(job)))
    return texts.tpl.restart(a) if restart else texts.tpl.assigned(a)


class RoundTexts:
    """What :func:`told_again` writes from, kept on the job (``Job.texts``, not saved) while
    its ``key`` holds (the running round, what every member is told alike, what the round's
    probe key derives from, its reason): the round's template. A failover's resumes built and
    validated an Assignment, its watch peers and the message around it, each (16,384 at this
    size, ``bench.join_cost``'s resume row)."""

    __slots__ = ("key", "tpl")

    def __init__(self, key: tuple[Any, ...], tpl: RoundTemplate) -> None:
        self.key = key
        self.tpl = tpl


def peer_texts(job: Job) -> Callable[[int], str | None]:
    """Each member of the running round as its watchers' assignments write it, by group rank
    (None: it answers no probes). A member's text is kept on the job (``Job.peer_texts``: node
    id -> (probe address, port, text); not saved) while its probe address and port stay the
    ones written, across rounds: a round change writes only the members whose address is new
    (a new leader learns them from the resumes), where a node loss at 16,384 members made,
    validated and wrote a WatchPeer for each of its 16,383 survivors."""
    held: dict[str, tuple[str | None, int | None, str]] | None = job.peer_texts
    if held is None:
        held = job.peer_texts = {}

    def text(i: int) -> str | None:
        node_id = job.order[i]
        peer = probed(job, node_id)
        if peer is None:
            return None
        got = held.get(node_id)
        if got is not None and got[0] == peer.probe_addr and got[1] == peer.probe_port:
            return got[2]
        out = peer_text(as_peer(peer))
        held[node_id] = (peer.probe_addr, peer.probe_port, out)
        return out

    return text


def _own(job: Job, node: Node, peer: Callable[[int], T | None]) -> tuple[int, int, int, list[T], bool]:
    """The fields of ``node``'s assignment that are its own, not the round's, in the
    order of :data:`.templates.OWN`: its rank, size and offset, the peers it watches
    (each as ``peer(group_rank)`` gives it: a WatchPeer, or its text) and whether it
    holds the round's probe key."""
    assert node.group_rank is not None
    return node.group_rank, node.local_world_size, node.rank_offset, watched(job, node, peer), _keyed(node)


def _keyed(node: Node) -> bool:
    """Whether ``node`` is given the round's probe key: it answers probes."""
    return node.probe_port is not None


def _round_key(job: Job) -> str | None:
    return round_key(job.probe_seed, job.run, job.round)
