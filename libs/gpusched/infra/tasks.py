"""Ending a task for certain, in bounded time.

`task.cancel(); await task` can wait forever on Python 3.11: when a task is cancelled in
the same loop iteration as the awaitable it waits on in `asyncio.wait_for` completes,
`wait_for` returns that result and the cancellation is lost (CPython gh-86296, fixed in
3.12). The task runs on, and whoever awaits it hangs. A simulated training job whose
event delivery was acknowledged at the moment its eviction cancelled it did exactly
that, and held the cluster agent's command consumer (one command at a time) for good.

`cancel_and_wait` cancels, gives the task `settle_s` to unwind, cancels again while it
keeps running, and gives up (logged, False) after `within` seconds.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

__all__ = ["cancel_and_wait"]

log = logging.getLogger(__name__)


async def cancel_and_wait(
    task: asyncio.Future[Any], within: float = 5.0, *, settle_s: float = 0.5
) -> bool:
    """Cancel ``task`` until it is done, for at most ``within`` seconds; True once it is
    done (its outcome retrieved: an exception it ended with is not raised here)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not task.done():
        remaining = deadline - loop.time()
        if remaining <= 0:
            name = task.get_name() if isinstance(task, asyncio.Task) else repr(task)
            log.error("task %s did not end within %.1f s of being cancelled", name, within)
            return False
        task.cancel()
        await asyncio.wait({task}, timeout=min(settle_s, remaining))
    if not task.cancelled():
        task.exception()  # retrieved: no "exception was never retrieved" at collection
    return True
