"""The checkpoint service's SQL, on its own schema (nobody else reads it).

A saga is stored whole as `data` (Saga.to_dict()); `state`, `deadline` and the ids are
copies that let PostgreSQL enforce one live saga per allocation and find due deadlines.
Every function that returns a saga for changing it locks its row (FOR UPDATE), so
replicas and this service's own consumers apply inputs to one saga one at a time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from weakref import WeakKeyDictionary

from gpusched.domain.saga import TERMINAL_STATES, CheckpointRef, Saga, SagaState, Stage
from gpusched.infra import tracing
from gpusched.infra.db import UnitOfWork

_TERMINAL = sorted(state.value for state in TERMINAL_STATES)


@dataclass(frozen=True)
class CatalogueEntry:
    checkpoint: CheckpointRef
    confirmed_at: datetime


# The trace of each saga a unit of work read or inserted: the saga's messages carry it,
# and it never changes after the insert, so the SELECT that locks the saga brings it
# along instead of a query of its own per step.
_TRACES: WeakKeyDictionary[UnitOfWork, dict[str, dict[str, str]]] = WeakKeyDictionary()


def _remember_trace(uow: UnitOfWork, saga_id: str, trace: dict[str, str]) -> None:
    _TRACES.setdefault(uow, {})[saga_id] = trace


def _saga(uow: UnitOfWork, row: Any) -> Saga:
    saga = Saga.from_dict(json.loads(row.data))
    _remember_trace(uow, saga.saga_id, json.loads(row.trace) if row.trace else {})
    return saga


def _sagas(uow: UnitOfWork, rows: Any) -> list[Saga]:
    return [_saga(uow, row) for row in rows]


async def insert_saga(uow: UnitOfWork, saga: Saga) -> bool:
    """False if the request is known already or the allocation has a live saga."""
    trace = tracing.inject()
    result = await uow.execute(
        f"INSERT INTO {uow.schema}.sagas (saga_id, request_id, allocation_id, job_id, state, "
        "deadline, data, created_at, updated_at, trace) VALUES (:saga_id, :request_id, "
        ":allocation_id, :job_id, :state, :deadline, CAST(:data AS jsonb), :created_at, "
        ":updated_at, CAST(:trace AS jsonb)) ON CONFLICT DO NOTHING RETURNING saga_id",
        {**_columns(saga), "trace": json.dumps(trace)},
    )
    if result.first() is None:
        return False
    _remember_trace(uow, saga.saga_id, trace)
    return True


async def saga_trace(uow: UnitOfWork, saga_id: str) -> dict[str, str] | None:
    known = _TRACES.get(uow, {}).get(saga_id)
    if known is not None:
        return dict(known) if known else None
    row = (
        await uow.execute(
            f"SELECT trace FROM {uow.schema}.sagas WHERE saga_id = :id", {"id": saga_id}
        )
    ).first()
    return dict(row.trace) if row is not None and row.trace else None


async def save_saga(uow: UnitOfWork, saga: Saga) -> None:
    await uow.execute(
        f"UPDATE {uow.schema}.sagas SET state = :state, deadline = :deadline, "
        "data = CAST(:data AS jsonb), updated_at = :updated_at WHERE saga_id = :saga_id",
        _columns(saga),
    )


def _columns(saga: Saga) -> dict[str, object]:
    return {
        "saga_id": saga.saga_id,
        "request_id": saga.request_id,
        "allocation_id": saga.allocation_id,
        "job_id": saga.job_id,
        "state": saga.state.value,
        "deadline": saga.deadline,
        "data": json.dumps(saga.to_dict()),
        "created_at": saga.created_at,
        "updated_at": saga.updated_at,
    }


_SELECT = "SELECT data::text AS data, trace::text AS trace FROM {schema}.sagas "


async def lock_saga(uow: UnitOfWork, saga_id: str) -> Saga | None:
    result = await uow.execute(
        _SELECT.format(schema=uow.schema) + "WHERE saga_id = :id FOR UPDATE", {"id": saga_id}
    )
    row = result.first()
    return None if row is None else _saga(uow, row)


async def lock_by_request(uow: UnitOfWork, request_id: str) -> Saga | None:
    result = await uow.execute(
        _SELECT.format(schema=uow.schema) + "WHERE request_id = :r FOR UPDATE", {"r": request_id}
    )
    row = result.first()
    return None if row is None else _saga(uow, row)


async def find_live_by_allocation(uow: UnitOfWork, allocation_id: str) -> Saga | None:
    result = await uow.execute(
        _SELECT.format(schema=uow.schema) + "WHERE allocation_id = :a AND state <> ALL(:terminal)",
        {"a": allocation_id, "terminal": _TERMINAL},
    )
    row = result.first()
    return None if row is None else _saga(uow, row)


async def lock_live_by_allocation(uow: UnitOfWork, allocation_id: str) -> Saga | None:
    result = await uow.execute(
        _SELECT.format(schema=uow.schema)
        + "WHERE allocation_id = :a AND state <> ALL(:terminal) FOR UPDATE",
        {"a": allocation_id, "terminal": _TERMINAL},
    )
    row = result.first()
    return None if row is None else _saga(uow, row)


async def lock_live_by_job(
    uow: UnitOfWork, job_id: str, request_id: str | None = None
) -> list[Saga]:
    """The job's live sagas, and the (maybe ended) saga of `request_id` if it is the
    job's: an answer to a request that arrives after its saga ended is still worth
    an audit record."""
    # Ordered by id so that two transactions locking the same sagas cannot deadlock.
    result = await uow.execute(
        _SELECT.format(schema=uow.schema)
        + "WHERE job_id = :j AND (state <> ALL(:terminal) OR request_id = :r) "
        "ORDER BY saga_id FOR UPDATE",
        {"j": job_id, "terminal": _TERMINAL, "r": request_id},
    )
    return _sagas(uow, result)


async def lock_due(uow: UnitOfWork, now: datetime, limit: int) -> list[Saga]:
    """Sagas waiting for a checkpoint past their deadline, skipping those another
    transaction (a replica's sweeper, or a handler applying a confirmation) holds."""
    result = await uow.execute(
        _SELECT.format(schema=uow.schema)
        + "WHERE state = :state AND deadline <= :now ORDER BY deadline "
        "LIMIT :limit FOR UPDATE SKIP LOCKED",
        {"state": SagaState.CHECKPOINTING.value, "now": now, "limit": limit},
    )
    return _sagas(uow, result)


async def get_saga(uow: UnitOfWork, saga_id: str) -> Saga | None:
    result = await uow.execute(
        _SELECT.format(schema=uow.schema) + "WHERE saga_id = :id", {"id": saga_id}
    )
    row = result.first()
    return None if row is None else _saga(uow, row)


async def current_saga_of_job(uow: UnitOfWork, job_id: str) -> Saga | None:
    """The job's live saga if it has one, else its most recent."""
    result = await uow.execute(
        _SELECT.format(schema=uow.schema)
        + "WHERE job_id = :j ORDER BY (state <> ALL(:terminal)) DESC, created_at DESC LIMIT 1",
        {"j": job_id, "terminal": _TERMINAL},
    )
    row = result.first()
    return None if row is None else _saga(uow, row)


async def count_sagas(uow: UnitOfWork) -> int:
    result = await uow.execute(f"SELECT count(*) AS n FROM {uow.schema}.sagas")
    return int(result.scalar_one())


# --- the checkpoint catalogue ------------------------------------------------------------


async def record_checkpoint(
    uow: UnitOfWork,
    job_id: str,
    request_id: str | None,
    checkpoint: CheckpointRef,
    confirmed_at: datetime,
) -> bool:
    """False if this checkpoint was already confirmed at this stage."""
    result = await uow.execute(
        f"INSERT INTO {uow.schema}.checkpoints (job_id, checkpoint_id, stage, request_id, step, "
        "uri, bytes, sha256, confirmed_at) VALUES (:job_id, :checkpoint_id, :stage, "
        ":request_id, :step, :uri, :bytes, :sha256, :confirmed_at) "
        "ON CONFLICT DO NOTHING RETURNING checkpoint_id",
        {
            "job_id": job_id,
            "request_id": request_id,
            "confirmed_at": confirmed_at,
            **checkpoint.to_dict(),
        },
    )
    return result.first() is not None


async def latest_checkpoint(
    uow: UnitOfWork, job_id: str, min_stage: Stage = Stage.SNAPSHOTTED
) -> CatalogueEntry | None:
    """The highest step of the job; at the same step the most durable stage first."""
    stages = [stage.value for stage in Stage if stage.satisfies(min_stage)]
    result = await uow.execute(
        "SELECT checkpoint_id, step, uri, bytes, sha256, stage, confirmed_at "
        f"FROM {uow.schema}.checkpoints WHERE job_id = :j AND stage = ANY(:stages) "
        "ORDER BY step DESC, (stage = :persisted) DESC, confirmed_at DESC LIMIT 1",
        {"j": job_id, "stages": stages, "persisted": Stage.PERSISTED.value},
    )
    row = result.first()
    if row is None:
        return None
    ref = CheckpointRef(
        checkpoint_id=row.checkpoint_id,
        step=row.step,
        uri=row.uri,
        bytes=row.bytes,
        sha256=row.sha256,
        stage=Stage(row.stage),
    )
    return CatalogueEntry(ref, row.confirmed_at)


async def retire_checkpoints(uow: UnitOfWork, job_id: str, keep: int) -> list[dict[str, object]]:
    """Drop the job's catalogue entries beyond the newest `keep` checkpoints, except any
    that a saga of the job references (the checkpoint an eviction waited for is what
    admission resumes the job from). Returns what was dropped."""
    result = await uow.execute(
        f"""
        WITH newest AS (
            SELECT checkpoint_id FROM {uow.schema}.checkpoints WHERE job_id = :j
            GROUP BY checkpoint_id ORDER BY max(step) DESC, max(confirmed_at) DESC
            LIMIT :keep
        ), referenced AS (
            SELECT data -> 'checkpoint' ->> 'checkpoint_id' AS checkpoint_id
            FROM {uow.schema}.sagas WHERE job_id = :j
            UNION
            SELECT data -> 'last_confirmed' ->> 'checkpoint_id'
            FROM {uow.schema}.sagas WHERE job_id = :j
        )
        DELETE FROM {uow.schema}.checkpoints c WHERE c.job_id = :j
          AND c.checkpoint_id NOT IN (SELECT checkpoint_id FROM newest)
          AND NOT EXISTS (SELECT 1 FROM referenced r WHERE r.checkpoint_id = c.checkpoint_id)
        RETURNING c.checkpoint_id, c.stage, c.step, c.uri
        """,
        {"j": job_id, "keep": keep},
    )
    return [
        {"checkpoint_id": r.checkpoint_id, "stage": r.stage, "step": r.step, "uri": r.uri}
        for r in result
    ]


# --- the jobs' priority classes ----------------------------------------------------------


async def remember_class(uow: UnitOfWork, job_id: str, priority_class: str, at: datetime) -> None:
    await uow.execute(
        f"INSERT INTO {uow.schema}.job_classes (job_id, priority_class, updated_at) "
        "VALUES (:j, :c, :at) ON CONFLICT (job_id) DO UPDATE "
        "SET priority_class = EXCLUDED.priority_class, updated_at = EXCLUDED.updated_at",
        {"j": job_id, "c": priority_class, "at": at},
    )


async def class_of(uow: UnitOfWork, job_id: str) -> str | None:
    """The job's priority class, or None if no grant or eviction of it was seen."""
    result = await uow.execute(
        f"SELECT priority_class FROM {uow.schema}.job_classes WHERE job_id = :j", {"j": job_id}
    )
    row = result.first()
    return None if row is None else str(row.priority_class)
