"""The queue the scheduling pass keeps in memory, on the real PostgreSQL and NATS: its
first load from the stored jobs, and which row changes it reads back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import nats
import pytest
from tests.support.admission import SMALL_CLUSTER, with_inventory
from tests.support.identity import harness_options
from tests.support.waiting import eventually, stream_messages_after

from gpusched.admission import app as admission_app
from gpusched.admission import store
from gpusched.admission.app import NAME as ADMISSION
from gpusched.admission.app import SCHEMA, assemble
from gpusched.admission.queue import JobState, new_job_id
from gpusched.contracts.messages import GpuRequest, SubmitJob
from gpusched.infra.migrations import migrations_dir
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import Settings

# More than the first load reads per statement (store._QUEUE_PAGE): several pages.
STORED = 450
# The first of them is placed, the others wait.
WAITING = STORED - 1


@pytest.fixture
async def runtime(settings: Settings, tmp_path: Path) -> AsyncIterator[ServiceRuntime]:
    """The admission runtime, connected and migrated, not yet serving."""
    rt = ServiceRuntime(
        ADMISSION,
        SCHEMA,
        with_inventory(settings, tmp_path, SMALL_CLUSTER),
        migrations_dir(admission_app.__file__),
    )
    await rt.start()
    yield rt
    await rt.close()


def gang(number: int, at: datetime) -> store.NewJob:
    """A queued job of 3 GPUs: the cluster's 4 shared ones take one such at a time."""
    return store.NewJob(new_job_id(), spec(f"gang-{number}"), (), at, JobState.QUEUED, {})


def spec(name: str) -> SubmitJob:
    return SubmitJob(name=name, team="vision", gpus=GpuRequest(count=3))


async def queued_unaudited(rt: ServiceRuntime) -> int:
    async with rt.uow() as uow:
        result = await uow.execute(
            f"SELECT count(*) FROM {SCHEMA}.jobs WHERE state = 'queued' AND NOT wait_audited"
        )
        return int(result.scalar_one())


async def test_every_job_stored_before_the_start_is_taken_in_and_a_wait_audited_once(
    runtime: ServiceRuntime, settings: Settings
) -> None:
    start = datetime.now(UTC) - timedelta(hours=1)
    async with runtime.uow() as uow:
        await store.insert_jobs(uow, [gang(n, start + timedelta(seconds=n)) for n in range(STORED)])
        await uow.commit()
    await assemble(runtime)
    running = asyncio.create_task(runtime.run())
    assert settings.nats_url is not None
    nc = await nats.connect(settings.nats_url, **harness_options(settings))
    try:

        async def taken_in() -> bool:
            return await queued_unaudited(runtime) == 0

        await eventually(taken_in, within=60)
        subject = runtime.subjects.audit("job.waiting")

        async def audited() -> list[str] | None:
            messages = await stream_messages_after(nc.jetstream(), subject)
            return [m.subject for m in messages] if len(messages) >= WAITING else None

        await eventually(audited, within=60)
        # One more job: a pass runs, audits it, and none of the others again.
        reply = await nc.request(
            runtime.subjects.api_jobs_submit,
            spec("one-more").model_dump_json().encode(),
            timeout=10,
        )
        assert b'"ok":true' in reply.data.replace(b" ", b"")
        await eventually(taken_in, within=30)

        async def all_audits() -> int | None:
            count = len(await stream_messages_after(nc.jetstream(), subject))
            return count if count == WAITING + 1 else None

        assert await eventually(all_audits, within=30) == WAITING + 1
    finally:
        await nc.close()
        runtime.request_stop()
        await asyncio.wait_for(running, 20)


async def test_the_schedulers_note_that_a_wait_was_audited_is_not_read_back_as_a_change(
    runtime: ServiceRuntime,
) -> None:
    job = gang(0, datetime.now(UTC))
    async with runtime.uow() as uow:
        await store.insert_jobs(uow, [job])
        await uow.commit()

    async def changed_since(mark: int) -> tuple[list[str], set[str]]:
        async with runtime.uow() as uow:
            queued, others = await store.jobs_changed_since(uow, mark, lambda _: None)
            return [j.job_id for j in queued], others

    async def change(step: str) -> int:
        """The change mark before ``step`` runs in a transaction of its own."""
        async with runtime.uow() as uow:
            mark = await store.change_mark(uow)
        async with runtime.uow() as uow:
            now = datetime.now(UTC)
            if step == "audited":
                await store.mark_waiting(uow, [job.job_id], now)
            elif step == "requeued":
                await store.set_job_state(uow, job.job_id, JobState.QUEUED, now)
            else:
                await store.park_job(uow, job.job_id, "a bug", now)
            await uow.commit()
        return mark

    assert await changed_since(await change("audited")) == ([], set())
    # Any other change is news, the flag going back to false included.
    assert await changed_since(await change("requeued")) == ([job.job_id], set())
    assert await changed_since(await change("parked")) == ([], {job.job_id})
