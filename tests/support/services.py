"""A service started in-process on the real NATS and PostgreSQL, as its tests drive it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import ModuleType

from gpusched.infra.migrations import migrations_dir
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import Settings


@asynccontextmanager
async def running(settings: Settings, app: ModuleType) -> AsyncIterator[ServiceRuntime]:
    """The service of ``app`` (its NAME, SCHEMA and build) until the block ends."""
    rt = ServiceRuntime(app.NAME, app.SCHEMA, settings, migrations_dir(app.__file__))
    await rt.start()
    await app.build(rt)
    task = asyncio.create_task(rt.run())
    try:
        yield rt
    finally:
        rt.request_stop()
        await asyncio.wait_for(task, 20.0)
