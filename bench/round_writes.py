"""What a node-loss round change writes to storage, by job size (issue 24).

    python -m bench.round_writes [--nodes 1024,4096,16384] [--changes 20] [--out results.json] [--direct]

One job of N nodes is formed in process through the real Store (nodes are
channels that record what they are told; no network), then ``--changes``
node-loss round changes are made one after the other: a member leaves, every
other member rejoins, the round completes. What storage is asked to write is
measured at the seam, on both durable backends:

sqlite
    the real database in a temporary data dir; every SQL statement it runs,
    values bound (sqlite3's trace callback). bytes: their length; requests:
    transactions (each one fsync with synchronous=FULL).
etcd
    the real EtcdBackend and Replica (outbox, fencing, batching) over an
    in-memory stand-in for etcd's transactions (bench.round_writes.MemEtcd).
    bytes: keys and values as etcd counts them; requests: transactions;
    largest: the largest transaction (etcd refuses one over 1.5 MiB by default).

``--direct``: the joins offer direct ports, as rdzv-agent's, so each change
is the leave alone, the round formed as it opens (docs/design.md "Direct
re-formation"; at most 4 changes: rank 0 offered 4 ports, the formation took one).

"first" is the first change after formation; "mean" is over all changes,
compactions of the chain into a new base included; "write s": seconds spent in
the backend's writes per change (taking the job's snapshot or record, the
delta, the SQL or the transactions; the store's own join handling excluded). The same script runs on
the code before this layout (it uses no new interface), which is how the
"before" rows in docs/numbers.md were made.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from rdzv_common.protocol import SERVER_MESSAGE, JobSpec, JoinMsg
from rdzv_server import etcd
from rdzv_server.ha import Replica
from rdzv_server.storage import EtcdBackend
from rdzv_server.store import Store, StoreSettings


class Chan:
    def __init__(self) -> None:
        self.secret: str | None = None

    def deliver(self, text: str) -> None:
        msg = SERVER_MESSAGE.validate_json(text)
        if msg.op == "joined" and msg.node_secret:
            self.secret = msg.node_secret

    def drop(self) -> None:
        pass


class MemEtcd:
    """etcd's transactions in memory; ``sizes``: bytes of each transaction."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.timeout_s = etcd.DEFAULT_TIMEOUT_S  # a request's time limit, as the client's (Replica.write_timeout)

    async def txn(self, compare: Any, success: list[dict[str, Any]], *args: Any, **kw: Any) -> etcd.TxnResult:
        bodies = [next(iter(op.values())) for op in success]
        self.sizes.append(sum(len(etcd.unb64(b["key"])) + len(etcd.unb64(b.get("value"))) for b in bodies))
        return etcd.TxnResult(True, len(self.sizes), [])


def join(node_id: str, spec: JobSpec, secret: str | None = None, direct: bool = False) -> JoinMsg:
    return JoinMsg(
        job_id="big",
        node_id=node_id,
        host=f"host-{node_id}",
        addr="10.0.0.1",
        local_world_size=8,
        master_port=29500,
        spec=spec,
        node_secret=secret,
        direct_ports=[29501, 29502, 29503, 29504] if direct else [],
    )


def timed(obj: Any, name: str, spent: list[float]) -> None:
    """Add the time of each call of ``obj.name`` (sync or async) to ``spent[0]``."""
    real = getattr(obj, name)
    if asyncio.iscoroutinefunction(real):

        async def wrapper_async(*args: Any) -> Any:
            t = time.perf_counter()
            try:
                return await real(*args)
            finally:
                spent[0] += time.perf_counter() - t

        setattr(obj, name, wrapper_async)
        return

    def wrapper(*args: Any) -> Any:
        t = time.perf_counter()
        try:
            return real(*args)
        finally:
            spent[0] += time.perf_counter() - t

    setattr(obj, name, wrapper)


def transactions(statements: list[str]) -> int:
    """Transactions among SQL statements: BEGIN..COMMIT, or one write alone (autocommit)."""
    count, open_ = 0, False
    for s in statements:
        word = s.split(None, 1)[0].upper() if s.strip() else ""
        if word == "BEGIN":
            open_ = True
        elif word in ("COMMIT", "ROLLBACK"):
            count, open_ = count + 1, False
        elif not open_ and word in ("INSERT", "UPDATE", "DELETE", "REPLACE"):
            count += 1
    return count


class Meter:
    """What one backend was asked to write: per change (bytes, requests, largest)."""

    def __init__(self) -> None:
        self.changes: list[tuple[int, int, int, float]] = []

    def row(self, backend: str, n: int) -> dict[str, Any]:
        first = self.changes[0]
        k = len(self.changes)
        return {
            "backend": backend,
            "nodes": n,
            "first_bytes": first[0],
            "first_requests": first[1],
            "mean_bytes": sum(c[0] for c in self.changes) / k,
            "mean_requests": sum(c[1] for c in self.changes) / k,
            "largest": max(c[2] for c in self.changes),
            "write_s": sum(c[3] for c in self.changes) / k,
        }


async def run(backend: str, n: int, changes: int, direct: bool = False) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="rdzv-bench-"))
    clock = [1000.0]
    meter = Meter()
    if backend == "sqlite":
        store = Store(StoreSettings(data_dir=tmp), clock=lambda: clock[0])
        store.open()
        assert store.db is not None
        statements: list[str] = []
        store.db.conn.set_trace_callback(statements.append)

        def sample() -> tuple[int, int, int]:
            return sum(len(s) for s in statements), transactions(statements), max(map(len, statements), default=0)

        reset = statements.clear
    else:
        mem = MemEtcd()
        store = Store(StoreSettings(), clock=lambda: clock[0])
        replica = Replica(mem, "http://127.0.0.1:9", "/bench/", replica_id="bench")  # type: ignore[arg-type]
        replica.role, replica.ready, replica.term, replica._lease_until = "leader", True, 1, float("inf")
        store.replica = replica
        store.backend = EtcdBackend(replica, store._write_failed)

        def sample() -> tuple[int, int, int]:
            return sum(mem.sizes), len(mem.sizes), max(mem.sizes, default=0)

        reset = mem.sizes.clear
    spent = [0.0]  # seconds inside the backend's writes (the snapshot or record, the delta, the SQL)
    timed(store.backend, "write_job", spent)
    if backend == "etcd":
        timed(store.backend, "_write", spent)
    spec = JobSpec(min_nodes=max(1, n - changes), max_nodes=n, heartbeat_timeout_s=3600, join_timeout_s=3600)
    chans = {f"node{i:06d}": Chan() for i in range(n)}
    for node_id, chan in chans.items():
        store.join(join(node_id, spec, direct=direct), chan)
    await store.flushed("big")
    live = list(chans)
    for c in range(changes):
        reset()
        spent[0] = 0.0
        clock[0] += 1.0
        lost = live.pop(len(live) // 2)
        store.leave("big", lost, "bench", chans[lost])  # type: ignore[arg-type]
        for node_id in live if not direct else ():  # (direct: the round formed as it opened)
            store.join(join(node_id, spec, chans[node_id].secret), chans[node_id])  # type: ignore[arg-type]
        await store.flushed("big")
        job = store.jobs["big"]
        assert job.state.value == "running" and job.round == c + 1 and len(job.order) == len(live)
        meter.changes.append((*sample(), spent[0]))
    await store.stop()
    return meter.row(backend, n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", default="1024,4096,16384")
    ap.add_argument("--changes", type=int, default=20)
    ap.add_argument("--out")
    ap.add_argument(
        "--direct", action="store_true", help="the joins offer direct ports (as rdzv-agent's): at most 4 changes"
    )
    args = ap.parse_args()
    if args.direct:
        args.changes = min(args.changes, 4)
    rows = []
    print(
        f"{'backend':8} {'nodes':>6} {'first: bytes':>13} {'requests':>9} {'mean: bytes':>12} "
        f"{'requests':>9} {'largest':>10} {'write s':>8}"
    )
    for n in [int(x) for x in args.nodes.split(",")]:
        for backend in ("sqlite", "etcd"):
            r = asyncio.run(run(backend, n, args.changes, args.direct))
            rows.append(r)
            print(
                f"{r['backend']:8} {n:6d} {r['first_bytes']:13,d} {r['first_requests']:9d} "
                f"{r['mean_bytes']:12,.0f} {r['mean_requests']:9.1f} {r['largest']:10,d} {r['write_s']:8.3f}",
                flush=True,
            )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
