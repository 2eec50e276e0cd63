"""cancel_and_wait: a task that swallows a cancellation still ends."""

from __future__ import annotations

import asyncio

from rdzv_server.tasks import cancel_and_wait

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
    await asyncio.wait_for(cancel_and_wait(task), T)
    assert task.cancelled() and swallowed == 3


async def test_a_wait_for_loop_cancelled_as_its_awaitable_finishes_ends() -> None:
    """The race of CPython gh-86296 (Python < 3.12): the cancel arrives in the
    loop step in which wait_for's awaitable completes; wait_for returns its
    result and the loop goes on. The link's connect loop has this shape."""
    inner: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    rounds = 0

    async def loop() -> None:
        nonlocal inner, rounds
        while True:
            await asyncio.wait_for(inner, 60)
            rounds += 1
            inner = asyncio.get_running_loop().create_future()

    task = asyncio.ensure_future(loop())
    await asyncio.sleep(0.01)  # in wait_for now
    inner.set_result(1)
    stop = asyncio.ensure_future(cancel_and_wait(task))  # cancels within this same step
    await asyncio.wait_for(stop, T)
    assert task.cancelled()


async def test_errors_of_ended_tasks_are_taken_and_none_is_skipped() -> None:
    async def fail() -> None:
        raise ValueError("boom")

    failed = asyncio.ensure_future(fail())
    await asyncio.sleep(0)
    done = asyncio.ensure_future(asyncio.sleep(0))
    await asyncio.sleep(0.01)
    # no "exception was never retrieved" (warnings are errors here)
    await asyncio.wait_for(cancel_and_wait(failed, None, done), T)
    assert failed.done() and done.done()
