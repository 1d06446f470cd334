"""Preemption's service layer: ledger projections in, the controller's decisions out.

Pool snapshots only move the signal windows (any replica may apply them). The pool
decisions are taken by one loop that runs on the elected leader only
(``ServiceRuntime.every(..., singleton=True)``): it reads the newest reading and the
windows from the database, decides, and commits the state change, its commands and
its audit records in one unit of work. Eviction outcomes (a replacement victim for an
aborted eviction) are handled by whichever replica receives them. Every decision first
takes the controller row lock, so even two replicas that both believe they lead (a
lease lost mid-tick) decide one after the other, each seeing the other's effect.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import asdict
from datetime import datetime, timedelta
from typing import Any

from prometheus_client import Counter, Gauge

from gpusched.contracts.envelope import Envelope, new_id, utcnow
from gpusched.contracts.messages import (
    AllocationGranted,
    AllocationReleased,
    CheckpointVerified,
    EvictionAborted,
    EvictionCancelled,
    EvictionCompleted,
    EvictionForced,
    EvictionRequested,
    EvictionWithdrawn,
    GpusReserved,
    GpusReturned,
    InventoryChanged,
    InventoryLoaded,
    NodeChange,
    PoolSnapshot,
    PriorityClassName,
    ReserveForInference,
    ReturnToShared,
    T,
)
from gpusched.domain.elastic import VictimCandidate, VictimChoice
from gpusched.domain.inventory import Pool
from gpusched.infra.db import UnitOfWork, UnitOfWorkFactory
from gpusched.infra.errors import Rejected, is_outage
from gpusched.preemption import inputs, policy, signals, store
from gpusched.preemption.store import DecisionKind, DecisionStatus, EvictionStatus

log = logging.getLogger(__name__)

NAME = "preemption"

SHORTFALL_GPUS = Gauge(
    "gpusched_preemption_shortfall_gpus",
    "GPUs inference needed that no allowed victim could free, at the last expansion",
)
TICK_FAILURES = Counter(
    "gpusched_preemption_tick_failures",
    "Decision rounds that failed for a reason other than an outage, by error type",
    ["error"],
)
DECISIONS = Counter(
    "gpusched_controller_decisions_total",
    "Decision rounds of the elastic-pool controller, by decision: hold, expand, shrink, withdraw",
    ["decision"],
)
LENDING_GPUS = Counter(
    "gpusched_controller_gpus_total",
    "Shared GPUs the controller decided to lend to inference (lend) or give back (return)",
    ["action"],
)
# At 0 from the start, so the first decision of a kind shows in increase() and rate().
for _decision in ("hold", "expand", "shrink", "withdraw"):
    DECISIONS.labels(_decision)
for _action in ("lend", "return"):
    LENDING_GPUS.labels(_action)
# A snapshot dated further ahead of this service's clock would hold every later reading
# off (readings older than the newest are ignored): it is refused instead.
FUTURE_SKEW_S = 300.0
# How many distinct tick errors are remembered as audited while the errors go on.
TICK_ERRORS_REMEMBERED = 64


# --- projections of admission's ledger ---------------------------------------------------
async def on_allocation_granted(envelope: Envelope, uow: UnitOfWork) -> None:
    await store.add_allocation(uow, envelope.payload(AllocationGranted))


async def on_inventory_loaded(envelope: Envelope, uow: UnitOfWork) -> None:
    inventory = envelope.payload(InventoryLoaded)
    await store.replace_islands(uow, ((n.name, n.gpu_groups) for n in inventory.nodes))


async def on_inventory_changed(envelope: Envelope, uow: UnitOfWork) -> None:
    changed = envelope.payload(InventoryChanged)
    node = changed.node
    if changed.change is NodeChange.ADDED:
        await store.replace_islands(uow, [(node.name, node.gpu_groups)])
    elif changed.change is NodeChange.REMOVED:
        await store.replace_islands(uow, [(node.name, [])])
    # A failed node's allocations and lent GPUs end in their own events (released,
    # returned), which keep the victim and reservation projections right.


async def on_allocation_released(envelope: Envelope, uow: UnitOfWork) -> None:
    await store.remove_allocation(uow, envelope.payload(AllocationReleased).allocation_id)


async def on_gpus_reserved(envelope: Envelope, uow: UnitOfWork) -> None:
    reserved = envelope.payload(GpusReserved)
    await store.lend(uow, reserved.reservation_id, [*reserved.gpus, *reserved.pending])


async def on_gpus_returned(envelope: Envelope, uow: UnitOfWork) -> None:
    await store.unlend(uow, envelope.payload(GpusReturned).gpus)


async def on_checkpoint_verified(envelope: Envelope, uow: UnitOfWork) -> None:
    """The checkpoint service verified and catalogued a job's checkpoint: from its time
    on an eviction would lose nothing earlier. A job's raw claim never counts here."""
    verified = envelope.payload(CheckpointVerified)
    await store.record_checkpoint(uow, verified.job_id, verified.confirmed_at)


# --- the controller ------------------------------------------------------------------------
_Settled = EvictionCompleted | EvictionForced | EvictionCancelled
_SETTLED: Mapping[str, tuple[type[_Settled], EvictionStatus]] = {
    T.EVICTION_COMPLETED: (EvictionCompleted, EvictionStatus.COMPLETED),
    T.EVICTION_FORCED: (EvictionForced, EvictionStatus.FORCED),
    T.EVICTION_CANCELLED: (EvictionCancelled, EvictionStatus.CANCELLED),
}


class Controller:
    def __init__(
        self,
        limits: policy.ControllerLimits,
        clock: Callable[[], datetime] = utcnow,
        replica: str | None = None,
    ) -> None:
        self._limits = limits
        self._clock = clock
        # Named in every decision's audit record: which replica decided.
        self.replica = replica or f"{socket.gethostname()}:{os.getpid()}"
        self._skips = inputs.Skips()
        # Tick errors audited since the last good tick: each is audited once, not on
        # every round while it lasts.
        self._tick_errors: set[str] = set()

    async def on_pool_snapshot(self, envelope: Envelope, uow: UnitOfWork) -> None:
        """Fold the reading into the windows; the leader's loop decides on them. A service
        reading that cannot be read is left out and reported; the rest is used."""
        snapshot, skipped = inputs.read_snapshot(envelope.data)
        ahead = (snapshot.time - self._clock()).total_seconds()
        if ahead > FUTURE_SKEW_S:
            raise Rejected(
                f"pool snapshot dated {snapshot.time.isoformat()}, {ahead:.0f} s ahead of this "
                f"service's clock (more than {FUTURE_SKEW_S:.0f} s): a clock or exporter fault"
            )
        reading = _reading(snapshot)
        await self._report_skipped(uow, skipped, envelope.id)
        timers = await store.lock_controller(uow)
        held = signals.fold(
            timers.held,
            reading,
            self._limits.thresholds,
            self._limits.signals,
            timers.last_change_at,
        )
        if held == timers.held:
            log.debug("snapshot %s is older than the newest reading", envelope.id)
            return
        await store.record_reading(uow, envelope.id, snapshot, held)

    async def tick(self, uow_factory: UnitOfWorkFactory) -> None:
        """One decision round on the leader, in its own unit of work. An outage is left
        to the runtime (the next round tries again); any other failure is counted, and
        logged and audited once per distinct error while it repeats."""
        try:
            async with uow_factory() as uow:
                await self.decide(uow)
                await uow.commit()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if is_outage(exc):
                raise
            await self._tick_failed(uow_factory, exc)
            return
        self._tick_errors.clear()

    async def _tick_failed(self, uow_factory: UnitOfWorkFactory, exc: Exception) -> None:
        TICK_FAILURES.labels(type(exc).__name__).inc()
        # The first line names the error; what follows (SQL, parameters, fresh ids) would
        # make each round's error look new.
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        if error in self._tick_errors:
            log.debug("decision round failed again: %s", error)
            return
        if len(self._tick_errors) >= TICK_ERRORS_REMEMBERED:
            self._tick_errors.clear()
        log.error("decision round failed: %s", error, exc_info=exc)
        try:
            async with uow_factory() as uow:
                await uow.audit(
                    "preempt.tick_failed",
                    "controller",
                    f"a decision round failed ({error}); the controller tries again every "
                    "interval and records this error once while it lasts",
                    {"replica": self.replica, "error": error, "error_type": type(exc).__name__},
                )
                await uow.commit()
        except Exception as audit_exc:
            # Not remembered: the next round tries to audit it again.
            log.warning("could not audit the failed decision round: %r", audit_exc)
            return
        self._tick_errors.add(error)

    async def _candidates(
        self, uow: UnitOfWork, now: datetime, cause: str
    ) -> tuple[VictimCandidate, ...]:
        """The victim candidates a choice can rank; the rest are reported and left out."""
        found = await store.candidates(uow)
        usable, unrankable = inputs.vet_candidates(found.usable, now)
        await self._report_skipped(uow, (*found.skipped, *unrankable), cause)
        return usable

    async def _report_skipped(
        self, uow: UnitOfWork, skipped: tuple[inputs.SkippedInput, ...], cause: str | None
    ) -> None:
        # Every skip is counted; a bad item that keeps coming back is audited once.
        for item in self._skips.new(skipped):
            await uow.audit(
                "preempt.input_skipped",
                item.key,
                f"{item.kind} {item.key} left out of the controller's decisions: {item.reason}",
                {**item.describe(), "replica": self.replica},
                causation_id=cause,
            )

    async def decide(self, uow: UnitOfWork) -> policy.Outcome | None:
        now = self._clock()
        timers = await store.lock_controller(uow)
        if timers.unreadable is not None:
            skipped = inputs.SkippedInput(
                inputs.InputKind.POOL_READING, "stored", timers.unreadable
            )
            await self._report_skipped(uow, (skipped,), None)
        if timers.reading is None or timers.reading_id is None:
            return None
        reading = _reading(timers.reading)
        in_flight = await store.decision_in_flight(uow)
        # Loading every live allocation each second is wasted unless an expansion is due.
        wants_candidates = not in_flight and policy.expand_due(
            reading, timers.held, self._limits, now
        )
        view = policy.ControllerView(
            in_flight=in_flight,
            last_change_at=timers.last_change_at,
            last_shortfall_at=timers.last_shortfall_at,
            reservations=await store.reservations(uow),
            shared_allocated_gpus=await store.shared_allocated_gpus(uow),
            candidates=(
                await self._candidates(uow, now, timers.reading_id) if wants_candidates else ()
            ),
            withdrawable=await store.withdrawable_evictions(uow) if in_flight else (),
            recent_evictions=await self._recent_evictions(uow, now),
            islands=await store.islands(uow) if wants_candidates else None,
        )
        outcome = policy.decide(reading, timers.held, view, self._limits, now)
        # The snapshot that completed the window is the decision's cause.
        cause = timers.reading_id
        seen = self._inputs(cause, reading, timers.held, view, now)
        uow.on_commit(lambda: _count_decision(outcome))
        match outcome:
            case policy.Hold(reason=reason):
                log.debug("no pool change on reading %s: %s", cause, reason)
            case policy.Expand():
                await self._expand(uow, cause, outcome, seen, now)
            case policy.Shrink():
                await self._shrink(uow, cause, outcome, seen, now)
            case policy.Withdraw():
                await self._withdraw(uow, cause, outcome, seen, now)
        return outcome

    async def _recent_evictions(self, uow: UnitOfWork, now: datetime) -> int:
        since = now - timedelta(seconds=policy.EVICTION_RATE_WINDOW_S)
        return await store.recent_evictions(uow, since)

    async def _withdraw(
        self,
        uow: UnitOfWork,
        cause: str,
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
                causation_id=cause,
            )
        await store.mark_withdrawn(uow, outcome.request_ids, now)
        await uow.audit(
            "preempt.withdraw",
            ",".join(outcome.request_ids),
            outcome.reason,
            {**inputs, "request_ids": list(outcome.request_ids)},
            causation_id=cause,
        )

    async def _expand(
        self,
        uow: UnitOfWork,
        cause: str,
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
            "candidates": candidates_record(choice),
            "shortfall": outcome.shortfall,
            "deferred_by_rate_limit": choice.deferred,
        }
        SHORTFALL_GPUS.set(outcome.shortfall)
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
                causation_id=cause,
            )
        if outcome.shortfall:
            await self._shortfall(
                uow, decision_id, outcome.shortfall, outcome.reason, details, cause
            )
            await store.record_shortfall(uow, now)

    async def _shrink(
        self,
        uow: UnitOfWork,
        cause: str,
        outcome: policy.Shrink,
        inputs: dict[str, Any],
        now: datetime,
    ) -> None:
        decision_id = new_id()
        parts = outcome.returns
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
                causation_id=cause,
            )
        await store.record_change(uow, now)
        await uow.audit("preempt.shrink", decision_id, outcome.reason, details, causation_id=cause)

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
            await self._candidates(uow, now, envelope.id),
            row.gpus,
            now,
            await store.tried_allocations(uow, row.decision_id),
            self._limits,
            await self._recent_evictions(uow, now),
            island_of=await store.islands(uow),
        )
        reason = (
            f"eviction {row.request_id} of allocation {row.allocation_id} aborted "
            f"({aborted.reason}): {row.gpus} GPUs to find elsewhere"
        )
        details = {
            "replica": self.replica,
            "replaces": row.request_id,
            "aborted_allocation_id": row.allocation_id,
            "gpus": row.gpus,
            "min_runtime_s": self._limits.min_runtime_s,
            "victims": list(choice.allocation_ids),
            "candidates": candidates_record(choice),
            "shortfall": choice.shortfall,
            "deferred_by_rate_limit": choice.deferred,
        }
        if choice.victims:
            # The same reservation: admission adds the new victims' GPUs to it.
            reservation_id = row.reservation_id or new_id()
            await self._reserve(
                uow, row.decision_id, reservation_id, choice, 0, envelope.id, now, row.request_id
            )
            await store.add_victims(uow, row.decision_id, choice.allocation_ids)
            await uow.audit(
                "preempt.expand", row.decision_id, reason, details, causation_id=envelope.id
            )
        if choice.shortfall:
            SHORTFALL_GPUS.set(choice.shortfall)
            await self._shortfall(
                uow, row.decision_id, choice.shortfall, reason, details, envelope.id
            )
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
        cause: str,
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
            causation_id=cause,
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
        cause: str,
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
                share_milli=victim.share_milli,
            ),
            correlation_id=decision_id,
            causation_id=cause,
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
        cause: str,
    ) -> None:
        await uow.audit(
            "preempt.shortfall",
            decision_id,
            f"{missing} GPUs short for inference: {reason}",
            {**details, "missing_gpus": missing},
            causation_id=cause,
        )

    def _inputs(
        self,
        cause: str,
        reading: policy.PoolReading,
        held: signals.HeldSignals,
        view: policy.ControllerView,
        now: datetime,
    ) -> dict[str, Any]:
        limits = self._limits
        sig = limits.signals
        return {
            "replica": self.replica,
            "snapshot_id": cause,
            "snapshot_time": reading.time.isoformat(),
            "inference": asdict(reading.inference),
            "shared": asdict(reading.shared),
            "services": [asdict(s) for s in reading.services],
            "windows": {
                "expand_since": _iso(held.expand_since),
                "expand_held_s": signals.held_for(held.expand_since, now),
                "expand_hold_s": sig.expand_hold_s,
                "shrink_since": _iso(held.shrink_since),
                "shrink_held_s": signals.held_for(held.shrink_since, now),
                "shrink_hold_s": sig.shrink_hold_s,
            },
            "lent_gpus": view.lent_gpus,
            "reservations": [
                {"reservation_id": r.reservation_id, "gpus": r.gpus, "lent_at": _iso(r.lent_at)}
                for r in view.reservations
            ],
            "shared_allocated_gpus": view.shared_allocated_gpus,
            "recent_evictions": view.recent_evictions,
            "thresholds": {
                **asdict(limits.thresholds),
                "cooldown_s": limits.cooldown_s,
                "slo_ms": dict(sig.slo_ms),
                "slo_fraction": sig.slo_fraction,
                "queue_above": sig.queue_above,
                "min_lend_s": limits.min_lend_s,
                "min_runtime_s": limits.min_runtime_s,
                "max_evictions_per_min": limits.max_evictions_per_min,
            },
        }


def _count_decision(outcome: policy.Outcome) -> None:
    match outcome:
        case policy.Hold():
            DECISIONS.labels("hold").inc()
        case policy.Expand():
            DECISIONS.labels("expand").inc()
            if outcome.changes_pools:
                LENDING_GPUS.labels("lend").inc(outcome.gpus)
        case policy.Shrink():
            DECISIONS.labels("shrink").inc()
            LENDING_GPUS.labels("return").inc(outcome.gpus)
        case policy.Withdraw():
            DECISIONS.labels("withdraw").inc()


def _iso(at: datetime | None) -> str | None:
    return None if at is None else at.isoformat()


def _reading(snapshot: PoolSnapshot) -> policy.PoolReading:
    by_pool = {pool.pool: pool for pool in snapshot.pools}
    missing = sorted({Pool.INFERENCE, Pool.SHARED} - by_pool.keys())
    if missing:
        raise Rejected(f"pool snapshot of {snapshot.time.isoformat()} lacks pools {missing}")

    def figures(name: str) -> policy.PoolFigures:
        state = by_pool[name]
        return policy.PoolFigures(state.gpus, state.util, state.reporting_gpus)

    services = tuple(
        policy.ServiceReading(s.service, s.p99_ms, s.queue_depth) for s in snapshot.services
    )
    return policy.PoolReading(
        snapshot.time,
        figures(Pool.INFERENCE),
        figures(Pool.SHARED),
        services,
        window_s=snapshot.window_s,
    )


# An audit record is one bus message (and a row's JSON): on a cluster with thousands of
# allocations, list the ineligible one by one only up to this many, and count them all.
AUDIT_INELIGIBLE_LISTED = 200


def candidates_record(choice: VictimChoice) -> dict[str, Any]:
    """Why each candidate was or was not chosen: the ranked ones one by one, the ones
    ranked after the need was met under their one reason, the ineligible by reason."""
    by_reason: dict[str, int] = {}
    for reason in choice.ineligible_reasons:
        kind = reason.split(" (", 1)[0]  # without the figures: "inside its min runtime"
        by_reason[kind] = by_reason.get(kind, 0) + 1
    listed = zip(choice.ineligible_ids, choice.ineligible_reasons, strict=True)
    return {
        "ranked": [{"allocation_id": a, "reason": r} for a, r in choice.ranked],
        "not_needed": {"reason": choice.not_needed, "allocation_ids": list(choice.not_needed_ids)},
        "ineligible": [
            {"allocation_id": a, "reason": r}
            for a, r in itertools.islice(listed, AUDIT_INELIGIBLE_LISTED)
        ],
        "ineligible_count": len(choice.ineligible_ids),
        "ineligible_by_reason": by_reason,
    }
