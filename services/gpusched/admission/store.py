"""The admission schema's SQL. Only this service reads or writes these tables."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import text

from gpusched.contracts.messages import CheckpointInfo, GpuRequest, Replicas, SubmitJob
from gpusched.domain.inventory import GpuRef, GpuSpec, Inventory, NodeSpec, Pool
from gpusched.domain.ledger import (
    Allocation,
    GpuSlot,
    JobKind,
    Ledger,
    NodeCondition,
    PriorityClass,
)
from gpusched.domain.sharing import GpuShare
from gpusched.infra.db import UnitOfWork

from .queue import Ask, EvictionOutcome, JobState, ask_of, models_text, shared_ask
from .reservations import Reservation


@dataclass(frozen=True, slots=True)
class JobRecord:
    """A stored job, as admission holds it.

    Compact on purpose: the in-memory queue holds one per queued job, and each full
    collection of the cyclic garbage collector walks every container object the process
    holds. A parsed request is ~10 such objects (the pydantic models, their field sets,
    the argv list); with 50,000 jobs queued those walks paused the event loop, and so
    every API reply, for 0.4-2 s each, a few times a minute. So the record keeps the
    request as its stored JSON text (``spec`` parses it when asked, for what scheduling
    does not read) and the part scheduling reads as an ``Ask`` shared by every job that
    asks the same: one tracked object per job."""

    job_id: str
    ask: Ask
    spec_json: str
    state: JobState
    attempt: int
    allocation_id: str | None
    resume_from: CheckpointInfo | None
    submitted_at: datetime
    warnings: tuple[str, ...]
    wait_audited: bool
    trace: dict[str, str]
    latest_checkpoint: CheckpointInfo | None = None
    latest_checkpoint_at: datetime | None = None
    replica_target: int | None = None
    replica_seq: int = 0
    replica_failures: int = 0
    replica_restart_at: datetime | None = None
    parked_reason: str | None = None
    cancel_reason: str | None = None

    @classmethod
    def of(
        cls,
        job_id: str,
        spec: SubmitJob,
        state: JobState,
        attempt: int,
        allocation_id: str | None,
        resume_from: CheckpointInfo | None,
        submitted_at: datetime,
        warnings: tuple[str, ...],
        wait_audited: bool,
        trace: dict[str, str],
        **more: Any,
    ) -> JobRecord:
        """A record of a validated request (``more``: the optional fields)."""
        return cls(
            job_id, ask_of(spec), spec.model_dump_json(), state, attempt, allocation_id,
            resume_from, submitted_at, warnings, wait_audited, trace, **more,
        )  # fmt: skip

    def as_row(self) -> JobRow:
        """The record as a flat tuple of plain values, submission time and id first, so
        rows sort as the queue orders jobs; back with ``from_row``. The in-memory queue
        holds its jobs so (see index.QueueIndex): the collector stops tracking a tuple
        that holds only strings, numbers, times and None, but not one holding another
        tuple or a dict it has not got round to, hence the lists as JSON text."""
        ask, gpus, host = self.ask, self.ask.gpus, self.ask.host
        replicas = ask.replicas
        return (
            self.submitted_at, self.job_id, ask.team, ask.priority_class.value,
            ask.kind.value, gpus.count, gpus.model, models_text(gpus.models),
            gpus.memory_gib, gpus.milli, gpus.min_count,
            None if replicas is None else replicas.min,
            None if replicas is None else replicas.max,
            None if host is None else host.cpu_milli, None if host is None else host.memory_mib,
            self.spec_json, self.state.value,
            self.attempt, self.allocation_id, _json_or_none(self.resume_from),
            _dumps(self.warnings), self.wait_audited, _dumps(self.trace),
            _json_or_none(self.latest_checkpoint), self.latest_checkpoint_at,
            self.replica_target, self.replica_seq, self.replica_failures,
            self.replica_restart_at, self.parked_reason, self.cancel_reason,
        )  # fmt: skip

    @staticmethod
    def audited_row(row: JobRow) -> JobRow:
        """``row`` with its wait audited (without making the record)."""
        return (*row[:_ROW_WAIT_AUDITED], True, *row[_ROW_WAIT_AUDITED + 1 :])

    @classmethod
    def from_row(cls, row: JobRow) -> JobRecord:
        (
            submitted_at, job_id, team, priority_class, kind, count, model, models, memory_gib,
            milli, min_count, replicas_min, replicas_max, host_cpu, host_memory, spec_json,
            state, attempt, allocation_id,
            resume_from, warnings, wait_audited, trace, latest_checkpoint,
            latest_checkpoint_at, replica_target, replica_seq, replica_failures,
            replica_restart_at, parked_reason, cancel_reason,
        ) = row  # fmt: skip
        # Made for every queued job a full pass looks at: plain look-ups, no parsing
        # where a value is empty.
        ask = shared_ask(
            team, kind, priority_class, (count, model, models, memory_gib, milli, min_count),
            None if replicas_min is None else (replicas_min, replicas_max),
            None if host_cpu is None else (host_cpu, host_memory),
        )  # fmt: skip
        return cls(
            job_id, ask, spec_json, _STATES[state], attempt, allocation_id,
            _checkpoint_json(resume_from), submitted_at,
            () if warnings == "[]" else tuple(json.loads(warnings)), wait_audited,
            {} if trace == "{}" else json.loads(trace), _checkpoint_json(latest_checkpoint),
            latest_checkpoint_at, replica_target, replica_seq, replica_failures,
            replica_restart_at, parked_reason, cancel_reason,
        )  # fmt: skip

    @property
    def spec(self) -> SubmitJob:
        """The whole request, parsed anew on each call (it was validated when read)."""
        return SubmitJob.model_validate_json(self.spec_json)

    @property
    def team(self) -> str:
        return self.ask.team

    @property
    def gpus(self) -> GpuRequest:
        return self.ask.gpus

    @property
    def replicas(self) -> Replicas | None:
        """An inference service's replicas (None: a job of one allocation)."""
        return self.ask.replicas

    @property
    def kind(self) -> JobKind:
        return JobKind(self.ask.kind.value)

    @property
    def replicas_wanted(self) -> int:
        """An inference service's replica target: its max until a scale request moves it."""
        replicas = self.ask.replicas
        if replicas is None:
            return 1
        return replicas.max if self.replica_target is None else self.replica_target

    @property
    def priority_class(self) -> PriorityClass:
        return PriorityClass(self.ask.priority_class.value)


# What JobRecord.as_row gives: submission time, job id, team, priority class, then the rest.
JobRow = tuple[Any, ...]
_ROW_WAIT_AUDITED = 21
_STATES = {state.value: state for state in JobState}


def _json_or_none(checkpoint: CheckpointInfo | None) -> str | None:
    return None if checkpoint is None else checkpoint.model_dump_json()


def _checkpoint_json(text: str | None) -> CheckpointInfo | None:
    return None if text is None else CheckpointInfo.model_validate_json(text)


def _dumps(value: tuple[str, ...] | dict[str, str]) -> str:
    return json.dumps(value, separators=(",", ":"))


class UnreadableJob(Exception):
    """A stored job row that no longer parses (a bad value written by an older
    release or by hand): the job is parked, the rest of the queue goes on."""

    def __init__(self, job_id: str, cause: Exception) -> None:
        super().__init__(f"job {job_id}'s stored row cannot be read: {_first_line(cause)}")
        self.job_id = job_id


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return " ".join(text[:3])[:300] if text else type(exc).__name__


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


async def ledger_version(uow: UnitOfWork) -> int:
    """The committed ledger version, without taking the ledger lock."""
    result = await uow.execute(f"SELECT version FROM {_t(uow, 'ledger_state')} WHERE id = 1")
    return int(result.scalar_one())


# --- inventory and GPU slots ----------------------------------------------------------


async def has_inventory(uow: UnitOfWork) -> bool:
    result = await uow.execute(f"SELECT EXISTS (SELECT 1 FROM {_t(uow, 'gpus')})")
    return bool(result.scalar_one())


async def save_inventory(uow: UnitOfWork, inventory: Inventory) -> None:
    await _execute_many(
        uow,
        f"INSERT INTO {_t(uow, 'nodes')} (name, pool, cpu_milli, memory_mib, gpu_groups, mig, "
        "disk_gib) VALUES (:name, :pool, :cpu_milli, :memory_mib, CAST(:groups AS jsonb), "
        ":mig, :disk_gib)",
        [_node_row(n) for n in inventory.nodes],
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


async def save_gpus(
    uow: UnitOfWork,
    slots: Iterable[tuple[GpuSlot, tuple[str, ...], datetime | None, bool, tuple[str, ...]]],
) -> None:
    """Write the live status of these slots, with each one's MIG layout, the time of its
    last layout change, whether the agent has yet to apply it and the layout before it
    (the ledger is the source of the values)."""
    await _execute_many(
        uow,
        f"UPDATE {_t(uow, 'gpus')} SET status = :status, allocation_id = :allocation_id, "
        "reservation_id = :reservation_id, mig_layout = CAST(:layout AS jsonb), "
        "layout_changed_at = :changed_at, layout_pending = :pending, "
        "layout_before = CAST(:before AS jsonb) "
        "WHERE node = :node AND gpu_index = :idx",
        [
            {
                "node": slot.ref.node,
                "idx": slot.ref.index,
                "status": slot.status,
                "allocation_id": slot.allocation_id,
                "reservation_id": slot.reserved_for,
                "layout": json.dumps(list(layout)),
                "changed_at": changed_at,
                "pending": pending,
                "before": json.dumps(list(before)),
            }
            for slot, layout, changed_at, pending, before in slots
        ],
    )


def _node_row(node: NodeSpec) -> dict[str, Any]:
    return {
        "name": node.name,
        "pool": node.pool,
        "cpu_milli": node.cpu_milli,
        "memory_mib": node.memory_mib,
        "mig": node.mig,
        "disk_gib": node.disk_gib,
        "groups": json.dumps(
            {
                "nvlink_islands": [list(g) for g in node.nvlink_islands],
                "numa": [list(g) for g in node.numa],
            }
        ),
    }


async def load_ledger(uow: UnitOfWork) -> tuple[Inventory, Ledger]:
    """The inventory and the live ledger, rebuilt from the stored rows."""
    nodes = (
        await uow.execute(
            f"SELECT name, pool, cpu_milli, memory_mib, gpu_groups, state, mig, disk_gib "
            f"FROM {_t(uow, 'nodes')} ORDER BY name"
        )
    ).all()
    gpus = (
        await uow.execute(
            f"SELECT node, gpu_index, model, memory_mib, reservation_id, mig_layout, "
            f"layout_changed_at, layout_pending, layout_before FROM {_t(uow, 'gpus')} "
            "ORDER BY node, gpu_index"
        )
    ).all()
    specs: dict[str, list[GpuSpec]] = {}
    reservations: dict[GpuRef, str] = {}
    layouts: dict[GpuRef, tuple[tuple[str, ...], datetime | None]] = {}
    pending: set[GpuRef] = set()
    before: dict[GpuRef, tuple[str, ...]] = {}
    for row in gpus:
        spec = GpuSpec(row.node, row.gpu_index, row.model, row.memory_mib)
        specs.setdefault(row.node, []).append(spec)
        if row.reservation_id is not None:
            reservations[spec.ref] = row.reservation_id
        if row.layout_changed_at is not None:
            layouts[spec.ref] = (tuple(row.mig_layout or ()), row.layout_changed_at)
        if row.layout_pending:
            pending.add(spec.ref)
            before[spec.ref] = tuple(row.layout_before or ())
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
                n.mig,
                n.disk_gib,
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
    conditions = {n.name: NodeCondition(n.state) for n in nodes if n.state != _UP}
    return inventory, Ledger.restore(
        inventory,
        allocations,
        reservations,
        conditions,
        layouts=layouts,
        pending_layouts=pending,
        layouts_before=before,
    )


# The stored state of a node without a condition (NodeState.UP on the wire).
_UP = "up"


async def insert_node(uow: UnitOfWork, node: NodeSpec, now: datetime) -> None:
    """A node added while the service runs: its row and its idle GPU slots."""
    await uow.execute(
        f"INSERT INTO {_t(uow, 'nodes')} (name, pool, cpu_milli, memory_mib, gpu_groups, mig, "
        "disk_gib, state, changed_at) VALUES (:name, :pool, :cpu_milli, :memory_mib, "
        "CAST(:groups AS jsonb), :mig, :disk_gib, :state, :now)",
        {**_node_row(node), "state": _UP, "now": now},
    )
    await _execute_many(
        uow,
        f"INSERT INTO {_t(uow, 'gpus')} (node, gpu_index, model, memory_mib, pool, status) "
        "VALUES (:node, :idx, :model, :memory_mib, :pool, 'free')",
        [
            {
                "node": gpu.node,
                "idx": gpu.index,
                "model": gpu.model,
                "memory_mib": gpu.memory_mib,
                "pool": node.pool,
            }
            for gpu in node.gpus
        ],
    )


async def set_node_state(
    uow: UnitOfWork, name: str, condition: NodeCondition | None, now: datetime
) -> None:
    await uow.execute(
        f"UPDATE {_t(uow, 'nodes')} SET state = :state, changed_at = :now WHERE name = :name",
        {"name": name, "state": _UP if condition is None else condition.value, "now": now},
    )


async def delete_node(uow: UnitOfWork, name: str) -> None:
    await uow.execute(f"DELETE FROM {_t(uow, 'gpus')} WHERE node = :name", {"name": name})
    await uow.execute(f"DELETE FROM {_t(uow, 'nodes')} WHERE name = :name", {"name": name})


def _groups(stored: Mapping[str, Any], field: str) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(group) for group in stored.get(field, ()))


# --- jobs -------------------------------------------------------------------------------


def _checkpoint(value: Any) -> CheckpointInfo | None:
    return None if value is None else CheckpointInfo.model_validate(value)


def _job(row: Any, held: JobRecord | None = None) -> JobRecord:
    """The record of a job row; ``held``: the record already held of that job, whose
    request is not parsed again if its text did not change."""
    try:
        return _parse_job(row, held)
    except (ValueError, TypeError, KeyError) as exc:  # pydantic's ValidationError included
        raise UnreadableJob(row.job_id, exc) from exc


def _parse_job(row: Any, held: JobRecord | None) -> JobRecord:
    if held is not None and held.spec_json == row.spec:
        ask = held.ask
    else:
        # Validated whole, so a row that no longer parses is found here (and parked),
        # not when some later step asks for a field scheduling does not read.
        ask = ask_of(SubmitJob.model_validate_json(row.spec))
    return JobRecord(
        job_id=row.job_id,
        ask=ask,
        spec_json=row.spec,
        state=JobState(row.state),
        attempt=row.attempt,
        allocation_id=row.allocation_id,
        resume_from=_checkpoint(row.resume_from),
        submitted_at=row.submitted_at,
        warnings=tuple(row.warnings),
        wait_audited=row.wait_audited,
        trace=dict(row.trace or {}),
        latest_checkpoint=_checkpoint(row.latest_checkpoint),
        latest_checkpoint_at=row.latest_checkpoint_at,
        replica_target=row.replica_target,
        replica_seq=row.replica_seq,
        replica_failures=row.replica_failures,
        replica_restart_at=row.replica_restart_at,
        parked_reason=row.parked_reason,
        cancel_reason=row.cancel_reason,
    )


# Rows parsed between two turns of the event loop when many are read at once.
_YIELD_EVERY = 100
# Queued jobs read per statement when the whole queue is read.
_QUEUE_PAGE = 200

# What a JobRecord is read from: the request as text (jsonb::text), not as a decoded
# document that would only be parsed again.
_JOB_COLUMNS = (
    "job_id, spec::text AS spec, state, attempt, allocation_id, resume_from, submitted_at, "
    "warnings, wait_audited, trace, latest_checkpoint, latest_checkpoint_at, replica_target, "
    "replica_seq, replica_failures, replica_restart_at, parked_reason, cancel_reason"
)


@dataclass(frozen=True, slots=True)
class NewJob:
    job_id: str
    spec: SubmitJob
    warnings: Sequence[str]
    submitted_at: datetime
    state: JobState
    trace: Mapping[str, str]


async def job_ids_for_keys(
    uow: UnitOfWork, keys: Iterable[tuple[str, str]]
) -> dict[tuple[str, str], str]:
    """The jobs already stored under these (team, idempotency key) pairs."""
    pairs = list(keys)
    if not pairs:
        return {}
    rows = await uow.execute(
        f"SELECT j.team, j.idempotency_key, j.job_id FROM {_t(uow, 'jobs')} j "
        "JOIN unnest(CAST(:teams AS text[]), CAST(:keys AS text[])) AS k (team, key) "
        "ON j.team = k.team AND j.idempotency_key = k.key",
        {"teams": [team for team, _ in pairs], "keys": [key for _, key in pairs]},
    )
    return {(row.team, row.idempotency_key): row.job_id for row in rows}


async def insert_jobs(uow: UnitOfWork, jobs: Sequence[NewJob]) -> set[str]:
    """Store new jobs in one statement; the ids stored (a job whose team already used
    its idempotency key is not)."""
    if not jobs:
        return set()
    result = await uow.execute(
        f"INSERT INTO {_t(uow, 'jobs')} (job_id, name, team, kind, priority_class, spec, state, "
        "idempotency_key, submitted_at, updated_at, warnings, trace) "
        "SELECT job_id, name, team, kind, priority_class, CAST(spec AS jsonb), state, key, at, "
        "at, CAST(warnings AS jsonb), CAST(trace AS jsonb) FROM unnest(CAST(:ids AS text[]), "
        "CAST(:names AS text[]), CAST(:teams AS text[]), CAST(:kinds AS text[]), "
        "CAST(:classes AS text[]), CAST(:specs AS text[]), CAST(:states AS text[]), "
        "CAST(:keys AS text[]), CAST(:ats AS timestamptz[]), CAST(:warnings AS text[]), "
        "CAST(:traces AS text[])) AS n (job_id, name, team, kind, priority_class, spec, state, "
        "key, at, warnings, trace) "
        "ON CONFLICT (team, idempotency_key) DO NOTHING RETURNING job_id",
        {
            "ids": [j.job_id for j in jobs],
            "names": [j.spec.name for j in jobs],
            "teams": [j.spec.team for j in jobs],
            "kinds": [str(j.spec.kind) for j in jobs],
            "classes": [str(j.spec.priority_class) for j in jobs],
            "specs": [j.spec.model_dump_json() for j in jobs],
            "states": [str(j.state) for j in jobs],
            "keys": [j.spec.idempotency_key for j in jobs],
            "ats": [j.submitted_at for j in jobs],
            "warnings": [json.dumps(list(j.warnings)) for j in jobs],
            "traces": [json.dumps(dict(j.trace)) for j in jobs],
        },
    )
    return {row.job_id for row in result}


async def job(uow: UnitOfWork, job_id: str) -> JobRecord | None:
    row = (
        await uow.execute(
            f"SELECT {_JOB_COLUMNS} FROM {_t(uow, 'jobs')} WHERE job_id = :id", {"id": job_id}
        )
    ).first()
    return None if row is None else _job(row)


async def job_row(uow: UnitOfWork, job_id: str) -> Any:
    """The job's raw row (for showing a job whose row does not parse), or None."""
    return (
        await uow.execute(f"SELECT * FROM {_t(uow, 'jobs')} WHERE job_id = :id", {"id": job_id})
    ).first()


async def park_job(uow: UnitOfWork, job_id: str, reason: str, now: datetime) -> str | None:
    """Set the job aside with ``reason``; the state it had (None: unknown or finished)."""
    result = await uow.execute(
        f"UPDATE {_t(uow, 'jobs')} j SET state = :parked, parked_reason = :reason, "
        "parked_at = :now, updated_at = :now, wait_audited = false "
        f"FROM (SELECT job_id, state FROM {_t(uow, 'jobs')} WHERE job_id = :id FOR UPDATE) old "
        "WHERE j.job_id = old.job_id AND old.state <> ALL(:finished) RETURNING old.state",
        {
            "id": job_id,
            "parked": JobState.PARKED,
            "reason": reason[:2000],
            "now": now,
            "finished": [JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED],
        },
    )
    row = result.first()
    return None if row is None else str(row.state)


async def count_parked(uow: UnitOfWork) -> int:
    result = await uow.execute(
        f"SELECT count(*) FROM {_t(uow, 'jobs')} WHERE state = :parked",
        {"parked": JobState.PARKED},
    )
    return int(result.scalar_one())


async def unpark_job(uow: UnitOfWork, job_id: str, now: datetime) -> None:
    """Back to the queue, its parked reason cleared (an operator's retry)."""
    await uow.execute(
        f"UPDATE {_t(uow, 'jobs')} SET state = :queued, parked_reason = NULL, parked_at = NULL, "
        "wait_audited = false, updated_at = :now WHERE job_id = :id",
        {"id": job_id, "queued": JobState.QUEUED, "now": now},
    )


async def set_cancel_reason(uow: UnitOfWork, job_id: str, reason: str, now: datetime) -> None:
    await uow.execute(
        f"UPDATE {_t(uow, 'jobs')} SET cancel_reason = :reason, updated_at = :now "
        "WHERE job_id = :id",
        {"id": job_id, "reason": reason, "now": now},
    )


async def job_team(uow: UnitOfWork, job_id: str) -> str | None:
    """The team a job belongs to (without parsing its spec), or None if unknown."""
    row = (
        await uow.execute(f"SELECT team FROM {_t(uow, 'jobs')} WHERE job_id = :id", {"id": job_id})
    ).first()
    return None if row is None else str(row.team)


async def job_state(uow: UnitOfWork, job_id: str) -> tuple[str, str | None] | None:
    """(state, cancel reason) of a job without parsing its spec, or None if unknown."""
    row = (
        await uow.execute(
            f"SELECT state, cancel_reason FROM {_t(uow, 'jobs')} WHERE job_id = :id",
            {"id": job_id},
        )
    ).first()
    return None if row is None else (str(row.state), row.cancel_reason)


async def set_state_only(uow: UnitOfWork, job_id: str, state: JobState, now: datetime) -> None:
    """Move a job whose spec may not parse (parked, cancelled): no allocation kept."""
    await uow.execute(
        f"UPDATE {_t(uow, 'jobs')} SET state = :state, allocation_id = NULL, updated_at = :now "
        "WHERE job_id = :id",
        {"id": job_id, "state": state, "now": now},
    )


async def record_started(uow: UnitOfWork, allocation_id: str, at: datetime) -> bool:
    """The agent reported the allocation's workload started; False if unknown or released."""
    result = await uow.execute(
        f"UPDATE {_t(uow, 'allocations')} SET started_at = coalesce(started_at, :at) "
        "WHERE allocation_id = :id AND released_at IS NULL RETURNING allocation_id",
        {"id": allocation_id, "at": at},
    )
    return result.first() is not None


async def started_on(uow: UnitOfWork, nodes: Sequence[str]) -> list[tuple[str, str]]:
    """(allocation_id, job_id) of the live allocations on ``nodes`` whose workload the
    agent reported started."""
    rows = await uow.execute(
        f"SELECT allocation_id, job_id FROM {_t(uow, 'allocations')} a "
        "WHERE released_at IS NULL AND started_at IS NOT NULL AND EXISTS (SELECT 1 FROM "
        "jsonb_array_elements(a.gpus) g WHERE g->>'node' = ANY(:nodes)) "
        "ORDER BY granted_at, allocation_id",
        {"nodes": list(nodes)},
    )
    return [(row.allocation_id, row.job_id) for row in rows]


async def queued_pages(uow: UnitOfWork) -> AsyncIterator[list[JobRecord]]:
    """Every queued job in submission order (the scheduler ranks them by priority
    class), a page at a time: a deep queue is neither parsed in one step of the event
    loop nor held twice in memory."""
    after: tuple[datetime, str] | None = None
    while page := await queued_page(uow, after, _QUEUE_PAGE):
        yield page
        after = (page[-1].submitted_at, page[-1].job_id)


async def change_mark(uow: UnitOfWork) -> int:
    """The oldest transaction still running now: every job change by an older one is
    committed (or rolled back) and visible to any later statement."""
    result = await uow.execute("SELECT txid_snapshot_xmin(txid_current_snapshot())")
    return int(result.scalar_one())


async def queued_page(
    uow: UnitOfWork, after: tuple[datetime, str] | None, limit: int
) -> list[JobRecord]:
    """Up to ``limit`` queued jobs in submission order, from just after ``after``
    (submission time, job id; None: from the first): the in-memory queue's first load,
    page by page."""
    rows = await uow.execute(
        f"SELECT {_JOB_COLUMNS} FROM {_t(uow, 'jobs')} WHERE state = :queued "
        + ("" if after is None else "AND (submitted_at, job_id) > (:at, :id) ")
        + "ORDER BY submitted_at, job_id LIMIT :limit",
        {"queued": JobState.QUEUED, "limit": limit}
        | ({} if after is None else {"at": after[0], "id": after[1]}),
    )
    return [_job(row) for row in rows]


async def jobs_changed_since(
    uow: UnitOfWork, mark: int, held: Callable[[str], JobRecord | None]
) -> tuple[list[JobRecord], set[str]]:
    """The jobs changed by transactions from ``mark`` (a ``change_mark``) on: those queued
    now, parsed, and the ids of the others (they left the queue, or never were in it).
    ``held``: the record already held of a job, if any (see ``_job``)."""
    rows = await uow.execute(
        f"SELECT {_JOB_COLUMNS} FROM {_t(uow, 'jobs')} WHERE changed_xid >= :mark",
        {"mark": mark},
    )
    queued: list[JobRecord] = []
    others: set[str] = set()
    for number, row in enumerate(rows, 1):
        if row.state == JobState.QUEUED:
            queued.append(_job(row, held(row.job_id)))
        else:
            others.add(row.job_id)
        if number % _YIELD_EVERY == 0:
            await asyncio.sleep(0)  # many changed rows: let the API in between
    return queued, others


async def any_changed_since(uow: UnitOfWork, mark: int) -> bool:
    result = await uow.execute(
        f"SELECT EXISTS (SELECT 1 FROM {_t(uow, 'jobs')} WHERE changed_xid >= :mark)",
        {"mark": mark},
    )
    return bool(result.scalar_one())


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


async def jobs_started(
    uow: UnitOfWork,
    started: Sequence[tuple[str, str, int, Sequence[str]]],
    now: datetime,
) -> None:
    """Jobs now running, as (job_id, allocation_id, attempt, warnings), in one statement."""
    await _execute_many(
        uow,
        f"UPDATE {_t(uow, 'jobs')} SET state = :state, allocation_id = :allocation_id, "
        "attempt = :attempt, warnings = CAST(:warnings AS jsonb), wait_audited = false, "
        "updated_at = :now WHERE job_id = :job_id",
        [
            {
                "job_id": job_id,
                "state": JobState.RUNNING,
                "allocation_id": allocation_id,
                "attempt": attempt,
                "warnings": json.dumps(list(warnings)),
                "now": now,
            }
            for job_id, allocation_id, attempt, warnings in started
        ],
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


async def record_checkpoint(
    uow: UnitOfWork, job_id: str, checkpoint: CheckpointInfo, at: datetime
) -> bool:
    """Keep the job's newest confirmed checkpoint (by step); False if the job is unknown
    or already has a later one."""
    result = await uow.execute(
        f"UPDATE {_t(uow, 'jobs')} SET latest_checkpoint = CAST(:checkpoint AS jsonb), "
        "latest_checkpoint_at = :at WHERE job_id = :job_id AND (latest_checkpoint IS NULL "
        "OR CAST(latest_checkpoint->>'step' AS bigint) <= :step) RETURNING job_id",
        {
            "job_id": job_id,
            "checkpoint": checkpoint.model_dump_json(),
            "at": at,
            "step": checkpoint.step,
        },
    )
    return result.first() is not None


async def set_replica_target(uow: UnitOfWork, job_id: str, target: int, now: datetime) -> None:
    await uow.execute(
        f"UPDATE {_t(uow, 'jobs')} SET replica_target = :target, updated_at = :now "
        "WHERE job_id = :job_id",
        {"job_id": job_id, "target": target, "now": now},
    )


async def set_replica_restart(
    uow: UnitOfWork, job_id: str, failures: int, restart_at: datetime, now: datetime
) -> None:
    await uow.execute(
        f"UPDATE {_t(uow, 'jobs')} SET replica_failures = :failures, "
        "replica_restart_at = :restart_at, updated_at = :now WHERE job_id = :job_id",
        {"job_id": job_id, "failures": failures, "restart_at": restart_at, "now": now},
    )


async def pause_replicas(uow: UnitOfWork, job_id: str, until: datetime, now: datetime) -> None:
    """No replica of the service is placed before ``until`` (its failure count kept)."""
    await uow.execute(
        f"UPDATE {_t(uow, 'jobs')} SET replica_restart_at = :until, updated_at = :now "
        "WHERE job_id = :job_id",
        {"job_id": job_id, "until": until, "now": now},
    )


async def set_replica_seq(uow: UnitOfWork, job_id: str, seq: int) -> None:
    await uow.execute(
        f"UPDATE {_t(uow, 'jobs')} SET replica_seq = :seq WHERE job_id = :job_id",
        {"job_id": job_id, "seq": seq},
    )


async def running_services(uow: UnitOfWork) -> list[JobRecord]:
    """Running inference services (jobs with replicas), oldest first."""
    # A literal, not a parameter, so the planner matches the partial index
    # jobs_running_services (whose predicate spells the same state).
    rows = await uow.execute(
        f"SELECT {_JOB_COLUMNS} FROM {_t(uow, 'jobs')} WHERE state = '{JobState.RUNNING}' "
        "AND jsonb_typeof(spec->'replicas') = 'object' ORDER BY submitted_at, job_id"
    )
    return [_job(row) for row in rows]


async def live_allocations_of(uow: UnitOfWork, job_id: str) -> list[Allocation]:
    """The job's live allocations (an inference service's replicas), oldest first."""
    rows = await uow.execute(
        f"SELECT * FROM {_t(uow, 'allocations')} WHERE job_id = :job_id "
        "AND released_at IS NULL ORDER BY granted_at, allocation_id",
        {"job_id": job_id},
    )
    return [_allocation(row) for row in rows]


async def record_lost_work(uow: UnitOfWork, allocation_id: str, gpu_seconds: float) -> None:
    await uow.execute(
        f"UPDATE {_t(uow, 'allocations')} SET lost_gpu_seconds = :lost WHERE allocation_id = :id",
        {"id": allocation_id, "lost": gpu_seconds},
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
        cpu_per_gpu=row.cpu_per_gpu,
        memory_per_gpu=row.memory_per_gpu,
        borrowed=row.borrowed,
        share=None if row.share is None else GpuShare(**row.share),
        node=row.node,
    )


def _share(allocation: Allocation) -> str | None:
    share = allocation.share
    return None if share is None else json.dumps(asdict(share))


async def insert_allocations(
    uow: UnitOfWork, allocations: Sequence[tuple[Allocation, int]]
) -> None:
    """Store new allocations, each with its job's attempt number, in one statement."""
    await _execute_many(
        uow,
        f"INSERT INTO {_t(uow, 'allocations')} (allocation_id, job_id, team, kind, "
        "priority_class, model, pool, gpus, attempt, granted_at, borrowed, share, "
        "cpu_per_gpu, memory_per_gpu, node) VALUES "
        "(:allocation_id, :job_id, :team, :kind, :priority_class, :model, :pool, "
        "CAST(:gpus AS jsonb), :attempt, :granted_at, :borrowed, CAST(:share AS jsonb), "
        ":cpu_per_gpu, :memory_per_gpu, :node)",
        [
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
                "share": _share(allocation),
                "cpu_per_gpu": allocation.cpu_per_gpu,
                "memory_per_gpu": allocation.memory_per_gpu,
                "node": allocation.node,
            }
            for allocation, attempt in allocations
        ],
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


# --- reservations (a starving gang's hold on nodes) -----------------------------------


def _reservation(row: Any) -> Reservation:
    return Reservation(row.job_id, tuple(row.nodes), row.since, row.reason)


async def reservations(uow: UnitOfWork) -> list[Reservation]:
    rows = await uow.execute(f"SELECT * FROM {_t(uow, 'reservations')} ORDER BY since, job_id")
    return [_reservation(row) for row in rows]


async def reservation_of(uow: UnitOfWork, job_id: str) -> Reservation | None:
    row = (
        await uow.execute(
            f"SELECT * FROM {_t(uow, 'reservations')} WHERE job_id = :id", {"id": job_id}
        )
    ).first()
    return None if row is None else _reservation(row)


async def insert_reservation(uow: UnitOfWork, reservation: Reservation) -> None:
    await uow.execute(
        f"INSERT INTO {_t(uow, 'reservations')} (job_id, nodes, since, reason) "
        "VALUES (:job_id, CAST(:nodes AS jsonb), :since, :reason)",
        {
            "job_id": reservation.job_id,
            "nodes": json.dumps(list(reservation.nodes)),
            "since": reservation.since,
            "reason": reservation.reason,
        },
    )


async def delete_reservations(uow: UnitOfWork, job_ids: Sequence[str]) -> None:
    if job_ids:
        await uow.execute(
            f"DELETE FROM {_t(uow, 'reservations')} WHERE job_id = ANY(:ids)",
            {"ids": list(job_ids)},
        )


async def list_jobs(
    uow: UnitOfWork,
    *,
    team: str | None,
    states: Sequence[str],
    priority_class: str | None,
    kind: str | None,
    after: str | None,
    limit: int,
) -> list[Any]:
    """A page of job rows, newest first; `after` a job id of the previous page (keyset
    pagination: a page does not shift when jobs are submitted meanwhile). Columns only,
    plus the GPU request of the stored spec, so an unreadable spec still lists."""
    jobs = _t(uow, "jobs")
    result = await uow.execute(
        "SELECT job_id, name, team, kind, priority_class, state, attempt, allocation_id, "
        "submitted_at, spec -> 'gpus' AS gpus "
        f"FROM {jobs} WHERE (CAST(:team AS text) IS NULL OR team = :team) "
        "AND (cardinality(CAST(:states AS text[])) = 0 OR state = ANY(:states)) "
        "AND (CAST(:class AS text) IS NULL OR priority_class = :class) "
        "AND (CAST(:kind AS text) IS NULL OR kind = :kind) "
        "AND (CAST(:after AS text) IS NULL OR (submitted_at, job_id) < "
        f"(SELECT submitted_at, job_id FROM {jobs} WHERE job_id = :after)) "
        "ORDER BY submitted_at DESC, job_id DESC LIMIT :limit",
        {
            "team": team,
            "states": list(states),
            "class": priority_class,
            "kind": kind,
            "after": after,
            "limit": limit,
        },
    )
    return list(result)
