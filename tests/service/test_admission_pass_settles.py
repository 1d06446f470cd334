"""The scheduling pass and another holder of the ledger, on the real PostgreSQL: what
the pass remembers as "the ledger as I left it" must be the version it held, not
whatever the shared keeper says once its transaction has closed.

A release that takes the ledger lock the moment the pass commits, and bumps the
in-memory version before the pass has left its ``async with``, was once taken for the
pass's own version: every later pass then found "nothing new" and the freed GPUs stayed
idle while a job waited for them (seen after an admission restart under load).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Self

from tests.support.admission import with_inventory

from gpusched.admission import app as admission_app
from gpusched.admission.app import NAME as ADMISSION
from gpusched.admission.app import SCHEMA, AdmissionService, assemble
from gpusched.admission.outcomes import Outcomes
from gpusched.contracts.envelope import make_envelope
from gpusched.contracts.messages import StopReason, T, WorkloadStopped
from gpusched.infra.db import UnitOfWork, UnitOfWorkFactory
from gpusched.infra.migrations import migrations_dir
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import Settings

ONE_NODE = """
nodes:
  - name: shared-00
    pool: shared
    gpu_model: A100-80GB
    gpus: 2
    cpu_milli: 64000
    memory_mib: 524288
"""


class _Unit(UnitOfWork):
    def __init__(self, factory: Meanwhile) -> None:
        super().__init__(factory.engine, factory.schema, factory.source, factory.subjects)
        self._factory = factory
        self._done = False

    async def __aenter__(self) -> Self:
        await super().__aenter__()
        self.on_commit(self._mark)
        return self

    def _mark(self) -> None:
        self._done = True

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        then = self._factory.then if self._done else None
        if then is not None:
            self._factory.then = None
            await then()
        await super().__aexit__(exc_type, exc, tb)


class Meanwhile(UnitOfWorkFactory):
    """The service's units of work, except that the first to commit after ``then`` is
    set runs ``then`` between its commit and the end of its ``async with``."""

    def __init__(self, inner: UnitOfWorkFactory) -> None:
        super().__init__(inner.engine, inner.schema, inner.source, inner.subjects)
        self.then: Callable[[], Awaitable[None]] | None = None

    def __call__(self) -> UnitOfWork:
        return _Unit(self)


async def _submitted(service: AdmissionService, name: str) -> str:
    body = {"name": name, "team": "vision", "gpus": {"count": 2}}
    reply = await service.jobs.submit(json.dumps(body).encode())
    assert reply.ok, reply
    assert reply.job_id is not None
    return reply.job_id


async def test_a_release_that_commits_as_a_pass_closes_is_planned_on_by_the_next_pass(
    settings: Settings, tmp_path: Path
) -> None:
    rt = ServiceRuntime(
        ADMISSION,
        SCHEMA,
        with_inventory(settings, tmp_path, ONE_NODE),
        migrations_dir(admission_app.__file__),
    )
    await rt.start()
    rt.uow = units = Meanwhile(rt.uow)
    try:
        # Assembled, not run: no loop or consumer races the passes this test drives.
        service = await assemble(rt)
        scheduler = service.scheduler
        big = await _submitted(service, "big")
        assert await scheduler.run_pass() == 1
        waiting = await _submitted(service, "waits")
        outcomes = Outcomes(service.keeper, scheduler.kick)

        async def big_stops() -> None:
            async with rt.uow() as uow:
                held = await service.jobs.get(json.dumps({"job_id": big}).encode())
                assert held.job is not None and held.job.allocation_id is not None
                stopped = WorkloadStopped(
                    allocation_id=held.job.allocation_id,
                    job_id=big,
                    reason=StopReason.COMPLETED,
                    stopped_at=datetime.now(UTC),
                    exit_code=0,
                )
                envelope = make_envelope(T.WORKLOAD_STOPPED, stopped, source="agent")
                await outcomes.on_workload_stopped(envelope, uow)
                await uow.commit()

        units.then = big_stops
        # This pass still saw both GPUs held; the release commits right after it.
        assert await scheduler.run_pass() == 0
        assert units.then is None, "the release did not run inside the pass"

        assert await scheduler.run_pass() == 1
        reply = await service.jobs.get(json.dumps({"job_id": waiting}).encode())
        assert reply.job is not None and reply.job.state == "running"
    finally:
        await rt.close()
