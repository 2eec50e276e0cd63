"""A job's record in storage as a base and a chain of deltas, so that a round
change writes what changed, not the whole job (issue 24). Pure: no I/O.

Both durable backends (:mod:`rdzv_server.database`, :mod:`rdzv_server.ha`)
keep a job the same way:

* a *pointer* (the job's row in SQLite, its ``jobs/<id>`` key in etcd):
  ``{"layout": 2, "gen": g, "base": b, "chunks": n}``, small and the only
  thing a write commits;
* *blobs* (``job_data`` rows; ``jobdata/<id>/<gen>.<chunk>`` keys): the base,
  written at generation ``b`` as ``n`` chunks of its JSON text (each at most
  :data:`CHUNK_CHARS`, so that no etcd request is over its limit), and one
  delta per generation ``b+1 .. g``, each one chunk.

A write at generation ``g+1`` puts its blobs (keys no committed pointer names)
and then the pointer; a reader loads only what the pointer names. So a write
that spans several etcd requests, or dies half-way, never shows half a round:
the blobs of an uncommitted generation are ignored, and overwritten by the next
write of that generation or deleted by the next base (:attr:`Plan.drop_below`:
every blob below a new base's generation).

What makes a delta small: a job's record (:func:`rounds.to_record`) is kept
*normalised*: the nodes apart from the rest (the head), each node as its own
row without what only matters while connected (restored on load anyway:
``last_seen``, ``connected``, ``lost_deadline``, ``dropped``, ``graced``) and
without the state, group rank and rank offset its place in ``order`` /
``prev_order`` implies (a member of the running round: ``running``, its index,
the sum of the sizes before it; of the previous one: ``rejoining``). A field
is left out only when it equals what is implied, so the record comes back
exactly; it is small when the machine keeps to its rules. A node-loss round
change then changes the lost node's row and the head, and the head's lists
are written as runs copied from the lists last written (``["c", list, start,
end]``) and new items (``["v", [...]]``): ``prev_order`` is ``order`` less
the lost node, two runs.

The chain is compacted into a new base when it is as large as the base (so
what a change costs, bases included, is proportional to what changed), when a
delta would not fit in one chunk, or after :data:`MAX_CHAIN` deltas. A record
written before this layout (one JSON record) loads as it always did; the next
write of that job writes a base.
"""

from __future__ import annotations

import dataclasses
import json
import operator
from dataclasses import dataclass, field
from typing import Any

from pydantic_core import to_json

from . import rounds
from .rounds import Job, Node
from .rounds.records import _NOT_SAVED_NODE, _node_record  # a node's record, as the whole record has it

LAYOUT = 2  # the pointer's "layout": a record of the older layout has no such key
CHUNK_CHARS = 200_000  # characters of a blob: base64 in etcd's JSON gateway, ~4 per request under 1.5 MiB
MAX_CHAIN = 1000  # deltas after a base at most (a load reads them all)
_VOLATILE = ("last_seen", "connected", "lost_deadline", "dropped", "graced")  # restored on load (rounds.restored)
_RUNNING, _REJOINING = rounds.RUNNING.value, rounds.REJOINING.value
# what a node's row is made of: a row is taken again only when one of these (or its place) changed
_PLACED = ("state", "group_rank", "rank_offset")  # left out of a row when its place implies them
_ROW_FIELDS = tuple(
    f for f in Node.__dataclass_fields__ if f not in _NOT_SAVED_NODE and f not in _VOLATILE and f not in _PLACED
)
_made_of = operator.attrgetter(*_ROW_FIELDS)
_placed = operator.attrgetter(*_PLACED)
_AS_PLACED = object()  # in what a row is made of: the field is what its place implies
_Implied = tuple[str | None, int | None, int]
_OUTSIDE: _Implied = (None, None, 0)  # named in neither order nor prev_order


_encode = json.JSONEncoder(separators=(",", ":")).encode  # ensure_ascii: \u escapes


def _dumps(value: Any) -> str:
    """Compact JSON, all ASCII (a blob is cut into chunks of characters, each one byte; the
    chunks bound etcd's requests), through pydantic_core's writer: a fifth of ``json``'s time (a
    16,384-node base is 16,384 rows), the same values back, and the same text for what rows hold
    but for a float under 1e-4 (``1e-7``, not ``1e-07``) and DEL, written raw (a row written
    before is written again once). Text that is not all ASCII, or that it refuses (a lone
    surrogate), takes ``json``'s."""
    try:
        data = to_json(value)
    except Exception:  # (json writes what it can, and raises as before on what it cannot)
        return _encode(value)
    return data.decode("ascii") if data.isascii() else _encode(value)


@dataclass
class Snapshot:
    """A job as storage keeps it: the head (its record without nodes), each
    node's row (compact JSON, in the job's order of nodes), and when it was taken."""

    head: dict[str, Any]
    nodes: dict[str, str]
    at: float
    # per node, what its row was made of (snapshot's memo: a row is serialised once per change of it)
    made_of: dict[str, tuple[Any, ...]] = field(default_factory=dict, compare=False, repr=False)


@dataclass
class Written:
    """What storage holds of a job: its snapshot and where its chain stands
    (``gen`` 0: a record of the older layout, or nothing)."""

    snap: Snapshot
    gen: int = 0
    base: int = 0
    chunks: int = 0
    base_chars: int = 0
    chain_chars: int = 0

    @property
    def pointer(self) -> dict[str, Any]:
        return {"layout": LAYOUT, "gen": self.gen, "base": self.base, "chunks": self.chunks}


@dataclass
class Plan:
    """One write: the blobs to put (generation, chunk, text), then the pointer;
    blobs of generations below ``drop_below`` may go once it is committed."""

    written: Written
    blobs: list[tuple[int, int, str]]
    drop_below: int | None
    nodes: int  # node rows written (what a round change costs, measured)

    @property
    def pointer(self) -> dict[str, Any]:
        return self.written.pointer

    @property
    def chars(self) -> int:
        return sum(len(t) for _, _, t in self.blobs)


# ------------------------------------------------------------ normalising


def _implied(head: dict[str, Any], sizes: dict[str, int]) -> dict[str, _Implied]:
    """Per node id named in ``order`` / ``prev_order``: the (state, group rank,
    rank offset) its place implies (``sizes``: each node's local world size)."""
    out: dict[str, _Implied] = {}
    for node_id in head.get("prev_order", ()):
        out[node_id] = (_REJOINING, None, 0)
    offset = 0
    for rank, node_id in enumerate(head.get("order", ())):
        out[node_id] = (_RUNNING, rank, offset)
        offset += sizes.get(node_id, 0)
    return out


def _row(node: Node, implied: _Implied) -> str:
    r = _node_record(node)
    for name in _VOLATILE:
        r.pop(name, None)
    state, rank, offset = implied
    if r["state"] == state:
        del r["state"]
    if r["group_rank"] == rank:
        del r["group_rank"]
    if r["rank_offset"] == offset:
        del r["rank_offset"]
    return _dumps(r)


def snapshot(job: Job, at: float, memo: Snapshot | None = None) -> Snapshot:
    """The job as storage keeps it. O(nodes), but a node's row is serialised
    again only when what it is made of changed since ``memo`` (an earlier
    snapshot of the job, if any)."""
    head = rounds.to_record(dataclasses.replace(job, nodes={}))  # (the head alone: nodes are rows)
    del head["nodes"]
    for k, v in head.items():  # (to_record hands out the job's own lists: order, prev_order)
        if isinstance(v, list):
            head[k] = list(v)
    implied = _implied(head, {node_id: n.local_world_size for node_id, n in job.nodes.items()})
    old_rows, old_made = (memo.nodes, memo.made_of) if memo is not None else ({}, {})
    rows: dict[str, str] = {}
    made_of: dict[str, tuple[Any, ...]] = {}
    for node_id, node in job.nodes.items():
        place = implied.get(node_id, _OUTSIDE)
        state, rank, offset = _placed(node)
        made = (
            _made_of(node),
            _AS_PLACED if state == place[0] else state,
            _AS_PLACED if rank == place[1] else rank,
            _AS_PLACED if offset == place[2] else offset,
        )
        rows[node_id] = old_rows[node_id] if old_made.get(node_id) == made else _row(node, place)
        made_of[node_id] = made
    return Snapshot(head, rows, at, made_of)


def to_job(snap: Snapshot) -> Job:
    """The job a snapshot holds (raises on a record that is not one)."""
    rows = json.loads("[" + ",".join(snap.nodes.values()) + "]")  # one parse, not one a row
    if len(rows) != len(snap.nodes):  # (a damaged row that parsed as two)
        raise ValueError("node rows that do not parse one by one")
    implied = _implied(snap.head, {r["node_id"]: r["local_world_size"] for r in rows})
    for r in rows:
        state, rank, offset = implied.get(r["node_id"], _OUTSIDE)
        r.setdefault("state", state)
        r.setdefault("group_rank", rank)
        r.setdefault("rank_offset", offset)
        r.update(last_seen=snap.at, connected=False, lost_deadline=None, dropped=False, graced=False)
    return rounds.from_record({**snap.head, "nodes": rows})


# ------------------------------------------------------------------ deltas


def _key(item: Any) -> str:
    return item if isinstance(item, str) else _dumps(item)


def _keys(items: list[Any]) -> list[Any]:
    """Items as comparable keys (node ids are their own: no call per id)."""
    return items if set(map(type, items)) <= {str} else [_key(x) for x in items]


def _run(keys: list[Any], p: int, new_keys: list[Any], i: int) -> int:
    """How many items from ``new_keys[i]`` on equal those from ``keys[p]`` on (>= 1:
    the first do); compared a slice at a time, then one by one where they part."""
    n, step = 1, 256
    while True:
        m = min(step, len(new_keys) - i - n, len(keys) - p - n)
        if m > 0 and keys[p + n : p + n + m] == new_keys[i + n : i + n + m]:
            n += m
            continue
        while i + n < len(new_keys) and p + n < len(keys) and keys[p + n] == new_keys[i + n]:
            n += 1
        return n


def _list_ops(new: list[Any], old: dict[str, list[Any]]) -> list[Any]:
    """``new`` as runs of the old head's lists and new items (see the module docstring)."""
    sources = []
    for name, items in old.items():
        keys = _keys(items)
        first = dict(zip(reversed(keys), range(len(keys) - 1, -1, -1), strict=True))  # each key's first position
        sources.append((name, keys, first))
    new_keys = _keys(new)
    ops: list[Any] = []
    fresh: list[Any] = []
    i = 0
    while i < len(new):
        best: tuple[str, int, int] | None = None
        for name, keys, first in sources:
            p = first.get(new_keys[i])
            if p is None:
                continue
            n = _run(keys, p, new_keys, i)
            if best is None or n > best[2]:
                best = (name, p, n)
        if best is None or best[2] < 2:
            fresh.append(new[i])
            i += 1
            continue
        if fresh:
            ops.append(["v", fresh])
            fresh = []
        ops.append(["c", best[0], best[1], best[1] + best[2]])
        i += best[2]
    if fresh:
        ops.append(["v", fresh])
    return ops


def _delta(old: Snapshot, new: Snapshot) -> tuple[str, int] | None:
    """The delta from ``old`` to ``new`` as JSON text, and how many node rows it
    writes; None when applying it would not give ``new``'s order of nodes
    (a node removed and added again between two writes: a base is written)."""
    changed: dict[str, Any] = {}
    lists = {k: v for k, v in old.head.items() if isinstance(v, list)}
    for k, v in new.head.items():
        if k in old.head and old.head[k] == v:
            continue
        if isinstance(v, list) and lists:
            ops = _list_ops(v, lists)
            if len(_dumps(ops)) < len(_dumps(v)):
                changed[k] = ["~", ops]
                continue
        changed[k] = ["=", v]
    gone = [k for k in old.head if k not in new.head]
    rows = [(i, t) for i, t in new.nodes.items() if old.nodes.get(i) != t]
    removed = [i for i in old.nodes if i not in new.nodes]
    added = [i for i, _ in rows if i not in old.nodes]
    kept = [i for i in old.nodes if i in new.nodes] if removed else list(old.nodes)
    if kept + added != list(new.nodes):  # applied: the old order less the removed, then the added
        return None
    n = ",".join([_dumps(i) + ":" + t for i, t in rows] + [_dumps(i) + ":null" for i in removed])
    text = f'{{"at":{_dumps(new.at)},"h":{_dumps(changed)},"x":{_dumps(gone)},"n":{{{n}}}}}'
    return text, len(rows) + len(removed)


def _apply(snap: Snapshot, delta: dict[str, Any]) -> Snapshot:
    head = dict(snap.head)
    for k, (kind, v) in delta["h"].items():
        if kind == "=":
            head[k] = v
        elif kind == "~":
            items: list[Any] = []
            for op in v:
                if op[0] == "v":
                    items.extend(op[1])
                elif op[0] == "c":
                    items.extend(snap.head[op[1]][op[2] : op[3]])
                else:
                    raise ValueError(f"unknown list op {op[0]!r}")
            head[k] = items
        else:
            raise ValueError(f"unknown head change {kind!r}")
    for k in delta["x"]:
        head.pop(k, None)
    nodes = dict(snap.nodes)
    for node_id, row in delta["n"].items():
        if row is None:
            nodes.pop(node_id, None)
        else:
            nodes[node_id] = _dumps(row)
    return Snapshot(head, nodes, float(delta["at"]))


def _base(snap: Snapshot) -> str:
    n = ",".join(f"[{_dumps(i)},{t}]" for i, t in snap.nodes.items())
    return f'{{"at":{_dumps(snap.at)},"h":{_dumps(snap.head)},"n":[{n}]}}'


# ------------------------------------------------------------------- plans


def plan(prev: Written | None, snap: Snapshot) -> Plan:
    """The write that takes storage from ``prev`` (None: nothing) to ``snap``:
    a delta when the chain allows, else a new base."""
    gen = (prev.gen if prev is not None else 0) + 1
    if prev is not None and prev.gen:
        found = _delta(prev.snap, snap)
        if found is not None:
            text, rows = found
            chain = prev.chain_chars + len(text)
            if len(text) <= CHUNK_CHARS and chain <= prev.base_chars and gen - prev.base <= MAX_CHAIN:
                written = Written(snap, gen, prev.base, prev.chunks, prev.base_chars, chain)
                return Plan(written, [(gen, 0, text)], None, rows)
    text = _base(snap)
    chunks = [text[i : i + CHUNK_CHARS] for i in range(0, len(text), CHUNK_CHARS)]
    written = Written(snap, gen, gen, len(chunks), len(text), 0)
    return Plan(written, [(gen, i, c) for i, c in enumerate(chunks)], gen, len(snap.nodes))


def is_pointer(record: dict[str, Any]) -> bool:
    """A stored record is a pointer of this layout (else: a whole record of the older one)."""
    return record.get("layout") == LAYOUT


def assemble(pointer: dict[str, Any], blobs: dict[tuple[int, int], str]) -> Written:
    """What a pointer names, from the blobs read (generation, chunk) -> text.
    Raises ValueError when one it names is missing or unreadable."""
    gen, base, chunks = int(pointer["gen"]), int(pointer["base"]), int(pointer["chunks"])
    if not 0 < base <= gen or base + MAX_CHAIN < gen or chunks < 1:
        raise ValueError(f"pointer {pointer!r} names no base")
    try:
        text = "".join(blobs[(base, i)] for i in range(chunks))
        parts = [blobs[(g, 0)] for g in range(base + 1, gen + 1)]
    except KeyError as e:
        raise ValueError(f"blob {e.args[0]} named by the pointer is missing") from None
    d = json.loads(text)
    snap = Snapshot(d["h"], {str(i): _dumps(row) for i, row in d["n"]}, float(d["at"]))
    for part in parts:
        snap = _apply(snap, json.loads(part))
    return Written(snap, gen, base, chunks, len(text), sum(len(p) for p in parts))


def blob_name(gen: int, chunk: int) -> str:
    """A blob's name under its job (sorts by generation: a range below a base is one delete)."""
    return f"{gen:012d}.{chunk:04d}"


def parse_blob_name(name: str) -> tuple[int, int]:
    gen, chunk = name.split(".")
    return int(gen), int(chunk)
