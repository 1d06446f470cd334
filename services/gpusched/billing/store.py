"""Billing's SQL on its own schema: the append-only usage ledger and credits.

Nothing here updates or deletes a ledger row (the schema refuses it too): an
allocation's interval is the pair of its `opened` and `closed` rows, and it is open
while the `closed` row is missing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from enum import StrEnum
from typing import Any

from gpusched.infra.db import UnitOfWork


class UsageEvent(StrEnum):
    OPENED = "opened"
    CLOSED = "closed"


@dataclass(frozen=True, kw_only=True)
class AllocationUsage:
    """What one allocation held, from its opening to its closing (None: still open)."""

    allocation_id: str
    team: str
    job_id: str
    kind: str
    gpu_milli: dict[str, int]  # thousandths of a GPU, by GPU model
    cpu_cores: Decimal
    memory_gb: Decimal
    disk_gb: Decimal
    opened_at: datetime
    closed_at: datetime | None

    @property
    def main_gpu_model(self) -> str:
        """The model most of its GPUs are, or "" for an allocation without GPUs."""
        if not self.gpu_milli:
            return ""
        return min(self.gpu_milli, key=lambda model: (-self.gpu_milli[model], model))


@dataclass(frozen=True, kw_only=True)
class CreditRecord:
    saga_id: str
    allocation_id: str
    team: str
    job_id: str
    gpu_model: str
    lost_gpu_seconds: Decimal
    at: datetime


async def record_opened(
    uow: UnitOfWork,
    *,
    allocation_id: str,
    at: datetime,
    team: str,
    job_id: str,
    kind: str,
    gpu_milli: dict[str, int],
    cpu_cores: Decimal,
    memory_gb: Decimal,
    disk_gb: Decimal,
    message_id: str,
) -> bool:
    """Append the opening of an allocation; False if it was already recorded."""
    result = await uow.execute(
        f"INSERT INTO {uow.schema}.usage_events (allocation_id, event, at, team, job_id, kind, "
        "gpu_milli, cpu_cores, memory_gb, disk_gb, message_id) "
        "VALUES (:a, :e, :at, :team, :job, :kind, CAST(:gpus AS jsonb), :cpu, :mem, :disk, :m) "
        "ON CONFLICT (allocation_id, event) DO NOTHING RETURNING seq",
        {
            "a": allocation_id,
            "e": UsageEvent.OPENED.value,
            "at": at,
            "team": team,
            "job": job_id,
            "kind": kind,
            "gpus": json.dumps(gpu_milli, sort_keys=True),
            "cpu": cpu_cores,
            "mem": memory_gb,
            "disk": disk_gb,
            "m": message_id,
        },
    )
    return result.first() is not None


async def record_closed(
    uow: UnitOfWork, *, allocation_id: str, at: datetime, team: str, job_id: str, message_id: str
) -> bool:
    """Append the closing of an allocation; False if it was already recorded."""
    result = await uow.execute(
        f"INSERT INTO {uow.schema}.usage_events (allocation_id, event, at, team, job_id, "
        "message_id) VALUES (:a, :e, :at, :team, :job, :m) "
        "ON CONFLICT (allocation_id, event) DO NOTHING RETURNING seq",
        {
            "a": allocation_id,
            "e": UsageEvent.CLOSED.value,
            "at": at,
            "team": team,
            "job": job_id,
            "m": message_id,
        },
    )
    return result.first() is not None


_USAGE_SELECT = (
    "SELECT o.allocation_id, o.team, o.job_id, o.kind, o.gpu_milli::text AS gpu_milli, "
    "o.cpu_cores, o.memory_gb, o.disk_gb, o.at AS opened_at, c.at AS closed_at "
    "FROM {schema}.usage_events o LEFT JOIN {schema}.usage_events c "
    "ON c.allocation_id = o.allocation_id AND c.event = :closed "
    "WHERE o.event = :opened "
)
_EVENTS = {"opened": UsageEvent.OPENED.value, "closed": UsageEvent.CLOSED.value}


async def find_allocation(uow: UnitOfWork, allocation_id: str) -> AllocationUsage | None:
    result = await uow.execute(
        _USAGE_SELECT.format(schema=uow.schema) + "AND o.allocation_id = :a",
        {"a": allocation_id, **_EVENTS},
    )
    row = result.first()
    return None if row is None else _usage(row)


async def usage_between(
    uow: UnitOfWork, start: datetime, end: datetime, team: str | None
) -> list[AllocationUsage]:
    """Allocations whose interval touches [start, end]; the pricing clips them exactly."""
    result = await uow.execute(
        _USAGE_SELECT.format(schema=uow.schema)
        + "AND o.at <= :end AND (c.at IS NULL OR c.at >= :start) "
        "AND (CAST(:team AS text) IS NULL OR o.team = :team) ORDER BY o.at, o.allocation_id",
        {"start": start, "end": end, "team": team, **_EVENTS},
    )
    return [_usage(row) for row in result]


async def record_credit(uow: UnitOfWork, credit: CreditRecord, *, message_id: str) -> bool:
    """Append a credit; False if this saga was already credited."""
    result = await uow.execute(
        f"INSERT INTO {uow.schema}.credits (saga_id, allocation_id, team, job_id, gpu_model, "
        "lost_gpu_seconds, at, message_id) VALUES (:s, :a, :team, :job, :model, :lost, :at, :m) "
        "ON CONFLICT (saga_id) DO NOTHING RETURNING seq",
        {
            "s": credit.saga_id,
            "a": credit.allocation_id,
            "team": credit.team,
            "job": credit.job_id,
            "model": credit.gpu_model,
            "lost": credit.lost_gpu_seconds,
            "at": credit.at,
            "m": message_id,
        },
    )
    return result.first() is not None


async def credits_between(
    uow: UnitOfWork, start: datetime, end: datetime, team: str | None
) -> list[CreditRecord]:
    result = await uow.execute(
        "SELECT saga_id, allocation_id, team, job_id, gpu_model, lost_gpu_seconds, at "
        f"FROM {uow.schema}.credits WHERE at >= :start AND at < :end "
        "AND (CAST(:team AS text) IS NULL OR team = :team) ORDER BY at, saga_id",
        {"start": start, "end": end, "team": team},
    )
    return [_credit(row) for row in result]


async def first_activity(uow: UnitOfWork, team: str | None) -> datetime | None:
    """When the first usage or credit on record began (for a team, or anyone)."""
    result = await uow.execute(
        "SELECT min(at) AS first FROM ("
        f"SELECT at FROM {uow.schema}.usage_events WHERE event = :opened "
        "AND (CAST(:team AS text) IS NULL OR team = :team) "
        f"UNION ALL SELECT at FROM {uow.schema}.credits "
        "WHERE (CAST(:team AS text) IS NULL OR team = :team)) AS activity",
        {"team": team, "opened": UsageEvent.OPENED.value},
    )
    first: datetime | None = result.scalar_one()
    return first


def _usage(row: Any) -> AllocationUsage:
    return AllocationUsage(
        allocation_id=row.allocation_id,
        team=row.team,
        job_id=row.job_id,
        kind=row.kind,
        gpu_milli={str(k): int(v) for k, v in json.loads(row.gpu_milli).items()},
        cpu_cores=row.cpu_cores,
        memory_gb=row.memory_gb,
        disk_gb=row.disk_gb,
        opened_at=row.opened_at,
        closed_at=row.closed_at,
    )


async def usage_of_job(uow: UnitOfWork, job_id: str) -> list[AllocationUsage]:
    """Every allocation a job held, oldest first."""
    result = await uow.execute(
        _USAGE_SELECT.format(schema=uow.schema)
        + "AND o.job_id = :job ORDER BY o.at, o.allocation_id",
        {"job": job_id, **_EVENTS},
    )
    return [_usage(row) for row in result]


async def credits_of_job(uow: UnitOfWork, job_id: str) -> list[CreditRecord]:
    result = await uow.execute(
        "SELECT saga_id, allocation_id, team, job_id, gpu_model, lost_gpu_seconds, at "
        f"FROM {uow.schema}.credits WHERE job_id = :job ORDER BY at, saga_id",
        {"job": job_id},
    )
    return [_credit(row) for row in result]


def _credit(row: Any) -> CreditRecord:
    return CreditRecord(
        saga_id=row.saga_id,
        allocation_id=row.allocation_id,
        team=row.team,
        job_id=row.job_id,
        gpu_model=row.gpu_model,
        lost_gpu_seconds=row.lost_gpu_seconds,
        at=row.at,
    )
