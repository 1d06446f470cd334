"""Inference services with replicas: each replica is its own allocation (`<job>-r<N>`),
granted and released with the usual events, so the agent starts and stops each and
billing meters each, unchanged.

The scheduling pass places a service's replicas one by one through the same `find` that
places every job (so fractional and MIG placement apply to replicas too): up to `min`
all or nothing, like a gang, then more up to the target as they fit. The target starts
at `max`; `gpusched scale` moves it inside [min, max], and a scale-down releases the
newest replicas first.

A replica that fails is replaced (a new allocation of the same shape, placed by the same
pass) after a restart back-off stored with the service, so a crash-looping replica does
not thrash the scheduler; one that completes lowers the target, and the service ends
when its last replica completed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from enum import StrEnum
from typing import TypeVar

from gpusched.contracts.envelope import utcnow
from gpusched.contracts.messages import (
    ApiError,
    EvictWorkload,
    ReplicaView,
    ScaleJob,
    ScaleReply,
    StopReason,
    T,
    WorkloadStopped,
)
from gpusched.contracts.validation import Invalid, parse_request
from gpusched.domain import ledger as d
from gpusched.infra import access
from gpusched.infra.db import UnitOfWork, UnitOfWorkFactory

from . import store, wire
from .catalog import ErrorCode, refuse
from .keeper import LedgerKeeper
from .queue import Clock, JobState
from .words import some_of

G = TypeVar("G")

# The release reason of a replica a scale-down ended.
SCALED_DOWN = "scaled_down"


class ScaleErrorCode(StrEnum):
    NOT_A_SERVICE = "not_a_service"
    OUT_OF_RANGE = "replicas_out_of_range"


class ReplicaAction(StrEnum):
    """Audit actions about one replica."""

    STOPPED = "job.replica_stopped"
    RESTARTED = "replica.restarted"
    LOST = "job.replica_lost"


@dataclass(frozen=True, slots=True)
class Backoff:
    """How long a failed replica's replacement waits: ``first`` after one failure,
    doubling with each failure in a row, at most ``longest``. A replica that ran
    ``longest`` or more before it failed was healthy, so its failure counts as the first.
    """

    first: timedelta = timedelta(seconds=10)
    longest: timedelta = timedelta(minutes=5)

    def after(self, failures: int, ran_for: timedelta) -> tuple[int, timedelta]:
        """(failures in a row counting this one, the wait before its replacement) for a
        replica that ran ``ran_for`` after ``failures`` failures in a row."""
        count = 1 if ran_for >= self.longest else failures + 1
        # Capped exponent: the doubling passes any sane `longest` long before 2**30.
        return count, min(self.first * 2 ** min(count - 1, 30), self.longest)


DEFAULT_BACKOFF = Backoff()


def backing_off(job: store.JobRecord, now: datetime) -> bool:
    """A failed replica's replacement must still wait: the pass places none of its
    replicas until then."""
    return job.replica_restart_at is not None and now < job.replica_restart_at


def replica_id(job_id: str, number: int) -> str:
    return f"{job_id}-r{number}"


def replica_number(allocation_id: str) -> int:
    """N of `<job>-r<N>`; 0 for an allocation that is not a replica's."""
    _, _, number = allocation_id.rpartition("-r")
    return int(number) if number.isdigit() else 0


def newest_first(allocation_ids: Iterable[str]) -> list[str]:
    return sorted(allocation_ids, key=replica_number, reverse=True)


def place_replicas(
    at_least: int, up_to: int, place_one: Callable[[], G | None], undo: Callable[[G], None]
) -> tuple[list[G], list[G]]:
    """Place ``at_least`` replicas all or nothing, then more up to ``up_to`` while they
    fit. Returns (placed, undone): a short gang is undone whole, never left half placed.
    """
    placed: list[G] = []
    while len(placed) < up_to:
        one = place_one()
        if one is None:
            break
        placed.append(one)
    if len(placed) < at_least:
        for one in reversed(placed):
            undo(one)
        return [], placed
    return placed, []


def view(job: store.JobRecord, live: Sequence[str]) -> ReplicaView | None:
    replicas = job.replicas
    if replicas is None:
        return None
    return ReplicaView(
        min=replicas.min,
        max=replicas.max,
        target=job.replicas_wanted,
        placed=len(live),
        allocation_ids=sorted(live, key=replica_number),
        failures=job.replica_failures,
        restart_at=job.replica_restart_at,
    )


def live_replicas(ledger: d.Ledger, job_id: str) -> list[str]:
    return [a.allocation_id for a in ledger.allocations.values() if a.job_id == job_id]


def waiting_words(job: store.JobRecord, ledger: d.Ledger) -> str:
    """Why a queued service waits, beyond what one replica's placement says."""
    replicas = job.replicas
    assert replicas is not None
    live = len(live_replicas(ledger, job.job_id))
    return (
        f"an inference service: its min {replicas.min} replicas of {job.gpus.count} GPU(s) "
        f"each are placed together or not at all ({live} running); then more up to its "
        f"target {job.replicas_wanted} as GPUs of the inference pool or lent to it free up"
    )


async def settle_stopped(
    uow: UnitOfWork,
    job: store.JobRecord,
    stopped: WorkloadStopped,
    causation_id: str,
    now: datetime,
    ran_for: timedelta,
    backoff: Backoff,
) -> None:
    """One replica's workload ended (its allocation is released already). An evicted one
    is placed again at once and a failed one after the restart back-off, while the
    service's target stands; one that completed lowers the target, and the service ends
    when its last replica completed."""
    live = await _stored_live(uow, job.job_id)
    replicas = job.replicas
    assert replicas is not None  # callers route only services here
    details: dict[str, object] = {"allocation_id": stopped.allocation_id, "live": len(live)}
    action = ReplicaAction.STOPPED
    if stopped.reason is StopReason.EVICTED:
        state = JobState.QUEUED if len(live) < replicas.min else job.state
        reason = f"replica {stopped.allocation_id} evicted; it is placed again"
    elif stopped.reason is StopReason.FAILED and job.state in (JobState.RUNNING, JobState.QUEUED):
        failures, wait = backoff.after(job.replica_failures, ran_for)
        restart_at = now + wait
        await store.set_replica_restart(uow, job.job_id, failures, restart_at, now)
        state = JobState.QUEUED if len(live) < replicas.min else job.state
        action = ReplicaAction.RESTARTED
        reason = (
            f"replica {stopped.allocation_id} failed (exit code {stopped.exit_code}) after "
            f"{ran_for.total_seconds():.0f}s; a replacement is placed from "
            f"{restart_at.isoformat()} (back-off {wait.total_seconds():.0f}s after "
            f"{failures} failure(s) in a row; {len(live)} replica(s) live)"
        )
        details |= {
            "failures": failures,
            "backoff_s": wait.total_seconds(),
            "restart_at": restart_at.isoformat(),
        }
    else:
        target = max(len(live), 1)
        await store.set_replica_target(uow, job.job_id, min(target, job.replicas_wanted), now)
        finished = JobState.COMPLETED if stopped.reason is StopReason.COMPLETED else JobState.FAILED
        state = job.state if live else finished
        reason = f"replica {stopped.allocation_id} {stopped.reason}; {len(live)} replica(s) live"
    if state is not job.state:
        await store.set_job_state(uow, job.job_id, state, now)
    await uow.audit(
        action, entity=job.job_id, reason=reason, details=details, causation_id=causation_id
    )


def short_words(job: store.JobRecord, live: int, now: datetime) -> list[str]:
    """How many replicas a service misses and, when a back-off holds them, why."""
    missing = job.replicas_wanted - live
    if missing <= 0:
        return [f"running all {live} replica(s) of its target {job.replicas_wanted}"]
    return [
        f"running {live} of its target {job.replicas_wanted} replicas: {missing} missing",
        *backoff_words(job, now),
    ]


def backoff_words(job: store.JobRecord, now: datetime) -> list[str]:
    if job.replica_restart_at is None or not backing_off(job, now):
        return []
    return [
        f"restart back-off after {job.replica_failures} replica failure(s) in a row: "
        f"no replica is placed before {job.replica_restart_at.isoformat()}"
    ]


async def after_loss(
    uow: UnitOfWork,
    job: store.JobRecord,
    allocation_id: str,
    node: str,
    now: datetime,
    causation_id: str | None,
    cause: str | None = None,
) -> None:
    """A replica ended with its node (or was interrupted: ``cause``): the pass places it
    again (all of the missing ones up to min together, as at the start)."""
    live = await _stored_live(uow, job.job_id)
    replicas = job.replicas
    assert replicas is not None
    if len(live) < replicas.min and job.state is JobState.RUNNING:
        await store.set_job_state(uow, job.job_id, JobState.QUEUED, now)
    await uow.audit(
        ReplicaAction.LOST,
        entity=job.job_id,
        reason=f"{cause or f'node {node} failed'}: replica {allocation_id} ended; it is "
        "placed again "
        f"({len(live)} of target {job.replicas_wanted} live)",
        details={"allocation_id": allocation_id, "node": node, "live": len(live)},
        causation_id=causation_id,
    )


async def _stored_live(uow: UnitOfWork, job_id: str) -> list[str]:
    # The rows, not the ledger: the caller released the replica in this transaction.
    return [a.allocation_id for a in await store.live_allocations_of(uow, job_id)]


class ReplicaOps:
    """The scale request (`<p>.api.jobs.scale`)."""

    def __init__(
        self,
        uow: UnitOfWorkFactory,
        keeper: LedgerKeeper,
        kick: Callable[[], None],
        clock: Clock = utcnow,
    ) -> None:
        self._clock = clock
        self._uow = uow
        self._keeper = keeper
        self._kick = kick

    async def scale(self, raw: bytes) -> ScaleReply:
        request = parse_request(ScaleJob, raw)
        if isinstance(request, Invalid):
            return ScaleReply(ok=False, error=request.error())
        async with self._uow() as uow:
            ledger = await self._keeper.hold(uow)
            job = await store.job(uow, request.job_id)
            if job is None:
                return ScaleReply(
                    ok=False, error=refuse(ErrorCode.NOT_FOUND, f"no job {request.job_id!r}")
                )
            if not access.caller().may_act_for(job.team):
                why = f"it belongs to team {job.team}; an operator scales any service"
                return ScaleReply(
                    ok=False, error=await access.forbid(self._uow, "scale", job.job_id, why)
                )
            replicas = job.replicas
            if replicas is None:
                return ScaleReply(
                    ok=False,
                    error=ApiError(
                        code=ScaleErrorCode.NOT_A_SERVICE,
                        message=f"job {job.job_id} has no replicas: only an inference service "
                        "submitted with replicas {min, max} can be scaled",
                    ),
                )
            if not replicas.min <= request.replicas <= replicas.max:
                return ScaleReply(
                    ok=False,
                    error=ApiError(
                        code=ScaleErrorCode.OUT_OF_RANGE,
                        message=f"{request.replicas} replicas is outside job {job.job_id}'s "
                        f"range [{replicas.min}, {replicas.max}]",
                    ),
                )
            now = self._clock()
            live = live_replicas(ledger, job.job_id)
            before = job.replicas_wanted
            await store.set_replica_target(uow, job.job_id, request.replicas, now)
            ended = newest_first(live)[: max(len(live) - request.replicas, 0)]
            for allocation_id in ended:
                await self._release(uow, ledger, job.job_id, allocation_id, now)
            left = [a for a in live if a not in ended]
            await uow.audit(
                "job.scaled",
                entity=job.job_id,
                reason=f"replica target {before} -> {request.replicas}"
                + (f"; released {some_of(ended)}" if ended else ""),
                details={"from": before, "to": request.replicas, "released": ended},
            )
            await uow.commit()
        self._kick()
        return ScaleReply(
            ok=True, replicas=view(replace(job, replica_target=request.replicas), left)
        )

    async def _release(
        self, uow: UnitOfWork, ledger: d.Ledger, job_id: str, allocation_id: str, now: datetime
    ) -> None:
        allocation = ledger.allocation(allocation_id)
        released = ledger.release(allocation_id, max(now, allocation.granted_at))
        await store.release_allocation(uow, allocation_id, released.released_at, SCALED_DOWN)
        await uow.emit(
            uow.subjects.event(uow.source, T.ALLOCATION_RELEASED),
            T.ALLOCATION_RELEASED,
            wire.allocation_released(released, SCALED_DOWN, ledger),
            correlation_id=job_id,
        )
        # The agent stops the replica's workload; its stop report then finds the
        # allocation released already (the eviction id names no saga).
        await uow.emit(
            uow.subjects.command("agent", T.EVICT_WORKLOAD),
            T.EVICT_WORKLOAD,
            EvictWorkload(
                allocation_id=allocation_id, job_id=job_id, saga_id=f"scale-{allocation_id}"
            ),
            correlation_id=job_id,
        )
