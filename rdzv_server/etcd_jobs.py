"""Jobs in etcd (``--etcd``, :mod:`rdzv_server.ha`): the keys of a job's
pointer and blobs (:mod:`rdzv_server.joblog`), the operations of a write, and
the load of every job.

``<prefix>jobs/<job id>``: the pointer (JSON: ``by``, ``term`` and the
pointer's fields), or, written before that layout, ``{"by", "term", "record"}``
with the whole record; ``<prefix>jobdata/<job id>/<gen>.<chunk>``: a blob
(JSON: ``by``, ``term``, ``data``: its text). A write's operations are its
blobs, then its pointer, then the deletion of the blobs below a new base: in
order, cut into transactions by :func:`rdzv_server.etcd.batches`, so that the
pointer commits last and a reader never sees blobs it does not name. Job ids
have no ``/`` (wire.ID_PATTERN), so one job's blobs are one range."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from rdzv_common.wire import printable

from . import etcd, joblog, rounds
from .rounds import Job


class StateError(Exception):
    """The state in etcd cannot be loaded (a record that is not rdzv's)."""


def ops(
    prefix: bytes, job_id: str, plan: joblog.Plan | None, wrap: Callable[[str, str], bytes]
) -> list[dict[str, Any]]:
    """The operations of a job's write, or of its removal (``plan`` None: the
    pointer and every blob). ``wrap(json, field)``: the value with the writer's
    ``by`` and ``term``."""
    key = prefix + b"jobs/" + job_id.encode()
    data = prefix + b"jobdata/" + job_id.encode() + b"/"
    if plan is None:
        return [etcd.delete(key), etcd.delete(data, etcd.prefix_end(data))]
    out = [
        etcd.put(data + joblog.blob_name(gen, chunk).encode(), wrap(json.dumps(text), "data"))
        for gen, chunk, text in plan.blobs
    ]
    pointer = json.dumps(plan.pointer, separators=(",", ":"))
    out.append(etcd.put(key, wrap(pointer, "pointer")))
    if plan.drop_below is not None:
        out.append(etcd.delete(data, data + joblog.blob_name(plan.drop_below, 0).encode()))
    return out


def _named(kv: etcd.KeyValue) -> str:
    return printable(kv.key.decode("utf-8", "replace"))


async def load(client: etcd.EtcdClient, prefix: bytes, revision: int = 0) -> dict[str, tuple[Job, joblog.Written]]:
    """Every job under ``prefix`` and what etcd holds of it (raises StateError on a foreign
    record), read at ``revision`` (0: each range at its newest; rdzv_server.ha_standby.load pins one)."""
    blobs: dict[str, dict[tuple[int, int], str]] = {}
    data = prefix + b"jobdata/"
    kvs, _ = await client.range_prefix(data, revision)
    for kv in kvs:
        job_id, _, name = kv.key[len(data) :].decode("utf-8", "replace").partition("/")
        try:
            blobs.setdefault(job_id, {})[joblog.parse_blob_name(name)] = json.loads(kv.value)["data"]
        except Exception as e:
            raise StateError(f"etcd key {_named(kv)}: not a blob ({e!r})") from e
    jobs: dict[str, tuple[Job, joblog.Written]] = {}
    kvs, _ = await client.range_prefix(prefix + b"jobs/", revision)
    for kv in kvs:
        name = kv.key[len(prefix) + 5 :].decode("utf-8", "replace")
        try:
            value = json.loads(kv.value)
            if "pointer" in value:
                written = joblog.assemble(value["pointer"], blobs.get(name, {}))
                job = joblog.to_job(written.snap)
            else:  # the older layout: the whole record; the next write makes a base
                job = rounds.from_record(value["record"])
                written = joblog.Written(joblog.snapshot(job, time.time()))
        except Exception as e:
            raise StateError(f"etcd key {_named(kv)}: not a job ({e!r})") from e
        jobs[name] = (job, written)
    return jobs
