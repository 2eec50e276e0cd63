"""cancel_and_wait: a task that swallows a cancellation still ends; one that
cleans up is given the time to; errors are logged; a cancelled caller passes
its cancellation on."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from rdzv_common.tasks import cancel_and_wait

T = 5.0  # deadline on every wait


async def test_a_task_that_swallows_cancellations_ends() -> None:
    swallowed = 0

    async def stubborn() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                swallowed += 1
                if swallowed > 2:
                    raise

    task = asyncio.ensure_future(stubborn())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait(task, grace=0.1), T)
    assert task.cancelled() and swallowed == 3


async def test_a_wait_for_loop_cancelled_as_its_awaitable_finishes_ends() -> None:
    """The race of CPython gh-86296 (Python < 3.12): the cancel arrives in the
    loop step in which wait_for's awaitable completes; wait_for returns its
    result and the loop goes on (one cancel is not enough: checked on 3.11).
    The link's connect loop has this shape."""
    inner: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def loop() -> None:
        nonlocal inner
        while True:
            await asyncio.wait_for(inner, 60)
            inner = asyncio.get_running_loop().create_future()

    task = asyncio.ensure_future(loop())
    await asyncio.sleep(0.01)  # in wait_for now
    inner.set_result(1)
    stop = asyncio.ensure_future(cancel_and_wait(task, grace=0.1))  # cancels within this same step
    await asyncio.wait_for(stop, T)
    assert task.cancelled()


async def test_a_task_cleaning_up_after_its_cancel_is_not_cut_short() -> None:
    cleaned = False

    async def polite() -> None:
        nonlocal cleaned
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.5)  # e.g. a WebSocket close waiting for the server's
            cleaned = True

    task = asyncio.ensure_future(polite())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait(task, grace=2.0), T)
    assert cleaned and task.cancelled()


async def test_errors_are_logged_and_none_is_skipped(caplog: pytest.LogCaptureFixture) -> None:
    async def fail() -> None:
        raise ValueError("boom")

    failed = asyncio.ensure_future(fail())
    failed.set_name("the-failing-one")
    done = asyncio.ensure_future(asyncio.sleep(0))
    await asyncio.sleep(0.01)
    with caplog.at_level(logging.ERROR, logger="rdzv_common.tasks"):
        # and no "exception was never retrieved" (warnings are errors here)
        await asyncio.wait_for(cancel_and_wait(failed, None, done), T)
    assert failed.done() and done.done()
    assert [r.getMessage() for r in caplog.records] == ["the-failing-one ended with an error"]


async def test_a_cancelled_caller_cancels_the_tasks_too() -> None:
    async def slow_cleanup() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(3600)  # its cleanup would take forever: only a second cancel ends it

    task = asyncio.ensure_future(slow_cleanup())
    await asyncio.sleep(0)
    caller = asyncio.ensure_future(cancel_and_wait(task, grace=60))
    await asyncio.sleep(0.05)
    caller.cancel()
    started = time.monotonic()
    done, _ = await asyncio.wait([caller, task], timeout=T)
    assert caller in done and caller.cancelled()
    assert task in done and task.cancelled(), time.monotonic() - started
