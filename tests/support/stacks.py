"""A Stack started from an async test: off the event loop, so what the test serves on
the loop (an OTLP receiver, a Prometheus client) keeps answering while it starts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from gpusched.cli.stack import Stack


@contextlib.asynccontextmanager
async def ready(stack: Stack) -> AsyncIterator[Stack]:
    """Start `stack`, wait until every service is ready, stop it on the way out."""
    await asyncio.to_thread(stack.start)
    try:
        await stack.wait_until_ready()
        yield stack
    finally:
        await asyncio.to_thread(stack.stop)
