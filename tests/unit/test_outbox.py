"""The outbox (rdzv_server.outbox): what waits for a remote write runs after it,
in order; writes of a job coalesce; a failed write announces nothing queued."""

from __future__ import annotations

import asyncio

import pytest

from rdzv_server import outbox as outbox_mod
from rdzv_server.outbox import Outbox


class Remote:
    """A remote store whose writes finish when the test says so."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []
        self.gates: list[asyncio.Future[None]] = []
        self.failed: list[tuple[str, BaseException]] = []

    async def write(self, key: str, payload: object) -> None:
        self.sent.append((key, payload))
        gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.gates.append(gate)
        await gate

    def on_failed(self, key: str, err: BaseException) -> None:
        self.failed.append((key, err))

    async def finish(self, i: int, error: BaseException | None = None) -> None:
        while len(self.gates) <= i:
            await asyncio.sleep(0)
        if error is None:
            self.gates[i].set_result(None)
        else:
            self.gates[i].set_exception(error)
        for _ in range(5):
            await asyncio.sleep(0)


async def test_nothing_queued_runs_at_once():
    r = Remote()
    box = Outbox(r.write, r.on_failed)
    seen: list[str] = []
    box.publish("j", lambda: seen.append("now"))
    assert seen == ["now"] and not box.busy("j")
    await box.flushed("j")  # nothing to wait for


async def test_publication_waits_for_its_write_and_order_holds():
    r = Remote()
    box = Outbox(r.write, r.on_failed)
    seen: list[str] = []
    box.write("j", "rec1")
    box.publish("j", lambda: seen.append("p1"))
    box.publish("j", lambda: seen.append("p1b"))  # no write of its own: still behind rec1
    box.publish("other", lambda: seen.append("other"))  # another key is not held up
    assert seen == ["other"]
    await r.finish(0)
    assert seen == ["other", "p1", "p1b"]
    assert r.sent == [("j", "rec1")]
    assert not box.busy("j")


async def test_writes_of_a_job_coalesce_and_publications_wait_for_the_newest():
    r = Remote()
    box = Outbox(r.write, r.on_failed)
    seen: list[str] = []
    box.write("j", "rec1")
    box.publish("j", lambda: seen.append("p1"))
    for _ in range(20):  # until rec1 is in flight
        if r.sent:
            break
        await asyncio.sleep(0)
    assert r.sent == [("j", "rec1")]
    box.write("j", "rec2")
    box.publish("j", lambda: seen.append("p2"))
    box.write("j", "rec3")
    box.publish("j", lambda: seen.append("p3"))
    await r.finish(0)
    assert seen == ["p1"]  # p2 waits: rec2's state is not in the remote store yet
    await r.finish(1)
    assert r.sent == [("j", "rec1"), ("j", "rec3")]  # rec2 never sent: rec3 holds it
    assert seen == ["p1", "p2", "p3"]
    assert box.writes == 2


async def test_host_writes_do_not_coalesce():
    r = Remote()
    box = Outbox(r.write, r.on_failed)
    box.write("h", ["op1"], coalesce=False)
    box.write("h", ["op2"], coalesce=False)
    await r.finish(0)
    await r.finish(1)
    assert r.sent == [("h", ["op1"]), ("h", ["op2"])]


async def test_a_failed_write_announces_nothing_queued_and_says_so():
    r = Remote()
    box = Outbox(r.write, r.on_failed)
    seen: list[str] = []
    box.write("j", "rec1")
    box.publish("j", lambda: seen.append("p1"))
    waiter = asyncio.ensure_future(box.flushed("j"))
    await asyncio.sleep(0)
    box.write("j", "rec2")
    box.publish("j", lambda: seen.append("p2"))
    await r.finish(0, OSError("etcd unreachable"))
    assert seen == []
    assert [k for k, _ in r.failed] == ["j"] and isinstance(r.failed[0][1], OSError)
    with pytest.raises(OSError):
        await waiter
    assert not box.busy("j")
    box.publish("j", lambda: seen.append("later"))  # the key starts afresh
    assert seen == ["later"]


async def test_drop_all_cancels_and_announces_nothing():
    r = Remote()
    box = Outbox(r.write, r.on_failed)
    seen: list[str] = []
    box.write("j", "rec1")
    box.publish("j", lambda: seen.append("p1"))
    waiter = asyncio.ensure_future(box.flushed("j"))
    await asyncio.sleep(0)
    box.drop_all()
    with pytest.raises(ConnectionAbortedError):
        await waiter
    await asyncio.sleep(0)
    assert seen == [] and not box.busy("j") and len(box) == 0
    assert r.failed == []  # dropped on purpose: no put-back


async def test_a_bad_publication_does_not_stop_the_others(caplog):
    r = Remote()
    box = Outbox(r.write, r.on_failed)
    seen: list[str] = []

    def bad() -> None:
        raise RuntimeError("bug")

    box.write("j", "rec1")
    box.publish("j", bad)
    box.publish("j", lambda: seen.append("p2"))
    await r.finish(0)
    assert seen == ["p2"]
    assert "publishing a step of j failed" in caplog.text


async def test_a_queue_past_its_bound_fails_its_key(monkeypatch):
    monkeypatch.setattr(outbox_mod, "MAX_QUEUE", 3)
    r = Remote()
    box = Outbox(r.write, r.on_failed)
    seen: list[str] = []
    box.write("j", "rec1")
    for i in range(5):
        box.publish("j", lambda i=i: seen.append(f"p{i}"))
    assert [k for k, _ in r.failed] == ["j"]
    assert isinstance(r.failed[0][1], outbox_mod.OutboxFull)
    # the overflowing entry and everything queued is dropped; later ones find the key
    # idle and run at once (the store skips them: the job was put back, a new object)
    assert seen == ["p3", "p4"]
    assert not box.busy("j")
