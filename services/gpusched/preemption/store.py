"""Preemption's SQL on its own schema: projections, decisions, evictions, timers."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import ValidationError

from gpusched.contracts.messages import AllocationGranted, PoolSnapshot
from gpusched.contracts.messages import GpuRef as WireGpuRef
from gpusched.domain.elastic import PriorityClass, VictimCandidate
from gpusched.domain.inventory import GpuRef, Pool
from gpusched.infra import tracing
from gpusched.infra.db import UnitOfWork
from gpusched.preemption.inputs import InputKind, SkippedInput
from gpusched.preemption.policy import LentReservation
from gpusched.preemption.signals import HeldSignals

log = logging.getLogger(__name__)


class DecisionKind(StrEnum):
    EXPAND = "expand"
    SHRINK = "shrink"


class DecisionStatus(StrEnum):
    IN_FLIGHT = "in_flight"  # the migration's one-in-flight index names this value
    DONE = "done"


class EvictionStatus(StrEnum):
    REQUESTED = "requested"
    COMPLETED = "completed"
    ABORTED = "aborted"
    CANCELLED = "cancelled"
    FORCED = "forced"


@dataclass(frozen=True, slots=True)
class ControllerRow:
    last_change_at: datetime | None
    last_shortfall_at: datetime | None
    held: HeldSignals
    # The newest pool snapshot as it came off the wire, and its message id.
    reading: PoolSnapshot | None
    reading_id: str | None
    # Why the stored reading could not be read (it is then None), if it could not.
    unreadable: str | None = None


@dataclass(frozen=True, slots=True)
class EvictionRow:
    request_id: str
    decision_id: str
    allocation_id: str
    gpus: int
    status: EvictionStatus
    reservation_id: str | None


# --- controller timers -------------------------------------------------------------------
async def lock_controller(uow: UnitOfWork) -> ControllerRow:
    """Every decision takes this row lock first, so replicas decide one at a time."""
    row = (
        await uow.execute(
            "SELECT last_change_at, last_shortfall_at, reading, reading_id, reading_at, "
            f"expand_since, shrink_since FROM {uow.schema}.controller WHERE id = 1 FOR UPDATE"
        )
    ).one()
    reading, unreadable = None, None
    if row.reading is not None:
        try:
            reading = PoolSnapshot.model_validate(row.reading)
        except ValidationError as exc:
            # Stored by another version, or damaged: the controller waits for the next
            # snapshot (which replaces it) instead of failing every round on it.
            unreadable = f"stored reading {row.reading_id} unreadable: {exc.errors()[0]['msg']}"
    return ControllerRow(
        row.last_change_at,
        row.last_shortfall_at,
        HeldSignals(row.reading_at, row.expand_since, row.shrink_since),
        reading,
        None if reading is None else row.reading_id,
        unreadable,
    )


async def record_reading(
    uow: UnitOfWork, snapshot_id: str, snapshot: PoolSnapshot, held: HeldSignals
) -> None:
    await uow.execute(
        f"UPDATE {uow.schema}.controller SET reading = CAST(:r AS jsonb), reading_id = :id, "
        "reading_at = :at, expand_since = :e, shrink_since = :s",
        {
            "r": snapshot.model_dump_json(),
            "id": snapshot_id,
            "at": held.reading_at,
            "e": held.expand_since,
            "s": held.shrink_since,
        },
    )


async def record_change(uow: UnitOfWork, at: datetime) -> None:
    # A pool change ends every window: the next one must hold on the changed pool.
    await uow.execute(
        f"UPDATE {uow.schema}.controller SET last_change_at = :t, expand_since = NULL, "
        "shrink_since = NULL",
        {"t": at},
    )


async def record_shortfall(uow: UnitOfWork, at: datetime) -> None:
    await uow.execute(f"UPDATE {uow.schema}.controller SET last_shortfall_at = :t", {"t": at})


async def recent_evictions(uow: UnitOfWork, since: datetime) -> int:
    result = await uow.execute(
        f"SELECT count(*) FROM {uow.schema}.evictions WHERE requested_at > :t", {"t": since}
    )
    return int(result.scalar_one())


# --- allocations projection --------------------------------------------------------------
async def add_allocation(uow: UnitOfWork, granted: AllocationGranted) -> None:
    await uow.execute(
        f"INSERT INTO {uow.schema}.allocations (allocation_id, job_id, team, kind, "
        "priority_class, pool, gpu_refs, gpus, checkpointable, started_at, borrowed, trace, "
        "share_milli, mig) "
        "VALUES (:a, :j, :team, :kind, :pc, :pool, CAST(:refs AS jsonb), :gpus, :ckpt, "
        ":started, :borrowed, CAST(:trace AS jsonb), :milli, :mig) "
        "ON CONFLICT (allocation_id) DO NOTHING",
        {
            "a": granted.allocation_id,
            "j": granted.job_id,
            "team": granted.team,
            "kind": granted.kind,
            "pc": granted.priority_class,
            "pool": granted.pool,
            "refs": json.dumps([[g.node, g.index] for g in granted.gpus]),
            # Whole GPUs held; 0 for a fraction or MIG slice of one GPU (see _candidate).
            "gpus": 0 if granted.share is not None else len(granted.gpus),
            "ckpt": granted.checkpointable,
            # The grant's time: a resumed job's new allocation starts a new min runtime.
            "started": granted.granted_at,
            "borrowed": granted.borrowed,
            # The consumer's span continues the grant's trace, which began at submit.
            "trace": json.dumps(tracing.inject()),
            "milli": None if granted.share is None else granted.share.milli,
            "mig": granted.share is not None and granted.share.mig_profile is not None,
        },
    )


async def allocation_trace(uow: UnitOfWork, allocation_id: str) -> dict[str, str] | None:
    row = (
        await uow.execute(
            f"SELECT trace FROM {uow.schema}.allocations WHERE allocation_id = :a",
            {"a": allocation_id},
        )
    ).first()
    return dict(row.trace) if row is not None and row.trace else None


async def remove_allocation(uow: UnitOfWork, allocation_id: str) -> None:
    await uow.execute(
        f"DELETE FROM {uow.schema}.allocations WHERE allocation_id = :a", {"a": allocation_id}
    )


async def record_checkpoint(uow: UnitOfWork, job_id: str, at: datetime) -> None:
    await uow.execute(
        f"UPDATE {uow.schema}.allocations SET last_checkpoint_at = "
        "GREATEST(COALESCE(last_checkpoint_at, :t), :t) WHERE job_id = :j",
        {"j": job_id, "t": at},
    )


async def shared_allocated_gpus(uow: UnitOfWork) -> int:
    # A GPU shared by fractional tenants counts once, however many tenants it has: it is
    # not idle, and it is never lent.
    result = await uow.execute(
        f"SELECT COALESCE(sum(gpus), 0) + (SELECT count(DISTINCT gpu_refs) FROM "
        f"{uow.schema}.allocations WHERE pool = :p AND gpus = 0) "
        f"FROM {uow.schema}.allocations WHERE pool = :p",
        {"p": Pool.SHARED},
    )
    return int(result.scalar_one())


@dataclass(frozen=True, slots=True)
class Candidates:
    usable: tuple[VictimCandidate, ...]
    # Rows that could not be read as a candidate: left out of the choice, reported.
    skipped: tuple[SkippedInput, ...] = ()


async def candidates(uow: UnitOfWork) -> Candidates:
    """Live allocations not already being evicted. A row that cannot be read (a class
    or pool this version does not know, broken GPU refs) is left out, not fatal: one
    bad row must not stop every victim choice."""
    s = uow.schema
    rows = await uow.execute(
        f"SELECT * FROM {s}.allocations a WHERE NOT EXISTS (SELECT 1 FROM {s}.evictions e "
        "WHERE e.allocation_id = a.allocation_id AND e.status = :requested) "
        "ORDER BY allocation_id",
        {"requested": EvictionStatus.REQUESTED},
    )
    usable: list[VictimCandidate] = []
    skipped: list[SkippedInput] = []
    # Every allocation on a GPU in sharing counts as its tenant, those being evicted too:
    # a GPU frees only when all of them are victims together.
    tenants = await _tenants(uow)
    for row in rows:
        mapping = row._mapping
        try:
            candidate = _candidate(mapping, tenants)
        except (KeyError, TypeError, ValueError) as exc:
            key = str(mapping.get("allocation_id", "?"))
            why = f"unreadable allocation row: {type(exc).__name__}: {exc}"
            skipped.append(SkippedInput(InputKind.ALLOCATION, key, why))
            continue
        if candidate is not None:
            usable.append(candidate)
    return Candidates(tuple(usable), tuple(skipped))


_POOLS = frozenset(pool.value for pool in Pool)


async def _tenants(uow: UnitOfWork) -> dict[GpuRef, int]:
    """How many allocations share each GPU in sharing (fractions and MIG slices)."""
    rows = await uow.execute(
        f"SELECT gpu_refs -> 0 ->> 0 AS node, (gpu_refs -> 0 ->> 1)::int AS idx, "
        f"count(*) AS n FROM {uow.schema}.allocations "
        "WHERE gpus = 0 AND jsonb_array_length(gpu_refs) > 0 GROUP BY 1, 2"
    )
    return {GpuRef(row.node, row.idx): int(row.n) for row in rows}


def _candidate(row: Mapping[str, Any], tenants: Mapping[GpuRef, int]) -> VictimCandidate | None:
    refs = tuple(GpuRef(node, index) for node, index in row["gpu_refs"])
    if not refs or row["pool"] not in _POOLS:
        return None  # no GPUs to free, or a pool this version does not know
    share = 1.0
    if row["gpus"] == 0:
        # A share of one GPU: a victim only with every other tenant of it (the victim
        # choice's units). A MIG slice, or a share written before shares were kept, is
        # never one: its GPU is not lent (admission.lending).
        if row["mig"] or row["share_milli"] is None:
            return None
        share = min(1.0, row["share_milli"] / 1000)
    return VictimCandidate(
        row["allocation_id"],
        row["job_id"],
        row["team"],
        PriorityClass(row["priority_class"]),
        len(refs),
        refs,
        row["started_at"],
        row["last_checkpoint_at"],
        row["checkpointable"],
        pool=Pool(row["pool"]),
        borrowed=row["borrowed"],
        share=share,
        tenants=tenants.get(refs[0], 1) if row["gpus"] == 0 else 1,
    )


# --- lent GPUs projection ----------------------------------------------------------------
def _unnest(gpus: Iterable[WireGpuRef]) -> dict[str, list[Any]]:
    # A GPU may be listed twice (in `gpus` and in `pending`); one row each.
    refs = list(dict.fromkeys((g.node, g.index) for g in gpus))
    return {"nodes": [node for node, _ in refs], "idx": [index for _, index in refs]}


async def lend(uow: UnitOfWork, reservation_id: str, gpus: Iterable[WireGpuRef]) -> None:
    await uow.execute(
        f"INSERT INTO {uow.schema}.lent_gpus (node, idx, reservation_id) "
        "SELECT n.node, n.idx, :r FROM unnest(CAST(:nodes AS text[]), CAST(:idx AS int[])) "
        "AS n(node, idx) "
        "ON CONFLICT (node, idx) DO UPDATE SET reservation_id = EXCLUDED.reservation_id",
        {"r": reservation_id, **_unnest(gpus)},
    )


async def unlend(uow: UnitOfWork, gpus: Iterable[WireGpuRef]) -> None:
    await uow.execute(
        f"DELETE FROM {uow.schema}.lent_gpus g USING "
        "unnest(CAST(:nodes AS text[]), CAST(:idx AS int[])) AS n(node, idx) "
        "WHERE n.node = g.node AND n.idx = g.idx",
        _unnest(gpus),
    )


async def reservations(uow: UnitOfWork) -> tuple[LentReservation, ...]:
    rows = await uow.execute(
        f"SELECT reservation_id, count(*) AS gpus, max(lent_at) AS lent_at "
        f"FROM {uow.schema}.lent_gpus GROUP BY reservation_id "
        "ORDER BY max(lent_at) DESC, reservation_id"
    )
    return tuple(LentReservation(r.reservation_id, int(r.gpus), r.lent_at) for r in rows)


# --- decisions and evictions -------------------------------------------------------------
async def decision_in_flight(uow: UnitOfWork) -> bool:
    result = await uow.execute(
        f"SELECT 1 FROM {uow.schema}.decisions WHERE status = :s LIMIT 1",
        {"s": DecisionStatus.IN_FLIGHT},
    )
    return result.first() is not None


async def add_decision(
    uow: UnitOfWork,
    *,
    decision_id: str,
    kind: DecisionKind,
    time: datetime,
    reservation_id: str | None,
    inputs: Mapping[str, Any],
    need: int,
    victims: Sequence[str],
    status: DecisionStatus,
) -> None:
    await uow.execute(
        f"INSERT INTO {uow.schema}.decisions (decision_id, kind, time, reservation_id, inputs, "
        "need, victims, status, finished_at) VALUES (:d, :kind, :t, :r, CAST(:inputs AS jsonb), "
        ":need, CAST(:victims AS jsonb), :status, :finished)",
        {
            "d": decision_id,
            "kind": kind,
            "t": time,
            "r": reservation_id,
            "inputs": json.dumps(inputs, default=str),
            "need": need,
            "victims": json.dumps(list(victims)),
            "status": status,
            "finished": time if status is DecisionStatus.DONE else None,
        },
    )


async def add_victims(uow: UnitOfWork, decision_id: str, victims: Sequence[str]) -> None:
    await uow.execute(
        f"UPDATE {uow.schema}.decisions SET victims = victims || CAST(:v AS jsonb) "
        "WHERE decision_id = :d",
        {"d": decision_id, "v": json.dumps(list(victims))},
    )


async def finish_decision(uow: UnitOfWork, decision_id: str, at: datetime) -> None:
    await uow.execute(
        f"UPDATE {uow.schema}.decisions SET status = :s, finished_at = :t WHERE decision_id = :d",
        {"s": DecisionStatus.DONE, "t": at, "d": decision_id},
    )


async def add_eviction(
    uow: UnitOfWork,
    *,
    request_id: str,
    decision_id: str,
    allocation_id: str,
    gpus: int,
    requested_at: datetime,
    replaces: str | None = None,
) -> None:
    await uow.execute(
        f"INSERT INTO {uow.schema}.evictions (request_id, decision_id, allocation_id, gpus, "
        "status, replaces, requested_at) VALUES (:r, :d, :a, :g, :s, :rep, :t)",
        {
            "r": request_id,
            "d": decision_id,
            "a": allocation_id,
            "g": gpus,
            "s": EvictionStatus.REQUESTED,
            "rep": replaces,
            "t": requested_at,
        },
    )


async def eviction(uow: UnitOfWork, request_id: str) -> EvictionRow | None:
    s = uow.schema
    row = (
        await uow.execute(
            f"SELECT e.request_id, e.decision_id, e.allocation_id, e.gpus, e.status, "
            f"d.reservation_id FROM {s}.evictions e JOIN {s}.decisions d USING (decision_id) "
            "WHERE e.request_id = :r",
            {"r": request_id},
        )
    ).first()
    if row is None:
        return None
    return EvictionRow(
        row.request_id,
        row.decision_id,
        row.allocation_id,
        row.gpus,
        EvictionStatus(row.status),
        row.reservation_id,
    )


async def finish_eviction(
    uow: UnitOfWork, request_id: str, status: EvictionStatus, at: datetime
) -> None:
    await uow.execute(
        f"UPDATE {uow.schema}.evictions SET status = :s, finished_at = :t WHERE request_id = :r",
        {"s": status, "t": at, "r": request_id},
    )


async def open_evictions(uow: UnitOfWork, decision_id: str) -> int:
    result = await uow.execute(
        f"SELECT count(*) FROM {uow.schema}.evictions WHERE decision_id = :d AND status = :s",
        {"d": decision_id, "s": EvictionStatus.REQUESTED},
    )
    return int(result.scalar_one())


async def tried_allocations(uow: UnitOfWork, decision_id: str) -> list[str]:
    rows = await uow.execute(
        f"SELECT allocation_id FROM {uow.schema}.evictions WHERE decision_id = :d",
        {"d": decision_id},
    )
    return [r.allocation_id for r in rows]


async def withdrawable_evictions(uow: UnitOfWork) -> tuple[str, ...]:
    """Open evictions of the decision in flight that were not asked to cancel yet."""
    rows = await uow.execute(
        f"SELECT request_id FROM {uow.schema}.evictions "
        "WHERE status = :s AND withdrawn_at IS NULL ORDER BY requested_at, request_id",
        {"s": EvictionStatus.REQUESTED},
    )
    return tuple(r.request_id for r in rows)


async def mark_withdrawn(uow: UnitOfWork, request_ids: Sequence[str], at: datetime) -> None:
    await uow.execute(
        f"UPDATE {uow.schema}.evictions SET withdrawn_at = :t WHERE request_id = ANY(:r)",
        {"t": at, "r": list(request_ids)},
    )


async def replace_islands(uow: UnitOfWork, nodes: Iterable[tuple[str, list[list[int]]]]) -> None:
    """The islands of the listed nodes, as admission's inventory states them: two
    statements whatever the number of nodes (an inventory of 10,000 nodes is 80,000
    rows)."""
    names: list[str] = []
    rows: tuple[list[str], list[int], list[str]] = ([], [], [])
    for node, groups in nodes:
        names.append(node)
        for number, group in enumerate(groups):
            for index in group:
                rows[0].append(node)
                rows[1].append(index)
                rows[2].append(f"{node}/{number}")
    if not names:
        return
    await uow.execute(
        f"DELETE FROM {uow.schema}.gpu_islands WHERE node = ANY(CAST(:nodes AS text[]))",
        {"nodes": names},
    )
    if rows[0]:
        await uow.execute(
            f"INSERT INTO {uow.schema}.gpu_islands (node, gpu_index, island) "
            "SELECT * FROM unnest(CAST(:n AS text[]), CAST(:i AS int[]), CAST(:island AS text[]))",
            {"n": rows[0], "i": rows[1], "island": rows[2]},
        )


async def islands(uow: UnitOfWork) -> dict[GpuRef, str]:
    rows = await uow.execute(f"SELECT node, gpu_index, island FROM {uow.schema}.gpu_islands")
    return {GpuRef(r.node, r.gpu_index): r.island for r in rows}
