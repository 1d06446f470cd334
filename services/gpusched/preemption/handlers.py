"""Preemption's service layer: ledger projections in, the controller's decisions out.

The controller decides inside the unit of work of the message that prompted it (a
pool snapshot, an eviction outcome): its state change, its commands and its audit
records commit together, and the controller row lock keeps replicas from deciding
at the same time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict
from datetime import datetime
from typing import Any

from gpusched.contracts.envelope import Envelope, new_id, utcnow
from gpusched.contracts.messages import (
    AllocationGranted,
    AllocationReleased,
    CheckpointConfirmed,
    EvictionAborted,
    EvictionCancelled,
    EvictionCompleted,
    EvictionForced,
    EvictionRequested,
    EvictionWithdrawn,
    GpusReserved,
    GpusReturned,
    PoolSnapshot,
    PriorityClassName,
    ReserveForInference,
    ReturnToShared,
    T,
)
from gpusched.domain.elastic import VictimCandidate, VictimChoice
from gpusched.domain.inventory import Pool
from gpusched.infra.db import UnitOfWork
from gpusched.infra.errors import Rejected
from gpusched.preemption import policy, store
from gpusched.preemption.store import DecisionKind, DecisionStatus, EvictionStatus

log = logging.getLogger(__name__)

NAME = "preemption"


# --- projections of admission's ledger ---------------------------------------------------
async def on_allocation_granted(envelope: Envelope, uow: UnitOfWork) -> None:
    await store.add_allocation(uow, envelope.payload(AllocationGranted))


async def on_allocation_released(envelope: Envelope, uow: UnitOfWork) -> None:
    await store.remove_allocation(uow, envelope.payload(AllocationReleased).allocation_id)


async def on_gpus_reserved(envelope: Envelope, uow: UnitOfWork) -> None:
    reserved = envelope.payload(GpusReserved)
    await store.lend(uow, reserved.reservation_id, [*reserved.gpus, *reserved.pending])


async def on_gpus_returned(envelope: Envelope, uow: UnitOfWork) -> None:
    await store.unlend(uow, envelope.payload(GpusReturned).gpus)


async def on_checkpoint_confirmed(envelope: Envelope, uow: UnitOfWork) -> None:
    """Job events carry the job id as their correlation id; the confirmation's time
    bounds the work an eviction would lose."""
    envelope.payload(CheckpointConfirmed)
    if envelope.correlation_id is None:
        log.debug("checkpoint confirmation %s names no job", envelope.id)
        return
    await store.record_checkpoint(uow, envelope.correlation_id, envelope.time)


# --- the controller ------------------------------------------------------------------------
_Settled = EvictionCompleted | EvictionForced | EvictionCancelled
_SETTLED: Mapping[str, tuple[type[_Settled], EvictionStatus]] = {
    T.EVICTION_COMPLETED: (EvictionCompleted, EvictionStatus.COMPLETED),
    T.EVICTION_FORCED: (EvictionForced, EvictionStatus.FORCED),
    T.EVICTION_CANCELLED: (EvictionCancelled, EvictionStatus.CANCELLED),
}


class Controller:
    def __init__(
        self, limits: policy.ControllerLimits, clock: Callable[[], datetime] = utcnow
    ) -> None:
        self._limits = limits
        self._clock = clock

    async def on_pool_snapshot(self, envelope: Envelope, uow: UnitOfWork) -> None:
        snapshot = envelope.payload(PoolSnapshot)
        reading = _reading(snapshot)
        now = self._clock()
        timers = await store.lock_controller(uow)
        in_flight = await store.decision_in_flight(uow)
        view = policy.ControllerView(
            in_flight=in_flight,
            last_change_at=timers.last_change_at,
            last_shortfall_at=timers.last_shortfall_at,
            lent_gpus=sum(n for _, n in await store.reservations_newest_first(uow)),
            shared_allocated_gpus=await store.shared_allocated_gpus(uow),
            candidates=() if in_flight else await store.candidates(uow),
            withdrawable=await store.withdrawable_evictions(uow) if in_flight else (),
        )
        outcome = policy.decide(reading, view, self._limits, now)
        inputs = self._inputs(envelope, reading, view)
        match outcome:
            case policy.Hold(reason=reason):
                log.debug("no pool change on snapshot %s: %s", envelope.id, reason)
            case policy.Expand():
                await self._expand(uow, envelope, outcome, inputs, now)
            case policy.Shrink():
                await self._shrink(uow, envelope, outcome, inputs, now)
            case policy.Withdraw():
                await self._withdraw(uow, envelope, outcome, inputs, now)

    async def _withdraw(
        self,
        uow: UnitOfWork,
        cause: Envelope,
        outcome: policy.Withdraw,
        inputs: dict[str, Any],
        now: datetime,
    ) -> None:
        for request_id in outcome.request_ids:
            await uow.emit(
                uow.subjects.command("checkpoint", T.EVICTION_WITHDRAWN),
                T.EVICTION_WITHDRAWN,
                EvictionWithdrawn(request_id=request_id, reason=outcome.reason),
                correlation_id=request_id,
                causation_id=cause.id,
            )
        await store.mark_withdrawn(uow, outcome.request_ids, now)
        await uow.audit(
            "preempt.withdraw",
            ",".join(outcome.request_ids),
            outcome.reason,
            {**inputs, "request_ids": list(outcome.request_ids)},
            causation_id=cause.id,
        )

    async def _expand(
        self,
        uow: UnitOfWork,
        cause: Envelope,
        outcome: policy.Expand,
        inputs: dict[str, Any],
        now: datetime,
    ) -> None:
        decision_id = new_id()
        choice = outcome.choice
        details = {
            **inputs,
            "gpus": outcome.gpus,
            "free_gpus": outcome.free_gpus,
            "victims": list(choice.allocation_ids),
            "candidates": _reasons(choice),
            "shortfall": outcome.shortfall,
        }
        if outcome.changes_pools:
            reservation_id = new_id()
            await store.add_decision(
                uow,
                decision_id=decision_id,
                kind=DecisionKind.EXPAND,
                time=now,
                reservation_id=reservation_id,
                inputs=details,
                need=outcome.gpus,
                victims=choice.allocation_ids,
                status=DecisionStatus.IN_FLIGHT if choice.victims else DecisionStatus.DONE,
            )
            await self._reserve(
                uow, decision_id, reservation_id, choice, outcome.free_gpus, cause, now
            )
            await store.record_change(uow, now)
            await uow.audit(
                "preempt.expand",
                decision_id,
                outcome.reason,
                {**details, "reservation_id": reservation_id},
                causation_id=cause.id,
            )
        if outcome.shortfall:
            await self._shortfall(
                uow, decision_id, outcome.shortfall, outcome.reason, details, cause
            )
            await store.record_shortfall(uow, now)

    async def _shrink(
        self,
        uow: UnitOfWork,
        cause: Envelope,
        outcome: policy.Shrink,
        inputs: dict[str, Any],
        now: datetime,
    ) -> None:
        decision_id = new_id()
        parts = policy.split_return(outcome.gpus, await store.reservations_newest_first(uow))
        details = {**inputs, "gpus": outcome.gpus, "returns": [list(p) for p in parts]}
        await store.add_decision(
            uow,
            decision_id=decision_id,
            kind=DecisionKind.SHRINK,
            time=now,
            reservation_id=None,
            inputs=details,
            need=outcome.gpus,
            victims=(),
            status=DecisionStatus.DONE,
        )
        for reservation_id, gpus in parts:
            await uow.emit(
                uow.subjects.command("admission", T.RETURN_TO_SHARED),
                T.RETURN_TO_SHARED,
                ReturnToShared(reservation_id=reservation_id, decision_id=decision_id, gpus=gpus),
                correlation_id=decision_id,
                causation_id=cause.id,
            )
        await store.record_change(uow, now)
        await uow.audit(
            "preempt.shrink", decision_id, outcome.reason, details, causation_id=cause.id
        )

    # --- eviction outcomes --------------------------------------------------------------
    async def on_eviction_settled(self, envelope: Envelope, uow: UnitOfWork) -> None:
        """Completed, forced or cancelled: the eviction is over either way."""
        model, status = _SETTLED[envelope.type]
        outcome = envelope.payload(model)
        now = self._clock()
        row = await self._open_eviction(uow, outcome.request_id)
        if row is None:
            return
        await store.finish_eviction(uow, row.request_id, status, now)
        await self._settle(uow, row.decision_id, now)

    async def on_eviction_aborted(self, envelope: Envelope, uow: UnitOfWork) -> None:
        """The victim could not checkpoint in time and keeps running: find its GPUs
        elsewhere, never in an allocation this decision tried already."""
        aborted = envelope.payload(EvictionAborted)
        now = self._clock()
        row = await self._open_eviction(uow, aborted.request_id)
        if row is None:
            return
        await store.finish_eviction(uow, row.request_id, EvictionStatus.ABORTED, now)
        choice = policy.replacement(
            await store.candidates(uow),
            row.gpus,
            now,
            exclude=await store.tried_allocations(uow, row.decision_id),
        )
        reason = (
            f"eviction {row.request_id} of allocation {row.allocation_id} aborted "
            f"({aborted.reason}): {row.gpus} GPUs to find elsewhere"
        )
        details = {
            "replaces": row.request_id,
            "aborted_allocation_id": row.allocation_id,
            "gpus": row.gpus,
            "victims": list(choice.allocation_ids),
            "candidates": _reasons(choice),
            "shortfall": choice.shortfall,
        }
        if choice.victims:
            # The same reservation: admission adds the new victims' GPUs to it.
            reservation_id = row.reservation_id or new_id()
            await self._reserve(
                uow, row.decision_id, reservation_id, choice, 0, envelope, now, row.request_id
            )
            await store.add_victims(uow, row.decision_id, choice.allocation_ids)
            await uow.audit(
                "preempt.expand", row.decision_id, reason, details, causation_id=envelope.id
            )
        if choice.shortfall:
            await self._shortfall(uow, row.decision_id, choice.shortfall, reason, details, envelope)
            await store.record_shortfall(uow, now)
        await self._settle(uow, row.decision_id, now)

    async def _open_eviction(self, uow: UnitOfWork, request_id: str) -> store.EvictionRow | None:
        await store.lock_controller(uow)
        row = await store.eviction(uow, request_id)
        if row is None:
            raise Rejected(f"eviction request {request_id!r} was not made by this controller")
        if row.status is not EvictionStatus.REQUESTED:
            # A second outcome for one request (a saga replayed): the first one counts.
            log.info("eviction %s already %s; outcome ignored", request_id, row.status)
            return None
        return row

    async def _settle(self, uow: UnitOfWork, decision_id: str, now: datetime) -> None:
        if await store.open_evictions(uow, decision_id) == 0:
            await store.finish_decision(uow, decision_id, now)
            # The cooldown runs from the end of a change, not from its start.
            await store.record_change(uow, now)
            log.info("decision %s done", decision_id)

    # --- shared steps -------------------------------------------------------------------
    async def _reserve(
        self,
        uow: UnitOfWork,
        decision_id: str,
        reservation_id: str,
        choice: VictimChoice,
        free_gpus: int,
        cause: Envelope,
        now: datetime,
        replaces: str | None = None,
    ) -> None:
        # Reserve before evicting: the victims' GPUs are pending for inference, so no
        # training job can be placed on them between eviction and reservation.
        await uow.emit(
            uow.subjects.command("admission", T.RESERVE_FOR_INFERENCE),
            T.RESERVE_FOR_INFERENCE,
            ReserveForInference(
                reservation_id=reservation_id,
                decision_id=decision_id,
                allocation_ids=list(choice.allocation_ids),
                free_gpus=free_gpus,
            ),
            correlation_id=decision_id,
            causation_id=cause.id,
        )
        reasons = dict(choice.reasons)
        for victim in choice.victims:
            await self._request_eviction(
                uow, decision_id, victim, reasons[victim.allocation_id], cause, now, replaces
            )

    async def _request_eviction(
        self,
        uow: UnitOfWork,
        decision_id: str,
        victim: VictimCandidate,
        reason: str,
        cause: Envelope,
        now: datetime,
        replaces: str | None,
    ) -> None:
        request_id = new_id()
        await store.add_eviction(
            uow,
            request_id=request_id,
            decision_id=decision_id,
            allocation_id=victim.allocation_id,
            gpus=victim.gpus,
            requested_at=now,
            replaces=replaces,
        )
        await uow.emit(
            uow.subjects.command("checkpoint", T.EVICTION_REQUESTED),
            T.EVICTION_REQUESTED,
            EvictionRequested(
                request_id=request_id,
                decision_id=decision_id,
                allocation_id=victim.allocation_id,
                job_id=victim.job_id,
                team=victim.team,
                priority_class=PriorityClassName(victim.priority_class),
                gpus=victim.gpus,
                started_at=victim.started_at,
                reason=reason,
            ),
            correlation_id=decision_id,
            causation_id=cause.id,
            # The eviction belongs to the job's trace (submit ... evict), not to the
            # telemetry snapshot that happened to trigger it.
            trace_headers=await store.allocation_trace(uow, victim.allocation_id),
        )

    async def _shortfall(
        self,
        uow: UnitOfWork,
        decision_id: str,
        missing: int,
        reason: str,
        details: dict[str, Any],
        cause: Envelope,
    ) -> None:
        await uow.audit(
            "preempt.shortfall",
            decision_id,
            f"{missing} GPUs short for inference: {reason}",
            {**details, "missing_gpus": missing},
            causation_id=cause.id,
        )

    def _inputs(
        self, envelope: Envelope, reading: policy.PoolReading, view: policy.ControllerView
    ) -> dict[str, Any]:
        limits = self._limits
        return {
            "snapshot_id": envelope.id,
            "snapshot_time": reading.time.isoformat(),
            "inference": asdict(reading.inference),
            "shared": asdict(reading.shared),
            "lent_gpus": view.lent_gpus,
            "shared_allocated_gpus": view.shared_allocated_gpus,
            "thresholds": {
                **asdict(limits.thresholds),
                "cooldown_s": limits.cooldown_s,
            },
        }


def _reading(snapshot: PoolSnapshot) -> policy.PoolReading:
    by_pool = {pool.pool: pool for pool in snapshot.pools}
    missing = sorted({Pool.INFERENCE, Pool.SHARED} - by_pool.keys())
    if missing:
        raise Rejected(f"pool snapshot of {snapshot.time.isoformat()} lacks pools {missing}")

    def figures(name: str) -> policy.PoolFigures:
        state = by_pool[name]
        return policy.PoolFigures(state.gpus, state.util, state.reporting_gpus)

    return policy.PoolReading(snapshot.time, figures(Pool.INFERENCE), figures(Pool.SHARED))


def _reasons(choice: VictimChoice) -> list[dict[str, str]]:
    return [{"allocation_id": a, "reason": r} for a, r in choice.reasons]
