"""A round's fan-out as text: each member's ``assigned`` (or ``restart`` with
its place) written from one template, not built and serialized as a model per
member. Pure, no I/O.

What every member is told alike (the job, round, world, master, restart
budget; the round's probe key, to the members that answer probes) is
validated once, in the first member's
:class:`~rdzv_common.protocol.Assignment`, and serialized once; each member's
own fields (:data:`OWN`: its rank, size, offset, the peers it watches and
whether it holds the probe key) are set within their bounds by the completion
that placed it, as a copy of the first would have them. The template is
checked against the first member's own serialization when it is made: a field
added to the model, or a change in how pydantic writes one, fails there, not
on the wire. A join's ``joined`` is written likewise (:func:`joined`): a
round's join storm is one per node."""

from __future__ import annotations

from typing import Any, Literal

from pydantic_core import to_json

from rdzv_common.protocol import (
    SERVER_MESSAGE,
    AssignedMsg,
    Assignment,
    JoinedMsg,
    RestartMsg,
    ServerMessage,
    WatchPeer,
)

# An Assignment's fields that are each member's own, in the model's order; the others are the round's.
OWN = ("group_rank", "local_world_size", "rank_offset", "watch", "probe_key")
_SLOT = "\x00"  # where an own field goes: never in pydantic's JSON (it writes \u0000)
_NO_ASSIGNMENT = ',"assignment":null}'


class Prepared:
    """A server message as its JSON text, written from a template (or, a
    ``joined``, by :func:`joined`): ``text`` goes on the wire as it is;
    :meth:`model` reads it back, validated (for whoever needs the model: the tests)."""

    __slots__ = ("op", "text")

    def __init__(self, op: Literal["assigned", "restart", "joined"], text: str) -> None:
        self.op = op
        self.text = text

    def model(self) -> ServerMessage:
        return SERVER_MESSAGE.validate_json(self.text)

    def __repr__(self) -> str:
        return f"Prepared({self.text})"


class RoundTemplate:
    """The members' messages of one round, from ``first`` (the first member's
    assignment, validated). ``reason``: the round's, for the members whose
    ``restart`` carries their place (:meth:`restart`); ``probe_key``: the
    round's, given to the members that answer probes."""

    def __init__(self, first: Assignment, probe_key: str | None, reason: str | None = None) -> None:
        if first.probe_key != probe_key and probe_key is not None:  # the key validated once, as a member holds it
            Assignment.model_validate({**first.model_dump(), "probe_key": probe_key})
        shared = first.model_dump(mode="json")
        own = tuple(name for name in shared if name in OWN)
        _check(own == OWN, f"Assignment's own fields are {own}, templates.OWN says {OWN}")
        items = [f'"{name}":' + (_SLOT if name in OWN else to_json(v).decode()) for name, v in shared.items()]
        self._parts = ("{" + ",".join(items) + "}").split(_SLOT)
        self._key = to_json(probe_key).decode()
        watch = [peer_text(w) for w in first.watch]
        keyed = first.probe_key is not None
        body = self.assignment(first.group_rank, first.local_world_size, first.rank_offset, watch, keyed)
        want = first.model_dump_json()
        _check(body == want, f"the template wrote {body}, pydantic {want}")
        whole = AssignedMsg(assignment=first).model_dump_json()
        _check(whole.endswith(body + "}"), whole)
        self._assigned = whole[: -len(body) - 1]  # '{"op":"assigned","assignment":'
        self._restart = ""
        if reason is not None:
            head = RestartMsg(round=first.round, reason=reason).model_dump_json()
            _check(head.endswith(_NO_ASSIGNMENT), head)
            self._restart = head[: -len(_NO_ASSIGNMENT)] + ',"assignment":'

    def assignment(self, group_rank: int, local_world_size: int, rank_offset: int, watch: list[str], key: bool) -> str:
        """One member's assignment: its own fields (``watch``: each watched peer's JSON, written once for the round;
        ``key``: whether it gets the round's probe key)."""
        p = self._parts
        return (
            f"{p[0]}{group_rank}{p[1]}{local_world_size}{p[2]}{rank_offset}{p[3]}[{','.join(watch)}]"
            f"{p[4]}{self._key if key else 'null'}{p[5]}"
        )

    def assigned(self, assignment: str) -> Prepared:
        return Prepared("assigned", self._assigned + assignment + "}")

    def restart(self, assignment: str) -> Prepared:
        _check(bool(self._restart), "a restart needs the round's reason")
        return Prepared("restart", self._restart + assignment + "}")


def joined(
    round_no: int,
    node_id: str,
    heartbeat_s: float,
    waiting_for: dict[str, Any] | None,
    node_secret: str | None,
    run: int,
) -> Prepared:
    """A ``joined`` as :class:`~rdzv_common.protocol.JoinedMsg` writes it, from values the
    round machine made within the model's bounds (the node id its join validated, the
    secret it drew, ``waiting_for`` as :func:`.views.waiting_fields` gives it): a join
    storm's 16,384 were each a JoinedMsg and a WaitingInfo built, validated and serialized.
    pydantic's own writer writes it (a plain dict in the model's field order, checked against
    the model's own text at import), so the text is the model's, byte for byte."""
    return Prepared(
        "joined",
        to_json(
            {
                "op": "joined",
                "round": round_no,
                "node_id": node_id,
                "heartbeat_s": float(heartbeat_s),
                "waiting_for": waiting_for,
                "node_secret": node_secret,
                "run": run,
            }
        ).decode(),
    )


def peer_text(peer: WatchPeer) -> str:
    """A watched member as its watchers' assignments write it: ``model_dump_json``'s
    writer without its wrapper (~1 us less; the template's check goes through it too)."""
    return _write_peer(peer).decode()


_write_peer = WatchPeer.__pydantic_serializer__.to_json


def _check(ok: bool, what: str) -> None:
    """A template that would not write what pydantic writes is a bug: never sent (also under -O)."""
    if not ok:
        raise AssertionError(f"rounds.templates: {what}")


# joined's dict is the model's text: a field added, removed or moved, or written another way,
# fails here, at import, not on the wire (waiting_for's dict: tests/unit/test_templates.py)
_check(
    joined(1, "n", 2, None, "s" * 32, 3).text
    == JoinedMsg(round=1, node_id="n", heartbeat_s=2, node_secret="s" * 32, run=3).model_dump_json(),
    "joined() does not write what JoinedMsg writes",
)
