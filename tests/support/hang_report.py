"""What a test that is about to time out is waiting for.

pytest-timeout prints the threads' stacks, but an async test's wait is a coroutine
suspended in the event loop, which no thread stack shows (the main thread is in
`select`). Shortly before the timeout, this prints the stack of every unfinished
asyncio task to stderr, so the test's captured output says which await never returned.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Iterator

import pytest

# Printed this long before pytest-timeout fails the test.
AHEAD_S = 10.0


def timeout_of(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    return float(item.config.getini("timeout") or 0)


def print_pending_tasks(nodeid: str) -> None:
    """Each unfinished task's stack (read from this thread: a diagnosis, not a result)."""
    try:
        tasks = [t for t in list(asyncio.tasks._all_tasks) if not t.done()]
    except RuntimeError:  # the set changed while copied
        tasks = []
    print(f"\n--- {nodeid}: {len(tasks)} asyncio task(s) still waiting ---", file=sys.stderr)
    for task in tasks:
        print(f"{task.get_name()}:", file=sys.stderr)
        try:
            for line in await_chain(task.get_coro()):
                print(line, file=sys.stderr)
        except Exception as exc:  # a frame that went away meanwhile
            print(f"  (stack unreadable: {exc!r})", file=sys.stderr)
    sys.stderr.flush()


def await_chain(coro: object) -> list[str]:
    """Where a suspended coroutine waits: its frame, then each coroutine it awaits
    (Task.print_stack shows only the outermost)."""
    lines = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            code = frame.f_code
            lines.append(f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}')
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return lines


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    limit = timeout_of(item)
    timer = None
    if limit > 2 * AHEAD_S:
        timer = threading.Timer(limit - AHEAD_S, print_pending_tasks, args=(item.nodeid,))
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
