"""The checkpoint service's SQL, on its own schema (nobody else reads it).

A saga is stored whole as `data` (Saga.to_dict()); `state`, `deadline` and the ids are
copies that let PostgreSQL enforce one live saga per allocation and find due deadlines.
Every function that returns a saga for changing it locks its row (FOR UPDATE), so
replicas and this service's own consumers apply inputs to one saga one at a time.

Each message applies several of these statements, so they go straight to the driver
(`UnitOfWork.fetch`: asyncpg rows, `$1` parameters) rather than through SQLAlchemy.

Round trips are what a saga step costs, so a saved saga is written at commit, with
every other saga the unit of work saved, in one statement (a batch of messages shares
one unit of work). Until then the unit of work holds the newest version; any read that
could return that saga (by its id, request, job or allocation, which never change)
writes the pending ones first, so no statement ever sees a stale saga.

A batch of messages sharing one unit of work can go further (`lock_for_batch`, the
consumer's prepare hook): one statement locks every saga its messages will read and
finds the latest checkpoint of every job they will ask about; the reads below then
answer from those rows (kept current by this unit of work's own saves, inserts and
catalogue writes) instead of a round trip each. A read the batch did not cover goes to
the database as before.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
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


# Sagas saved in a unit of work and not yet written, by id (the newest version of each).
_PENDING: WeakKeyDictionary[UnitOfWork, dict[str, Saga]] = WeakKeyDictionary()


@dataclass
class _Batch:
    """What `lock_for_batch` read for a unit of work, and which questions it answers."""

    sagas: dict[str, Saga] = field(default_factory=dict)  # locked (or inserted), by id
    saga_ids: set[str] = field(default_factory=set)  # found above if they exist
    requests: set[str] = field(default_factory=set)  # the saga of each is above if any
    # (job, request): the request's saga is above if it is the job's.
    job_requests: set[tuple[str, str]] = field(default_factory=set)
    live_jobs: set[str] = field(default_factory=set)  # their live sagas are above
    latest: dict[str, CatalogueEntry | None] = field(default_factory=dict)  # by job

    def by_request(self, request_id: str) -> Saga | None:
        return next((s for s in self.sagas.values() if s.request_id == request_id), None)


_BATCH: WeakKeyDictionary[UnitOfWork, _Batch] = WeakKeyDictionary()


async def lock_for_batch(
    uow: UnitOfWork,
    *,
    saga_ids: Collection[str] = (),
    requests: Collection[str] = (),
    live_jobs: Collection[str] = (),
    job_requests: Collection[tuple[str, str]] = (),
    latest_of: Collection[str] = (),
) -> None:
    """Lock, in one statement, the sagas with these ids, the sagas of these requests,
    the live sagas of these jobs and the saga of each (job, request) if it is that
    job's (a job's answer names a request, but must not lock another job's saga), in
    saga id order as `lock_live_by_job` does, and read the latest checkpoint of the
    jobs in `latest_of`: the reads of this unit of work then answer from them."""
    if not (saga_ids or requests or live_jobs or job_requests or latest_of):
        return
    await _write_pending(uow)
    batch = _BATCH.setdefault(uow, _Batch())
    rows = await uow.fetch(
        f"WITH locked AS ({_SELECT.format(schema=uow.schema)}"
        "WHERE saga_id = ANY($1::text[]) OR request_id = ANY($2::text[]) "
        "OR (job_id = ANY($3::text[]) AND state <> ALL($4::text[])) "
        "OR (job_id, request_id) IN (SELECT * FROM unnest($8::text[], $9::text[])) "
        "ORDER BY saga_id FOR UPDATE) "
        "SELECT data, trace, NULL::text AS job_id, NULL::text AS checkpoint_id, "
        "NULL::bigint AS step, NULL::text AS uri, NULL::bigint AS bytes, "
        "NULL::text AS sha256, NULL::text AS stage, NULL::timestamptz AS confirmed_at "
        "FROM locked UNION ALL SELECT NULL, NULL, j.job_id, latest.* "
        "FROM unnest($5::text[]) AS j(job_id) LEFT JOIN LATERAL "
        f"({_latest_sql(uow.schema, 'j.job_id', 6)}) AS latest ON true",
        list(saga_ids),
        list(requests),
        list(live_jobs),
        _TERMINAL,
        list(latest_of),
        _stages_from(Stage.SNAPSHOTTED),
        Stage.PERSISTED.value,
        [job for job, _ in job_requests],
        [request for _, request in job_requests],
    )
    for row in rows:
        if row["data"] is not None:
            saga = _saga(uow, row)
            batch.sagas[saga.saga_id] = saga
        else:
            batch.latest[row["job_id"]] = _entry(row)
    batch.saga_ids.update(saga_ids)
    batch.requests.update(requests)
    batch.live_jobs.update(live_jobs)
    batch.job_requests.update(job_requests)


async def _write_pending(uow: UnitOfWork, touches: Callable[[Saga], bool] | None = None) -> None:
    """Write the pending sagas if any of them is one `touches` (None: any) may read."""
    pending = _PENDING.get(uow)
    if not pending or (touches is not None and not any(map(touches, pending.values()))):
        return
    sagas = list(pending.values())
    pending.clear()
    # Every row was locked by this transaction when it was read: no new lock, no order.
    await uow.fetch(
        f"UPDATE {uow.schema}.sagas AS s SET state = u.state, deadline = u.deadline, "
        "data = u.data::jsonb, updated_at = u.updated_at FROM unnest($1::text[], $2::text[], "
        "$3::timestamptz[], $4::text[], $5::timestamptz[]) "
        "AS u(saga_id, state, deadline, data, updated_at) WHERE s.saga_id = u.saga_id",
        [saga.saga_id for saga in sagas],
        [saga.state.value for saga in sagas],
        [saga.deadline for saga in sagas],
        [json.dumps(saga.to_dict()) for saga in sagas],
        [saga.updated_at for saga in sagas],
    )


async def insert_saga(
    uow: UnitOfWork, saga: Saga, job_class: tuple[str, datetime, str | None] | None = None
) -> bool:
    """False if the request is known already or the allocation has a live saga.
    `job_class`: the job's priority class, when it was seen and its team, remembered as
    `remember_class` does, in the same statement, whether or not the saga goes in."""
    await _write_pending(
        uow, lambda s: s.request_id == saga.request_id or s.allocation_id == saga.allocation_id
    )
    trace = tracing.inject()
    remember = ""
    args: list[Any] = []
    if job_class is not None:
        # A data-modifying WITH runs whether or not the INSERT below inserts.
        remember = f"WITH remembered AS ({_remember_class_sql(uow.schema, 4, 11, 12, 13)}) "
        args = list(job_class)
    row = await uow.fetchrow(
        f"{remember}INSERT INTO {uow.schema}.sagas (saga_id, request_id, allocation_id, job_id, "
        "state, deadline, data, created_at, updated_at, trace) VALUES ($1, $2, $3, $4, $5, $6, "
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
        *args,
    )
    if row is None:
        return False
    _remember_trace(uow, saga.saga_id, trace)
    if (batch := _BATCH.get(uow)) is not None:
        batch.sagas[saga.saga_id] = saga
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
    """Store the saga's new version (locked by this unit of work): written at commit, or
    before a read that could return it."""
    pending = _PENDING.get(uow)
    if pending is None:
        pending = _PENDING[uow] = {}
        uow.before_commit(lambda: _write_pending(uow))
    pending[saga.saga_id] = saga
    if (batch := _BATCH.get(uow)) is not None and saga.saga_id in batch.sagas:
        batch.sagas[saga.saga_id] = saga


_SELECT = "SELECT data::text AS data, trace::text AS trace FROM {schema}.sagas "


async def _one(
    uow: UnitOfWork, touches: Callable[[Saga], bool] | None, where: str, *args: Any
) -> Saga | None:
    await _write_pending(uow, touches)
    row = await uow.fetchrow(_SELECT.format(schema=uow.schema) + where, *args)
    return None if row is None else _saga(uow, row)


async def lock_saga(uow: UnitOfWork, saga_id: str) -> Saga | None:
    batch = _BATCH.get(uow)
    if batch is not None and (saga_id in batch.sagas or saga_id in batch.saga_ids):
        return batch.sagas.get(saga_id)
    return await _one(uow, lambda s: s.saga_id == saga_id, "WHERE saga_id = $1 FOR UPDATE", saga_id)


async def lock_by_request(uow: UnitOfWork, request_id: str) -> Saga | None:
    if (batch := _BATCH.get(uow)) is not None and request_id in batch.requests:
        return batch.by_request(request_id)
    return await _one(
        uow, lambda s: s.request_id == request_id, "WHERE request_id = $1 FOR UPDATE", request_id
    )


async def lock_request_and_latest(
    uow: UnitOfWork, request_id: str, job_id: str
) -> tuple[Saga | None, CatalogueEntry | None]:
    """`lock_by_request` and `latest_checkpoint` of the job, in one round trip."""
    batch = _BATCH.get(uow)
    if batch is not None and request_id in batch.requests and job_id in batch.latest:
        return batch.by_request(request_id), batch.latest[job_id]
    await _write_pending(uow, lambda s: s.request_id == request_id)
    row = await uow.fetchrow(
        f"WITH saga AS ({_SELECT.format(schema=uow.schema)} WHERE request_id = $1 FOR UPDATE), "
        f"latest AS ({_latest_sql(uow.schema, '$2', 3)}) "
        "SELECT saga.data, saga.trace, latest.* FROM (SELECT 1) AS one "
        "LEFT JOIN saga ON true LEFT JOIN latest ON true",
        request_id,
        job_id,
        _stages_from(Stage.SNAPSHOTTED),
        Stage.PERSISTED.value,
    )
    assert row is not None
    saga = None if row["data"] is None else _saga(uow, row)
    return saga, _entry(row)


async def find_live_by_allocation(uow: UnitOfWork, allocation_id: str) -> Saga | None:
    return await _one(
        uow,
        lambda s: s.allocation_id == allocation_id,
        "WHERE allocation_id = $1 AND state <> ALL($2)",
        allocation_id,
        _TERMINAL,
    )


async def lock_live_by_allocation(uow: UnitOfWork, allocation_id: str) -> Saga | None:
    return await _one(
        uow,
        lambda s: s.allocation_id == allocation_id,
        "WHERE allocation_id = $1 AND state <> ALL($2) FOR UPDATE",
        allocation_id,
        _TERMINAL,
    )


async def lock_live_by_job(
    uow: UnitOfWork, job_id: str, request_id: str | None = None
) -> list[Saga]:
    """The job's live sagas, and the (maybe ended) saga of `request_id` if it is the
    job's: an answer to a request that arrives after its saga ended is still worth
    an audit record."""
    batch = _BATCH.get(uow)
    if (
        batch is not None
        and job_id in batch.live_jobs
        and (
            request_id is None
            or request_id in batch.requests
            or (job_id, request_id) in batch.job_requests
        )
    ):
        return sorted(
            (
                s
                for s in batch.sagas.values()
                if s.job_id == job_id
                and (s.state not in TERMINAL_STATES or s.request_id == request_id)
            ),
            key=lambda s: s.saga_id,
        )
    await _write_pending(uow, lambda s: s.job_id == job_id)
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
    await _write_pending(uow)
    rows = await uow.fetch(
        _SELECT.format(schema=uow.schema)
        + "WHERE state = $1 AND deadline <= $2 ORDER BY deadline LIMIT $3 FOR UPDATE SKIP LOCKED",
        SagaState.CHECKPOINTING.value,
        now,
        limit,
    )
    return _sagas(uow, rows)


async def get_saga(uow: UnitOfWork, saga_id: str) -> Saga | None:
    return await _one(uow, lambda s: s.saga_id == saga_id, "WHERE saga_id = $1", saga_id)


async def current_saga_of_job(uow: UnitOfWork, job_id: str) -> Saga | None:
    """The job's live saga if it has one, else its most recent."""
    return await _one(
        uow,
        lambda s: s.job_id == job_id,
        "WHERE job_id = $1 ORDER BY (state <> ALL($2)) DESC, created_at DESC LIMIT 1",
        job_id,
        _TERMINAL,
    )


async def count_sagas(uow: UnitOfWork) -> int:
    await _write_pending(uow)
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
    if (batch := _BATCH.get(uow)) is not None:
        batch.latest.pop(job_id, None)  # the job's latest may be this one now
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


def _latest_sql(schema: str, job: str, n: int) -> str:
    """The latest checkpoint of the job `job` (an SQL expression) names; parameters $n
    (the stages it may be at) and $n+1 (the most durable stage)."""
    return (
        "SELECT checkpoint_id, step, uri, bytes, sha256, stage, confirmed_at "
        f"FROM {schema}.checkpoints WHERE job_id = {job} AND stage = ANY(${n}) "
        f"ORDER BY step DESC, (stage = ${n + 1}) DESC, confirmed_at DESC LIMIT 1"
    )


def _stages_from(min_stage: Stage) -> list[str]:
    return [stage.value for stage in Stage if stage.satisfies(min_stage)]


async def latest_checkpoint(
    uow: UnitOfWork, job_id: str, min_stage: Stage = Stage.SNAPSHOTTED
) -> CatalogueEntry | None:
    """The highest step of the job; at the same step the most durable stage first."""
    row = await uow.fetchrow(
        _latest_sql(uow.schema, "$1", 2),
        job_id,
        _stages_from(min_stage),
        Stage.PERSISTED.value,
    )
    return None if row is None else _entry(row)


def _entry(row: Any) -> CatalogueEntry | None:
    if row["checkpoint_id"] is None:
        return None  # the LEFT JOIN of `lock_request_and_latest` found none
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
    await _write_pending(uow, lambda s: s.job_id == job_id)
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


def _remember_class_sql(schema: str, job: int, priority_class: int, at: int, team: int) -> str:
    """The upsert of a job's class and team, with the numbers of its four parameters; a
    null team keeps the one known."""
    return (
        f"INSERT INTO {schema}.job_classes (job_id, priority_class, updated_at, team) "
        f"VALUES (${job}, ${priority_class}, ${at}, ${team}) ON CONFLICT (job_id) DO UPDATE "
        "SET priority_class = EXCLUDED.priority_class, updated_at = EXCLUDED.updated_at, "
        f"team = COALESCE(EXCLUDED.team, {schema}.job_classes.team)"
    )


async def remember_class(
    uow: UnitOfWork, job_id: str, priority_class: str, at: datetime, team: str | None = None
) -> None:
    await uow.fetch(_remember_class_sql(uow.schema, 1, 2, 3, 4), job_id, priority_class, at, team)


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
