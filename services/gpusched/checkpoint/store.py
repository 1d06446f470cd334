"""The checkpoint service's SQL, on its own schema (nobody else reads it).

A saga is stored whole as `data` (Saga.to_dict()); `state`, `deadline` and the ids are
copies that let PostgreSQL enforce one live saga per allocation and find due deadlines.
Every function that returns a saga for changing it locks its row (FOR UPDATE), so
replicas and this service's own consumers apply inputs to one saga one at a time.

Each message applies several of these statements, so they go straight to the driver
(`UnitOfWork.fetch`: asyncpg rows, `$1` parameters) rather than through SQLAlchemy.
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


@dataclass(frozen=True)
class CatalogueRow:
    entry: CatalogueEntry
    request_id: str | None  # None: a periodic checkpoint the job took on its own


# The trace of each saga a unit of work read or inserted: the saga's messages carry it,
# and it never changes after the insert, so the SELECT that locks the saga brings it
# along instead of a query of its own per step.
_TRACES: WeakKeyDictionary[UnitOfWork, dict[str, dict[str, str]]] = WeakKeyDictionary()


def _remember_trace(uow: UnitOfWork, saga_id: str, trace: dict[str, str]) -> None:
    _TRACES.setdefault(uow, {})[saga_id] = trace


def _saga(uow: UnitOfWork, row: Any) -> Saga:
    saga = Saga.from_dict(json.loads(row["data"]))
    trace = row["trace"]
    _remember_trace(uow, saga.saga_id, json.loads(trace) if trace else {})
    return saga


def _sagas(uow: UnitOfWork, rows: Any) -> list[Saga]:
    return [_saga(uow, row) for row in rows]


async def insert_saga(uow: UnitOfWork, saga: Saga) -> bool:
    """False if the request is known already or the allocation has a live saga."""
    trace = tracing.inject()
    row = await uow.fetchrow(
        f"INSERT INTO {uow.schema}.sagas (saga_id, request_id, allocation_id, job_id, state, "
        "deadline, data, created_at, updated_at, trace) VALUES ($1, $2, $3, $4, $5, $6, "
        "$7::jsonb, $8, $9, $10::jsonb) ON CONFLICT DO NOTHING RETURNING saga_id",
        saga.saga_id,
        saga.request_id,
        saga.allocation_id,
        saga.job_id,
        saga.state.value,
        saga.deadline,
        json.dumps(saga.to_dict()),
        saga.created_at,
        saga.updated_at,
        json.dumps(trace),
    )
    if row is None:
        return False
    _remember_trace(uow, saga.saga_id, trace)
    return True


async def saga_trace(uow: UnitOfWork, saga_id: str) -> dict[str, str] | None:
    known = _TRACES.get(uow, {}).get(saga_id)
    if known is not None:
        return dict(known) if known else None
    row = await uow.fetchrow(
        f"SELECT trace::text AS trace FROM {uow.schema}.sagas WHERE saga_id = $1", saga_id
    )
    trace: dict[str, str] | None = None if row is None else json.loads(row["trace"] or "null")
    return trace or None


async def save_saga(uow: UnitOfWork, saga: Saga) -> None:
    await uow.fetch(
        f"UPDATE {uow.schema}.sagas SET state = $2, deadline = $3, data = $4::jsonb, "
        "updated_at = $5 WHERE saga_id = $1",
        saga.saga_id,
        saga.state.value,
        saga.deadline,
        json.dumps(saga.to_dict()),
        saga.updated_at,
    )


_SELECT = "SELECT data::text AS data, trace::text AS trace FROM {schema}.sagas "


async def _one(uow: UnitOfWork, where: str, *args: Any) -> Saga | None:
    row = await uow.fetchrow(_SELECT.format(schema=uow.schema) + where, *args)
    return None if row is None else _saga(uow, row)


async def lock_saga(uow: UnitOfWork, saga_id: str) -> Saga | None:
    return await _one(uow, "WHERE saga_id = $1 FOR UPDATE", saga_id)


async def lock_by_request(uow: UnitOfWork, request_id: str) -> Saga | None:
    return await _one(uow, "WHERE request_id = $1 FOR UPDATE", request_id)


async def find_live_by_allocation(uow: UnitOfWork, allocation_id: str) -> Saga | None:
    return await _one(
        uow, "WHERE allocation_id = $1 AND state <> ALL($2)", allocation_id, _TERMINAL
    )


async def lock_live_by_allocation(uow: UnitOfWork, allocation_id: str) -> Saga | None:
    return await _one(
        uow, "WHERE allocation_id = $1 AND state <> ALL($2) FOR UPDATE", allocation_id, _TERMINAL
    )


async def lock_live_by_job(
    uow: UnitOfWork, job_id: str, request_id: str | None = None
) -> list[Saga]:
    """The job's live sagas, and the (maybe ended) saga of `request_id` if it is the
    job's: an answer to a request that arrives after its saga ended is still worth
    an audit record."""
    # Ordered by id so that two transactions locking the same sagas cannot deadlock.
    rows = await uow.fetch(
        _SELECT.format(schema=uow.schema)
        + "WHERE job_id = $1 AND (state <> ALL($2) OR request_id = $3) "
        "ORDER BY saga_id FOR UPDATE",
        job_id,
        _TERMINAL,
        request_id,
    )
    return _sagas(uow, rows)


async def lock_due(uow: UnitOfWork, now: datetime, limit: int) -> list[Saga]:
    """Sagas waiting for a checkpoint past their deadline, skipping those another
    transaction (a replica's sweeper, or a handler applying a confirmation) holds."""
    rows = await uow.fetch(
        _SELECT.format(schema=uow.schema)
        + "WHERE state = $1 AND deadline <= $2 ORDER BY deadline LIMIT $3 FOR UPDATE SKIP LOCKED",
        SagaState.CHECKPOINTING.value,
        now,
        limit,
    )
    return _sagas(uow, rows)


async def get_saga(uow: UnitOfWork, saga_id: str) -> Saga | None:
    return await _one(uow, "WHERE saga_id = $1", saga_id)


async def current_saga_of_job(uow: UnitOfWork, job_id: str) -> Saga | None:
    """The job's live saga if it has one, else its most recent."""
    return await _one(
        uow,
        "WHERE job_id = $1 ORDER BY (state <> ALL($2)) DESC, created_at DESC LIMIT 1",
        job_id,
        _TERMINAL,
    )


async def count_sagas(uow: UnitOfWork) -> int:
    row = await uow.fetchrow(f"SELECT count(*) AS n FROM {uow.schema}.sagas")
    assert row is not None
    return int(row["n"])


# --- the checkpoint catalogue ------------------------------------------------------------


async def record_checkpoint(
    uow: UnitOfWork,
    job_id: str,
    request_id: str | None,
    checkpoint: CheckpointRef,
    confirmed_at: datetime,
) -> int | None:
    """None if this checkpoint was already confirmed at this stage; else how many
    checkpoints of the job the catalogue now holds (so the caller retires old ones only
    when there are more than it keeps, without a statement to find out)."""
    # RETURNING's subquery reads the statement's snapshot, which holds the job's other
    # checkpoints but not this row: count them, and this one.
    row = await uow.fetchrow(
        f"INSERT INTO {uow.schema}.checkpoints (job_id, checkpoint_id, stage, request_id, step, "
        "uri, bytes, sha256, confirmed_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) "
        "ON CONFLICT DO NOTHING RETURNING 1 + (SELECT count(DISTINCT c.checkpoint_id) "
        f"FROM {uow.schema}.checkpoints c WHERE c.job_id = $1 AND c.checkpoint_id <> $2) "
        "AS catalogued",
        job_id,
        checkpoint.checkpoint_id,
        checkpoint.stage.value,
        request_id,
        checkpoint.step,
        checkpoint.uri,
        checkpoint.bytes,
        checkpoint.sha256,
        confirmed_at,
    )
    return None if row is None else int(row["catalogued"])


async def latest_checkpoint(
    uow: UnitOfWork, job_id: str, min_stage: Stage = Stage.SNAPSHOTTED
) -> CatalogueEntry | None:
    """The highest step of the job; at the same step the most durable stage first."""
    stages = [stage.value for stage in Stage if stage.satisfies(min_stage)]
    row = await uow.fetchrow(
        "SELECT checkpoint_id, step, uri, bytes, sha256, stage, confirmed_at "
        f"FROM {uow.schema}.checkpoints WHERE job_id = $1 AND stage = ANY($2) "
        "ORDER BY step DESC, (stage = $3) DESC, confirmed_at DESC LIMIT 1",
        job_id,
        stages,
        Stage.PERSISTED.value,
    )
    if row is None:
        return None
    ref = CheckpointRef(
        checkpoint_id=row["checkpoint_id"],
        step=row["step"],
        uri=row["uri"],
        bytes=row["bytes"],
        sha256=row["sha256"],
        stage=Stage(row["stage"]),
    )
    return CatalogueEntry(ref, row["confirmed_at"])


async def retire_checkpoints(uow: UnitOfWork, job_id: str, keep: int) -> list[dict[str, object]]:
    """Drop the job's catalogue entries beyond the newest `keep` checkpoints, except any
    that a saga of the job references (the checkpoint an eviction waited for is what
    admission resumes the job from). Returns what was dropped."""
    rows = await uow.fetch(
        f"""
        WITH newest AS (
            SELECT checkpoint_id FROM {uow.schema}.checkpoints WHERE job_id = $1
            GROUP BY checkpoint_id ORDER BY max(step) DESC, max(confirmed_at) DESC
            LIMIT $2
        ), referenced AS (
            SELECT data -> 'checkpoint' ->> 'checkpoint_id' AS checkpoint_id
            FROM {uow.schema}.sagas WHERE job_id = $1
            UNION
            SELECT data -> 'last_confirmed' ->> 'checkpoint_id'
            FROM {uow.schema}.sagas WHERE job_id = $1
        )
        DELETE FROM {uow.schema}.checkpoints c WHERE c.job_id = $1
          AND c.checkpoint_id NOT IN (SELECT checkpoint_id FROM newest)
          AND NOT EXISTS (SELECT 1 FROM referenced r WHERE r.checkpoint_id = c.checkpoint_id)
        RETURNING c.checkpoint_id, c.stage, c.step, c.uri
        """,
        job_id,
        keep,
    )
    return [
        {
            "checkpoint_id": r["checkpoint_id"],
            "stage": r["stage"],
            "step": r["step"],
            "uri": r["uri"],
        }
        for r in rows
    ]


# --- the jobs' priority classes ----------------------------------------------------------


async def remember_class(
    uow: UnitOfWork, job_id: str, priority_class: str, at: datetime, team: str | None = None
) -> None:
    await uow.fetch(
        f"INSERT INTO {uow.schema}.job_classes (job_id, priority_class, updated_at, team) "
        "VALUES ($1, $2, $3, $4) ON CONFLICT (job_id) DO UPDATE "
        "SET priority_class = EXCLUDED.priority_class, updated_at = EXCLUDED.updated_at, "
        f"team = COALESCE(EXCLUDED.team, {uow.schema}.job_classes.team)",
        job_id,
        priority_class,
        at,
        team,
    )


async def class_of(uow: UnitOfWork, job_id: str) -> str | None:
    """The job's priority class, or None if no grant or eviction of it was seen."""
    row = await uow.fetchrow(
        f"SELECT priority_class FROM {uow.schema}.job_classes WHERE job_id = $1", job_id
    )
    return None if row is None else str(row["priority_class"])


async def team_of(uow: UnitOfWork, job_id: str) -> str | None:
    """The job's team, or None if no grant or eviction of it was seen since teams are kept."""
    row = await uow.fetchrow(f"SELECT team FROM {uow.schema}.job_classes WHERE job_id = $1", job_id)
    return None if row is None or row["team"] is None else str(row["team"])


# --- a job's history (`<p>.api.checkpoints.history`) -----------------------------------


async def sagas_of_job(uow: UnitOfWork, job_id: str, limit: int) -> list[Saga]:
    """The job's eviction sagas, newest first."""
    rows = await uow.fetch(
        _SELECT.format(schema=uow.schema) + "WHERE job_id = $1 ORDER BY created_at DESC LIMIT $2",
        job_id,
        limit,
    )
    return _sagas(uow, rows)


async def checkpoints_of_job(uow: UnitOfWork, job_id: str, limit: int) -> list[CatalogueRow]:
    """The job's catalogued checkpoints, newest step first (each stage its own row)."""
    rows = await uow.fetch(
        "SELECT checkpoint_id, step, uri, bytes, sha256, stage, request_id, confirmed_at "
        f"FROM {uow.schema}.checkpoints WHERE job_id = $1 "
        "ORDER BY step DESC, confirmed_at DESC LIMIT $2",
        job_id,
        limit,
    )
    return [
        CatalogueRow(
            CatalogueEntry(
                CheckpointRef(
                    checkpoint_id=r["checkpoint_id"],
                    step=r["step"],
                    uri=r["uri"],
                    bytes=r["bytes"],
                    sha256=r["sha256"],
                    stage=Stage(r["stage"]),
                ),
                r["confirmed_at"],
            ),
            r["request_id"],
        )
        for r in rows
    ]
