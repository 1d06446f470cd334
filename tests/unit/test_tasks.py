"""cancel_and_wait ends a task whose cancellation was lost, and never waits unbounded."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest

from gpusched.infra.tasks import cancel_and_wait


async def test_a_task_that_lost_its_cancellation_is_cancelled_again_until_it_ends() -> None:
    async def loses_the_first_cancel() -> None:
        # Lost, as asyncio.wait_for loses it on Python 3.11 (infra.tasks).
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(30)
        await asyncio.sleep(30)

    task = asyncio.create_task(loses_the_first_cancel())
    await asyncio.sleep(0)
    # One cancel and a bounded wait: it runs on.
    task.cancel()
    await asyncio.wait({task}, timeout=0.2)
    assert not task.done()

    assert await cancel_and_wait(task, within=2.0, settle_s=0.05)
    assert task.cancelled()


async def test_tasks_cancelled_inside_wait_for_as_their_awaitable_completes_all_end() -> None:
    # The real race: each pass of the loop waits on something that completes at once,
    # as a delivery acknowledged at the moment of an eviction does.
    steps = 0

    async def trains(event: asyncio.Event) -> None:
        nonlocal steps
        loop = asyncio.get_running_loop()
        while True:
            event.clear()
            loop.call_soon(event.set)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), 5)
            steps += 1
            await asyncio.sleep(0.001)

    tasks = []
    for i in range(30):
        task = asyncio.create_task(trains(asyncio.Event()))
        for _ in range(i % 3):
            await asyncio.sleep(0)
        tasks.append(task)
    ended = await asyncio.gather(*(cancel_and_wait(t, within=5.0, settle_s=0.05) for t in tasks))

    assert all(ended) and all(t.done() for t in tasks)
    assert steps > 0


async def test_a_task_that_never_ends_is_given_up_within_the_bound_and_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    released = False

    async def ignores_every_cancel() -> None:
        while not released:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0.01)

    task = asyncio.create_task(ignores_every_cancel(), name="stubborn")
    await asyncio.sleep(0)  # running: a task cancelled before its first step just ends
    loop = asyncio.get_running_loop()
    started = loop.time()
    with caplog.at_level(logging.ERROR, logger="gpusched.infra.tasks"):
        assert not await cancel_and_wait(task, within=0.3, settle_s=0.05)
    assert loop.time() - started < 2.0
    assert "task stubborn did not end within 0.3 s of being cancelled" in caplog.text
    released = True
    await asyncio.wait_for(task, 2)


async def test_a_task_that_already_failed_is_done_and_its_error_is_not_raised() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    task = asyncio.create_task(fails())
    await asyncio.wait({task})

    assert await cancel_and_wait(task)
