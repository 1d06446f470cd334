"""The suite's hang report (tests/support/hang_report.py): the await chain it prints."""

from __future__ import annotations

import asyncio

import pytest
from tests.support.hang_report import await_chain, print_pending_tasks


async def test_a_waiting_task_is_shown_down_to_the_await_that_holds_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    release = asyncio.Event()

    async def inner() -> None:
        await release.wait()

    async def outer() -> None:
        await inner()

    task = asyncio.create_task(outer(), name="held")
    await asyncio.sleep(0)
    chain = await_chain(task.get_coro())
    assert [line.rsplit(" in ", 1)[1] for line in chain] == ["outer", "inner", "wait"]

    print_pending_tasks("probe")
    report = capsys.readouterr().err
    assert "held:" in report and "in inner" in report
    release.set()
    await task
