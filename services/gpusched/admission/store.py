"""The admission schema's SQL. Only this service reads or writes these tables."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import text

from gpusched.contracts.messages import CheckpointInfo, SubmitJob
from gpusched.domain.inventory import GpuRef, GpuSpec, Inventory, NodeSpec, Pool
from gpusched.domain.ledger import Allocation, GpuSlot, JobKind, Ledger, PriorityClass
from gpusched.infra import tracing
from gpusched.infra.db import UnitOfWork

from .queue import EvictionOutcome, JobState


@dataclass(frozen=True, slots=True)
class JobRecord:
    job_id: str
    spec: SubmitJob
    state: JobState
    attempt: int
    allocation_id: str | None
    resume_from: CheckpointInfo | None
    submitted_at: datetime
    warnings: tuple[str, ...]
    wait_audited: bool
    trace: dict[str, str]

    @property
    def kind(self) -> JobKind:
        return JobKind(self.spec.kind.value)

    @property
    def priority_class(self) -> PriorityClass:
        return PriorityClass(self.spec.priority_class.value)


@dataclass(frozen=True, slots=True)
class AllocationRecord:
    allocation: Allocation
    attempt: int
    released_at: datetime | None
    release_reason: str | None
    eviction_outcome: EvictionOutcome | None

    @property
    def live(self) -> bool:
        return self.released_at is None


@dataclass(frozen=True, slots=True)
class QueueProbe:
    queued: int
    unexamined: int  # queued jobs no scheduling pass has looked at since they were queued
    ledger_version: int


def _t(uow: UnitOfWork, table: str) -> str:
    return f"{uow.schema}.{table}"


async def _execute_many(uow: UnitOfWork, sql: str, rows: Sequence[Mapping[str, Any]]) -> None:
    if rows:
        await uow.conn.execute(text(sql), [dict(row) for row in rows])


# --- the ledger's row lock and version ------------------------------------------------


async def lock_ledger(uow: UnitOfWork) -> int:
    """Take the ledger's row lock until the transaction ends; the committed version."""
    result = await uow.execute(
        f"SELECT version FROM {_t(uow, 'ledger_state')} WHERE id = 1 FOR UPDATE"
    )
    return int(result.scalar_one())


async def set_ledger_version(uow: UnitOfWork, version: int) -> None:
    await uow.execute(
        f"UPDATE {_t(uow, 'ledger_state')} SET version = :v WHERE id = 1", {"v": version}
    )


async def queue_probe(uow: UnitOfWork) -> QueueProbe:
    row = (
        await uow.execute(
            f"SELECT count(*) AS queued, count(*) FILTER (WHERE NOT wait_audited) AS unexamined, "
            f"(SELECT version FROM {_t(uow, 'ledger_state')} WHERE id = 1) AS version "
            f"FROM {_t(uow, 'jobs')} WHERE state = :queued",
            {"queued": JobState.QUEUED},
        )
    ).one()
    return QueueProbe(int(row.queued), int(row.unexamined), int(row.version))


# --- inventory and GPU slots ----------------------------------------------------------


async def has_inventory(uow: UnitOfWork) -> bool:
    result = await uow.execute(f"SELECT EXISTS (SELECT 1 FROM {_t(uow, 'gpus')})")
    return bool(result.scalar_one())


async def save_inventory(uow: UnitOfWork, inventory: Inventory) -> None:
    await _execute_many(
        uow,
        f"INSERT INTO {_t(uow, 'nodes')} (name, pool, cpu_milli, memory_mib, gpu_groups) "
        "VALUES (:name, :pool, :cpu_milli, :memory_mib, CAST(:groups AS jsonb))",
        [
            {
                "name": n.name,
                "pool": n.pool,
                "cpu_milli": n.cpu_milli,
                "memory_mib": n.memory_mib,
                "groups": json.dumps(
                    {
                        "nvlink_islands": [list(g) for g in n.nvlink_islands],
                        "numa": [list(g) for g in n.numa],
                    }
                ),
            }
            for n in inventory.nodes
        ],
    )
    ledger = Ledger.from_inventory(inventory)
    await _execute_many(
        uow,
        f"INSERT INTO {_t(uow, 'gpus')} (node, gpu_index, model, memory_mib, pool, status) "
        "VALUES (:node, :idx, :model, :memory_mib, :pool, :status)",
        [
            {
                "node": slot.ref.node,
                "idx": slot.ref.index,
                "model": slot.model,
                "memory_mib": slot.memory_mib,
                "pool": slot.pool,
                "status": slot.status,
            }
            for slot in ledger.gpus
        ],
    )


async def save_gpus(uow: UnitOfWork, slots: Iterable[GpuSlot]) -> None:
    """Write the live status of these slots (the ledger is the source of the values)."""
    await _execute_many(
        uow,
        f"UPDATE {_t(uow, 'gpus')} SET status = :status, allocation_id = :allocation_id, "
        "reservation_id = :reservation_id WHERE node = :node AND gpu_index = :idx",
        [
            {
                "node": slot.ref.node,
                "idx": slot.ref.index,
                "status": slot.status,
                "allocation_id": slot.allocation_id,
                "reservation_id": slot.reserved_for,
            }
            for slot in slots
        ],
    )


async def load_ledger(uow: UnitOfWork) -> tuple[Inventory, Ledger]:
    """The inventory and the live ledger, rebuilt from the stored rows."""
    nodes = (
        await uow.execute(
            f"SELECT name, pool, cpu_milli, memory_mib, gpu_groups FROM {_t(uow, 'nodes')} "
            "ORDER BY name"
        )
    ).all()
    gpus = (
        await uow.execute(
            f"SELECT node, gpu_index, model, memory_mib, reservation_id FROM {_t(uow, 'gpus')} "
            "ORDER BY node, gpu_index"
        )
    ).all()
    specs: dict[str, list[GpuSpec]] = {}
    reservations: dict[GpuRef, str] = {}
    for row in gpus:
        spec = GpuSpec(row.node, row.gpu_index, row.model, row.memory_mib)
        specs.setdefault(row.node, []).append(spec)
        if row.reservation_id is not None:
            reservations[spec.ref] = row.reservation_id
    inventory = Inventory(
        tuple(
            NodeSpec(
                n.name,
                Pool(n.pool),
                tuple(specs.get(n.name, ())),
                n.cpu_milli,
                n.memory_mib,
                _groups(n.gpu_groups, "nvlink_islands"),
                _groups(n.gpu_groups, "numa"),
            )
            for n in nodes
        )
    )
    live = (
        await uow.execute(
            f"SELECT * FROM {_t(uow, 'allocations')} WHERE released_at IS NULL "
            "ORDER BY granted_at, allocation_id"
        )
    ).all()
    allocations = [_allocation(row) for row in live]
    return inventory, Ledger.restore(inventory, allocations, reservations)


def _groups(stored: Mapping[str, Any], field: str) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(group) for group in stored.get(field, ()))


# --- jobs -------------------------------------------------------------------------------


def _checkpoint(value: Any) -> CheckpointInfo | None:
    return None if value is None else CheckpointInfo.model_validate(value)


def _job(row: Any) -> JobRecord:
    return JobRecord(
        job_id=row.job_id,
        spec=SubmitJob.model_validate(row.spec),
        state=JobState(row.state),
        attempt=row.attempt,
        allocation_id=row.allocation_id,
        resume_from=_checkpoint(row.resume_from),
        submitted_at=row.submitted_at,
        warnings=tuple(row.warnings),
        wait_audited=row.wait_audited,
        trace=dict(row.trace or {}),
    )


async def job_id_for_key(uow: UnitOfWork, team: str, key: str) -> str | None:
    result = await uow.execute(
        f"SELECT job_id FROM {_t(uow, 'jobs')} WHERE team = :team AND idempotency_key = :key",
        {"team": team, "key": key},
    )
    job_id = result.scalar_one_or_none()
    return None if job_id is None else str(job_id)


async def insert_job(
    uow: UnitOfWork,
    job_id: str,
    spec: SubmitJob,
    warnings: Sequence[str],
    now: datetime,
    state: JobState = JobState.QUEUED,
) -> bool:
    """Store a new job (QUEUED, or HELD for approval); False if the team already used
    its idempotency key."""
    result = await uow.execute(
        f"INSERT INTO {_t(uow, 'jobs')} (job_id, name, team, kind, priority_class, spec, state, "
        "idempotency_key, submitted_at, updated_at, warnings, trace) VALUES (:job_id, :name, "
        ":team, :kind, :priority_class, CAST(:spec AS jsonb), :state, :key, :now, :now, "
        "CAST(:warnings AS jsonb), CAST(:trace AS jsonb)) "
        "ON CONFLICT (team, idempotency_key) DO NOTHING "
        "RETURNING job_id",
        {
            "job_id": job_id,
            "name": spec.name,
            "team": spec.team,
            "kind": spec.kind,
            "priority_class": spec.priority_class,
            "spec": spec.model_dump_json(),
            "state": state,
            "key": spec.idempotency_key,
            "now": now,
            "warnings": json.dumps(list(warnings)),
            # The submit request's span: the job's trace starts here.
            "trace": json.dumps(tracing.inject()),
        },
    )
    return result.first() is not None


async def job(uow: UnitOfWork, job_id: str) -> JobRecord | None:
    row = (
        await uow.execute(f"SELECT * FROM {_t(uow, 'jobs')} WHERE job_id = :id", {"id": job_id})
    ).first()
    return None if row is None else _job(row)


async def queued_jobs(uow: UnitOfWork) -> list[JobRecord]:
    """Queued jobs in submission order; the scheduler ranks them by priority class."""
    rows = await uow.execute(
        f"SELECT * FROM {_t(uow, 'jobs')} WHERE state = :queued ORDER BY submitted_at, job_id",
        {"queued": JobState.QUEUED},
    )
    return [_job(row) for row in rows]


async def count_jobs(uow: UnitOfWork) -> int:
    result = await uow.execute(f"SELECT count(*) FROM {_t(uow, 'jobs')}")
    return int(result.scalar_one())


async def mark_waiting(uow: UnitOfWork, job_ids: Sequence[str], now: datetime) -> None:
    if job_ids:
        await uow.execute(
            f"UPDATE {_t(uow, 'jobs')} SET wait_audited = true, updated_at = :now "
            "WHERE job_id = ANY(:ids)",
            {"ids": list(job_ids), "now": now},
        )


async def job_started(
    uow: UnitOfWork,
    job_id: str,
    allocation_id: str,
    attempt: int,
    warnings: Sequence[str],
    now: datetime,
) -> None:
    await uow.execute(
        f"UPDATE {_t(uow, 'jobs')} SET state = :state, allocation_id = :allocation_id, "
        "attempt = :attempt, warnings = CAST(:warnings AS jsonb), wait_audited = false, "
        "updated_at = :now WHERE job_id = :job_id",
        {
            "job_id": job_id,
            "state": JobState.RUNNING,
            "allocation_id": allocation_id,
            "attempt": attempt,
            "warnings": json.dumps(list(warnings)),
            "now": now,
        },
    )


async def set_job_state(uow: UnitOfWork, job_id: str, state: JobState, now: datetime) -> None:
    """Move a job; leaving RUNNING drops its allocation, entering QUEUED re-examines it."""
    await uow.execute(
        f"UPDATE {_t(uow, 'jobs')} SET state = :state, updated_at = :now, "
        "allocation_id = CASE WHEN CAST(:keep_allocation AS boolean) THEN allocation_id END, "
        "wait_audited = CASE WHEN CAST(:reexamine AS boolean) THEN false ELSE wait_audited END "
        "WHERE job_id = :job_id",
        {
            "job_id": job_id,
            "state": state,
            "now": now,
            "keep_allocation": state is JobState.RUNNING,
            "reexamine": state is JobState.QUEUED,
        },
    )


async def set_resume_from(
    uow: UnitOfWork, job_id: str, checkpoint: CheckpointInfo, now: datetime
) -> None:
    await uow.execute(
        f"UPDATE {_t(uow, 'jobs')} SET resume_from = CAST(:checkpoint AS jsonb), "
        "updated_at = :now WHERE job_id = :job_id",
        {"job_id": job_id, "checkpoint": checkpoint.model_dump_json(), "now": now},
    )


# --- allocations ----------------------------------------------------------------------


def _allocation(row: Any) -> Allocation:
    return Allocation(
        allocation_id=row.allocation_id,
        job_id=row.job_id,
        team=row.team,
        kind=JobKind(row.kind),
        priority_class=PriorityClass(row.priority_class),
        gpus=tuple(GpuRef(gpu["node"], gpu["index"]) for gpu in row.gpus),
        granted_at=row.granted_at,
        model=row.model,
        pool=Pool(row.pool),
        borrowed=row.borrowed,
    )


async def insert_allocation(uow: UnitOfWork, allocation: Allocation, attempt: int) -> None:
    await uow.execute(
        f"INSERT INTO {_t(uow, 'allocations')} (allocation_id, job_id, team, kind, "
        "priority_class, model, pool, gpus, attempt, granted_at, borrowed) VALUES "
        "(:allocation_id, :job_id, :team, :kind, :priority_class, :model, :pool, "
        "CAST(:gpus AS jsonb), :attempt, :granted_at, :borrowed)",
        {
            "allocation_id": allocation.allocation_id,
            "job_id": allocation.job_id,
            "team": allocation.team,
            "kind": allocation.kind,
            "priority_class": allocation.priority_class,
            "model": allocation.model,
            "pool": allocation.pool,
            "gpus": json.dumps([{"node": r.node, "index": r.index} for r in allocation.gpus]),
            "attempt": attempt,
            "granted_at": allocation.granted_at,
            "borrowed": allocation.borrowed,
        },
    )


async def allocation(uow: UnitOfWork, allocation_id: str) -> AllocationRecord | None:
    row = (
        await uow.execute(
            f"SELECT * FROM {_t(uow, 'allocations')} WHERE allocation_id = :id",
            {"id": allocation_id},
        )
    ).first()
    if row is None:
        return None
    return AllocationRecord(
        allocation=_allocation(row),
        attempt=row.attempt,
        released_at=row.released_at,
        release_reason=row.release_reason,
        eviction_outcome=None
        if row.eviction_outcome is None
        else EvictionOutcome(row.eviction_outcome),
    )


async def release_allocation(
    uow: UnitOfWork, allocation_id: str, released_at: datetime, reason: str
) -> None:
    await uow.execute(
        f"UPDATE {_t(uow, 'allocations')} SET released_at = :at, release_reason = :reason "
        "WHERE allocation_id = :id",
        {"id": allocation_id, "at": released_at, "reason": reason},
    )


async def record_eviction_outcome(
    uow: UnitOfWork, allocation_id: str, outcome: EvictionOutcome, saga_id: str
) -> None:
    await uow.execute(
        f"UPDATE {_t(uow, 'allocations')} SET eviction_outcome = :outcome, "
        "eviction_saga_id = :saga WHERE allocation_id = :id",
        {"id": allocation_id, "outcome": outcome, "saga": saga_id},
    )


# --- ledger commands (decisions of the preemption service) ----------------------------


async def claim_decision(uow: UnitOfWork, decision_id: str, kind: str, reservation_id: str) -> bool:
    """Record that a decision was applied; False if it already was (sent twice)."""
    result = await uow.execute(
        f"INSERT INTO {_t(uow, 'ledger_commands')} (decision_id, kind, reservation_id) "
        "VALUES (:d, :k, :r) ON CONFLICT DO NOTHING RETURNING decision_id",
        {"d": decision_id, "k": kind, "r": reservation_id},
    )
    return result.first() is not None
