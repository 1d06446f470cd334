"""The checkpoint store's batched writes on the real PostgreSQL: a saga saved in a unit
of work is written at commit, yet every read of the same unit of work that could
return it sees the new version, and a rolled-back unit of work writes nothing. Also a
batch's inbox claim (`UnitOfWork.claim_many`), on the service's own inbox."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from gpusched.checkpoint import app, store
from gpusched.domain.saga import (
    Begin,
    CheckpointRef,
    DeadlinePolicy,
    Saga,
    SagaState,
    Stage,
    begin,
)
from gpusched.infra.db import UnitOfWork
from gpusched.infra.migrations import migrations_dir
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import Settings

NOW = datetime.now(UTC)


@pytest.fixture
async def rt(settings: Settings) -> AsyncIterator[ServiceRuntime]:
    runtime = ServiceRuntime(app.NAME, app.SCHEMA, settings, migrations_dir(app.__file__))
    await runtime.start()
    yield runtime
    await runtime.close()


def opened(n: int) -> Saga:
    saga, _ = begin(
        Begin(
            saga_id=f"saga-{n}",
            request_id=f"req-{n}",
            allocation_id=f"alloc-{n}",
            job_id=f"job-{n}",
            gpus=8,
            started_at=NOW - timedelta(hours=1),
            grace_s=300.0,
            policy=DeadlinePolicy.ABORT,
            stage_required=Stage.PERSISTED,
            reason="test",
        ),
        NOW,
    )
    return saga


async def stored(rt: ServiceRuntime, *sagas: Saga) -> None:
    async with rt.uow() as uow:
        for saga in sagas:
            assert await store.insert_saga(uow, saga, ("p1-normal", NOW, "vision"))
        await uow.commit()


def moved(saga: Saga) -> Saga:
    """The saga one step on (what a handler would save): confirmed."""
    return dataclasses.replace(saga, state=SagaState.CONFIRMED, updated_at=NOW + timedelta(1))


async def test_a_saved_saga_is_read_back_new_in_its_unit_of_work_and_written_at_commit(
    rt: ServiceRuntime,
) -> None:
    await stored(rt, opened(1), opened(2))

    async with rt.uow() as uow:
        one = await store.lock_saga(uow, "saga-1")
        two = await store.lock_by_request(uow, "req-2")
        assert one is not None and two is not None
        await store.save_saga(uow, moved(one))
        await store.save_saga(uow, moved(two))
        # Each read that could return a pending saga sees its saved version.
        assert (await store.lock_saga(uow, "saga-1")) == moved(one)
        assert [s.state for s in await store.lock_live_by_job(uow, "job-2")] == [
            SagaState.CONFIRMED
        ]
        again, latest = await store.lock_request_and_latest(uow, "req-1", "job-1")
        assert again == moved(one) and latest is None
        await store.save_saga(uow, moved(one))
        await uow.commit()

    async with rt.uow() as uow:
        assert (await store.get_saga(uow, "saga-1")) == moved(one)
        assert (await store.get_saga(uow, "saga-2")) == moved(two)
        assert await store.count_sagas(uow) == 2


async def test_a_saga_saved_in_a_unit_of_work_that_rolls_back_is_not_written(
    rt: ServiceRuntime,
) -> None:
    await stored(rt, opened(3))
    async with rt.uow() as uow:
        saga = await store.lock_saga(uow, "saga-3")
        assert saga is not None
        await store.save_saga(uow, moved(saga))
        # No commit: rolled back.
    async with rt.uow() as uow:
        kept = await store.get_saga(uow, "saga-3")
        assert kept is not None and kept.state is SagaState.CHECKPOINTING


async def test_a_new_saga_for_an_allocation_whose_pending_saga_ended_goes_in(
    rt: ServiceRuntime,
) -> None:
    """The one-live-saga-per-allocation index must see the pending end of the old one."""
    await stored(rt, opened(4))
    async with rt.uow() as uow:
        old = await store.lock_saga(uow, "saga-4")
        assert old is not None
        ended = dataclasses.replace(old, state=SagaState.CANCELLED, updated_at=NOW)
        await store.save_saga(uow, ended)
        successor = dataclasses.replace(opened(5), allocation_id="alloc-4")
        assert await store.insert_saga(uow, successor)
        await uow.commit()
    async with rt.uow() as uow:
        assert await store.lock_live_by_allocation(uow, "alloc-4") == successor


async def test_a_batch_claims_each_new_message_once_and_none_already_applied(
    rt: ServiceRuntime,
) -> None:
    async with rt.uow() as uow:
        assert await uow.claim("m-1", "c")
        await uow.commit()
    async with rt.uow() as uow:
        assert await uow.claim_many(["m-1", "m-2", "m-3", "m-2"], "c") == {"m-2", "m-3"}
        assert await uow.claim_many(["m-1"], "another consumer") == {"m-1"}
        await uow.commit()
    async with rt.uow() as uow:
        assert await uow.claim_many(["m-2", "m-3", "m-4"], "c") == {"m-4"}


# --- a batch's reads, locked and read in one statement (`lock_for_batch`) ---------------


def checkpoint(job: int, step: int) -> CheckpointRef:
    return CheckpointRef(
        checkpoint_id=f"ckpt-{job}-{step}",
        step=step,
        uri=f"file:///ckpt/{job}/{step}",
        bytes=10,
        sha256="0" * 64,
        stage=Stage.PERSISTED,
    )


class Statements:
    """Counts the statements a unit of work sends (every store read goes through these)."""

    def __init__(self, uow: UnitOfWork, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        for name in ("fetch", "fetchrow"):
            sent = getattr(uow, name)

            async def counted(*args: Any, _sent: Any = sent) -> Any:
                self.count += 1
                return await _sent(*args)

            monkeypatch.setattr(uow, name, counted)


async def test_a_batch_lock_answers_the_reads_it_covers_from_its_rows_and_holds_them(
    rt: ServiceRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    await stored(rt, opened(11), opened(12), opened(13))
    async with rt.uow() as uow:
        await store.record_checkpoint(uow, "job-11", None, checkpoint(11, 5), NOW)
        await uow.commit()

    async with rt.uow() as uow:
        sent = Statements(uow, monkeypatch)
        await store.lock_for_batch(
            uow,
            saga_ids={"saga-11", "saga-none"},
            requests={"req-11", "req-12", "req-none"},
            live_jobs={"job-11"},
            latest_of={"job-11", "job-12"},
        )
        assert sent.count == 1
        # Another transaction cannot take the rows the batch locked.
        async with rt.uow() as other:
            with pytest.raises(asyncpg.LockNotAvailableError):
                await other.fetch(
                    "SELECT 1 FROM checkpoint.sagas WHERE saga_id = ANY($1) FOR UPDATE NOWAIT",
                    ["saga-11", "saga-12"],
                )

        eleven = await store.lock_saga(uow, "saga-11")
        assert eleven is not None and eleven.request_id == "req-11"
        assert await store.lock_saga(uow, "saga-none") is None
        twelve = await store.lock_by_request(uow, "req-12")
        assert twelve is not None and twelve.saga_id == "saga-12"
        assert await store.lock_by_request(uow, "req-none") is None
        known, latest = await store.lock_request_and_latest(uow, "req-none", "job-11")
        assert known is None and latest is not None
        assert latest.checkpoint == checkpoint(11, 5)
        assert await store.lock_request_and_latest(uow, "req-12", "job-12") == (twelve, None)
        assert await store.lock_live_by_job(uow, "job-11") == [eleven]
        assert sent.count == 1  # every read above answered from the batch's rows

        # The unit of work's own writes are seen by the reads that follow.
        await store.save_saga(uow, moved(eleven))
        assert await store.lock_saga(uow, "saga-11") == moved(eleven)
        assert await store.lock_live_by_job(uow, "job-11") == [moved(eleven)]
        ended = dataclasses.replace(moved(eleven), state=SagaState.COMPLETED)
        await store.save_saga(uow, ended)
        assert await store.lock_live_by_job(uow, "job-11") == []
        assert await store.lock_live_by_job(uow, "job-11", "req-11") == [ended]
        successor = dataclasses.replace(opened(14), job_id="job-11", allocation_id="alloc-11")
        assert await store.insert_saga(uow, successor)
        assert await store.lock_live_by_job(uow, "job-11") == [successor]
        # The saga's pending end is written first (the allocation's index must see it).
        assert sent.count == 3
        await store.record_checkpoint(uow, "job-11", None, checkpoint(11, 9), NOW)
        _, latest = await store.lock_request_and_latest(uow, "req-none", "job-11")
        assert latest is not None and latest.checkpoint == checkpoint(11, 9)
        assert sent.count == 5  # the catalogue write, then the database's new latest

        # What the batch did not cover is read from the database.
        thirteen = await store.lock_saga(uow, "saga-13")
        assert thirteen is not None and thirteen.job_id == "job-13"
        assert sent.count == 6
        await uow.commit()

    async with rt.uow() as uow:
        assert await store.get_saga(uow, "saga-11") == ended
        assert await store.get_saga(uow, successor.saga_id) == successor


async def test_a_job_naming_another_jobs_request_in_a_batch_neither_locks_nor_reads_its_saga(
    rt: ServiceRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job's checkpoint answer names a request id of its choosing: the batch locks the
    saga of that request only if it is the job's, as `lock_live_by_job` reads it."""
    await stored(rt, opened(21), opened(22))
    async with rt.uow() as uow:
        sent = Statements(uow, monkeypatch)
        await store.lock_for_batch(
            uow, live_jobs={"job-21"}, job_requests={("job-21", "req-22"), ("job-21", "req-21")}
        )
        # The other job's saga is free for another transaction.
        async with rt.uow() as other:
            assert await other.fetch(
                "SELECT 1 FROM checkpoint.sagas WHERE saga_id = 'saga-22' FOR UPDATE NOWAIT"
            )
            await other.commit()
        twenty_one = await store.lock_saga(uow, "saga-21")
        assert twenty_one is not None
        assert await store.lock_live_by_job(uow, "job-21", "req-22") == [twenty_one]
        assert await store.lock_live_by_job(uow, "job-21", "req-21") == [twenty_one]
        assert sent.count == 1
