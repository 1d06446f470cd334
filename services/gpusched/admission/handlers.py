"""The admission service layer: the jobs API, ledger commands, and workload/eviction results.

Every consumer handler parses its payload first (a malformed one is dead-lettered
before anything is touched), then holds the ledger (see keeper) for the rest of its
transaction: job states and GPU slots change only under that lock, so a release and
the eviction outcome of the same allocation never race, whatever order they arrive in.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from pydantic import ValidationError

from gpusched.contracts.envelope import Envelope, utcnow
from gpusched.contracts.identity import CallerKind
from gpusched.contracts.messages import (
    AgentReady,
    ApproveJob,
    ApproveReply,
    CheckpointInfo,
    EvictionAborted,
    EvictionCancelled,
    EvictionCompleted,
    EvictionForced,
    GetJob,
    GetReply,
    GpuRef,
    GpuRequest,
    GpusReserved,
    GpusReturned,
    JobKind,
    JobView,
    MigConfigured,
    MigConfigureFailed,
    PriorityClassName,
    ReservationView,
    ReserveForInference,
    ReturnToShared,
    StopReason,
    SubmitJob,
    SubmitReply,
    T,
    WhyJob,
    WhyReply,
    WorkloadStarted,
    WorkloadStopped,
)
from gpusched.contracts.validation import Invalid, parse_request
from gpusched.domain import ledger as d
from gpusched.domain.inventory import Inventory, Pool
from gpusched.domain.quota import usage_of
from gpusched.infra import access
from gpusched.infra.db import UnitOfWork, UnitOfWorkFactory
from gpusched.infra.errors import Rejected, is_outage

from . import cancel, lending, mig, parking, replicas, reservations, store, wire
from .catalog import Catalog, ErrorCode, refuse, submission_warnings
from .explain import fair_order, find
from .intake import Intake, Submission
from .keeper import LedgerKeeper
from .nodes import newest_checkpoint, requeue_lost, requeue_or_park
from .queue import EvictionOutcome, JobState

_STOPPED_STATE = {
    StopReason.COMPLETED: JobState.COMPLETED,
    StopReason.FAILED: JobState.FAILED,
}


async def load_inventory_once(
    uow_factory: UnitOfWorkFactory, read_inventory: Callable[[], Inventory]
) -> bool:
    """Store the inventory if the ledger has none yet; True if this call loaded it.

    Under the ledger lock, so replicas starting together load it exactly once. The file
    is read only when needed: afterwards the tables are the inventory of record.
    """
    async with uow_factory() as uow:
        await store.lock_ledger(uow)
        if await store.has_inventory(uow):
            return False
        inventory = read_inventory()
        await store.save_inventory(uow, inventory)
        await uow.emit(
            uow.subjects.event(uow.source, T.INVENTORY_LOADED),
            T.INVENTORY_LOADED,
            wire.inventory_loaded(inventory),
        )
        await uow.audit(
            "inventory.loaded",
            entity="inventory",
            reason=f"first start: {inventory.total_gpus} GPUs on {len(inventory.nodes)} nodes",
            details={str(pool): inventory.gpus_in(pool) for pool in Pool},
        )
        await uow.commit()
        return True


class Admission:
    def __init__(
        self,
        uow: UnitOfWorkFactory,
        keeper: LedgerKeeper,
        catalog: Catalog,
        kick: Callable[[], None],
        backoff: replicas.Backoff = replicas.DEFAULT_BACKOFF,
    ) -> None:
        self._uow = uow
        self._keeper = keeper
        self._catalog = catalog
        self._kick = kick
        self._intake = Intake(uow, kick)
        self._backoff = backoff

    # --- the jobs API (request/reply) ---------------------------------------------------

    async def submit(self, raw: bytes) -> SubmitReply:
        job = parse_request(SubmitJob, raw)
        if isinstance(job, Invalid):
            return SubmitReply(ok=False, error=job.error())
        who = access.caller()
        if not who.may_act_for(job.team):
            # The team comes from the credential: a team submits for itself only.
            why = f"the job names team {job.team!r}; submit as that team or as an operator"
            return SubmitReply(
                ok=False, error=await access.forbid(self._uow, "submit", job.team, why)
            )
        refusal = self._catalog.refusal(job)
        if refusal is not None:
            return await self._intake.submit(Submission(job, utcnow(), refusal=refusal))
        warnings = submission_warnings(job)
        held = self._catalog.held_for_approval(job)
        if held:
            warnings.append(
                f"held for approval: {job.priority_class} is above team {job.team}'s max "
                "priority class; an operator runs `gpusched approve <job>`"
            )
        # Written with the submits arriving alongside it, in one transaction (intake).
        return await self._intake.submit(Submission(job, utcnow(), tuple(warnings), held))

    async def get(self, raw: bytes) -> GetReply:
        request = parse_request(GetJob, raw)
        if isinstance(request, Invalid):
            return GetReply(ok=False, error=request.error())
        async with self._uow() as uow:
            try:
                job = await store.job(uow, request.job_id)
            except store.UnreadableJob:
                return GetReply(
                    ok=True, job=_unreadable_view(await store.job_row(uow, request.job_id))
                )
            if job is None:
                return GetReply(
                    ok=False, error=refuse(ErrorCode.NOT_FOUND, f"no job {request.job_id!r}")
                )
            if not access.caller().may_act_for(job.spec.team):
                why = f"it belongs to team {job.spec.team}"
                return GetReply(
                    ok=False, error=await access.forbid(self._uow, "read", job.job_id, why)
                )
            held = None
            if job.allocation_id is not None:
                held = await store.allocation(uow, job.allocation_id)
            reservation = await store.reservation_of(uow, job.job_id)
            service = (
                None
                if job.spec.replicas is None
                else await store.live_allocations_of(uow, job.job_id)
            )
        allocated = (
            []
            if held is None
            else [
                GpuRef(node=ref.node, index=ref.index, model=held.allocation.model)
                for ref in held.allocation.gpus
            ]
        )
        if service is not None:
            # A service's GPUs are those of every live replica.
            allocated = [
                GpuRef(node=ref.node, index=ref.index, model=replica.model)
                for replica in service
                for ref in replica.gpus
            ]
        spec = job.spec
        return GetReply(
            ok=True,
            job=JobView(
                job_id=job.job_id,
                name=spec.name,
                team=spec.team,
                kind=spec.kind,
                priority_class=spec.priority_class,
                state=job.state,
                attempt=job.attempt,
                gpus=spec.gpus,
                allocation_id=job.allocation_id,
                allocated=allocated,
                resume_from=job.resume_from,
                # The checkpoint catalogue lives in the checkpoint service; admission knows
                # the one an eviction left and the newest the job confirmed.
                latest_checkpoint=newest_checkpoint(job.resume_from, job.latest_checkpoint),
                submitted_at=job.submitted_at,
                warnings=list(job.warnings),
                share=None if held is None else wire.share(held.allocation),
                reservation=None
                if reservation is None
                else ReservationView(
                    nodes=list(reservation.nodes),
                    since=reservation.since,
                    reason=reservation.reason,
                ),
                replicas=None
                if service is None
                else replicas.view(job, [replica.allocation_id for replica in service]),
                parked_reason=job.parked_reason if job.state is JobState.PARKED else None,
            ),
        )

    async def approve(self, raw: bytes) -> ApproveReply:
        """An operator lets a held job into the queue (audited with who and why)."""
        request = parse_request(ApproveJob, raw)
        if isinstance(request, Invalid):
            return ApproveReply(ok=False, error=request.error())
        who = access.caller()
        if not who.is_operator:
            why = "approving is an operator's decision"
            return ApproveReply(
                ok=False, error=await access.forbid(self._uow, "approve", request.job_id, why)
            )
        if who.kind is CallerKind.OPERATOR:
            # Audited under the name the credential proves, not the one the payload says.
            request = request.model_copy(update={"operator": who.name})
        async with self._uow() as uow:
            # Under the ledger lock, so an approval and a scheduling pass never interleave.
            await self._keeper.read(uow)
            found = await store.job_state(uow, request.job_id)
            if found is not None and found[0] == JobState.PARKED:
                # A retry: back to the queue; the next pass parks it again if it fails again.
                await store.unpark_job(uow, request.job_id, utcnow())
                await uow.audit(
                    "job.unparked",
                    entity=request.job_id,
                    reason=f"{request.operator} retries the parked job"
                    + (f": {request.reason}" if request.reason else ""),
                    details={"operator": request.operator, "reason": request.reason},
                )
                await parking.recount(uow)
                await uow.commit()
                self._kick()
                return ApproveReply(ok=True)
            job = await store.job(uow, request.job_id)
            if job is None:
                return ApproveReply(
                    ok=False, error=refuse(ErrorCode.NOT_FOUND, f"no job {request.job_id!r}")
                )
            if job.state is not JobState.HELD:
                return ApproveReply(
                    ok=False,
                    error=refuse(
                        ErrorCode.NOT_HELD,
                        f"job {job.job_id} is {job.state}, not held for approval or parked",
                    ),
                )
            await store.set_job_state(uow, job.job_id, JobState.QUEUED, utcnow())
            await uow.audit(
                "job.approved",
                entity=job.job_id,
                reason=f"{request.operator} approved {job.priority_class} for team "
                f"{job.spec.team}" + (f": {request.reason}" if request.reason else ""),
                details={"operator": request.operator, "reason": request.reason},
            )
            await uow.commit()
        self._kick()
        return ApproveReply(ok=True)

    async def why(self, raw: bytes) -> WhyReply:
        """Why a job is where it is, in the scheduler's own terms."""
        request = parse_request(WhyJob, raw)
        if isinstance(request, Invalid):
            return WhyReply(ok=False, error=request.error())
        async with self._uow() as uow:
            try:
                job = await store.job(uow, request.job_id)
            except store.UnreadableJob as exc:
                row = await store.job_row(uow, request.job_id)
                return WhyReply(
                    ok=True,
                    job_id=request.job_id,
                    state=row.state,
                    reasons=_unreadable_words(row, exc),
                )
            if job is None:
                return WhyReply(
                    ok=False, error=refuse(ErrorCode.NOT_FOUND, f"no job {request.job_id!r}")
                )
            if not access.caller().may_act_for(job.spec.team):
                why = f"it belongs to team {job.spec.team}"
                return WhyReply(
                    ok=False, error=await access.forbid(self._uow, "read", job.job_id, why)
                )
            if job.state is JobState.RUNNING and job.spec.replicas is not None:
                return await self._why_service(uow, job)
            if job.state is not JobState.QUEUED:
                return WhyReply(
                    ok=True, job_id=job.job_id, state=job.state, reasons=_not_waiting(job)
                )
            ledger = await self._keeper.read(uow)
            queued = await store.queued_jobs(uow)
            reserved = {r.job_id: r for r in await store.reservations(uow)}
        usage = usage_of(ledger.allocations.values())
        ahead = []
        for other in fair_order(queued, ledger, usage):
            if other.job_id == job.job_id:
                break
            ahead.append(other)
        # As the scheduler sees it: nodes reserved for a gang tried before this job.
        blockers = [reserved[other.job_id] for other in ahead if other.job_id in reserved]
        held = frozenset(node for r in blockers for node in r.nodes)
        try:
            attempt = find(ledger, self._catalog, job, usage, held=held, now=utcnow())
        except Exception as exc:
            if is_outage(exc):
                raise
            # What the pass would fail on too: it parks the job, so say that, never "fits".
            return WhyReply(
                ok=True,
                job_id=job.job_id,
                state=job.state,
                reasons=[f"{parking.reason_for(exc)}; the next scheduling pass parks it"],
            )
        reasons = list(attempt.reasons)
        if job.job_id in reserved:
            reasons.insert(0, reservations.describe(reserved[job.job_id], utcnow()))
        if attempt.placement is None:
            reasons.extend(reservations.blocking(r) for r in blockers)
        if job.spec.replicas is not None:
            reasons[:0] = [
                replicas.waiting_words(job, ledger),
                *replicas.backoff_words(job, utcnow()),
            ]
        if attempt.placement is not None and attempt.placement.layout is not None:
            reasons.append(
                f"mig: GPU {attempt.placement.gpus[0]} is empty and may be given MIG layout "
                f"{'+'.join(attempt.placement.layout)}; the next scheduling pass changes it "
                "and places the job once the cluster agent reports the layout applied"
            )
        elif attempt.placement is not None:
            reasons.append(
                "it fits now: the next scheduling pass places it"
                if job.spec.replicas is None
                else "one replica fits now: the next pass places the missing min replicas "
                "if they all fit together"
            )
        if ahead:
            names = ", ".join(
                f"{other.job_id} ({other.priority_class}, team {other.spec.team}, "
                f"{other.spec.gpus.count} GPUs)"
                for other in ahead[:5]
            )
            more = f" and {len(ahead) - 5} more" if len(ahead) > 5 else ""
            reasons.append(
                f"queue: behind {len(ahead)} job(s) tried first (priority class, then fair "
                f"share across teams, then submission order): {names}{more}"
            )
        return WhyReply(ok=True, job_id=job.job_id, state=job.state, reasons=reasons)

    async def _why_service(self, uow: UnitOfWork, job: store.JobRecord) -> WhyReply:
        """A running service: how many replicas it misses and why they are not placed."""
        ledger = await self._keeper.read(uow)
        live = len(replicas.live_replicas(ledger, job.job_id))
        now = utcnow()
        reasons = replicas.short_words(job, live, now)
        if live < job.replicas_wanted and not replicas.backing_off(job, now):
            usage = usage_of(ledger.allocations.values())
            attempt = find(ledger, self._catalog, job, usage, now=now)
            reasons.extend(attempt.reasons)
            if attempt.placement is not None and attempt.placement.layout is not None:
                reasons.append(
                    f"mig: one more replica needs GPU {attempt.placement.gpus[0]} given MIG "
                    f"layout {'+'.join(attempt.placement.layout)} first; it is placed once the "
                    "cluster agent reports the layout applied"
                )
            elif attempt.placement is not None:
                reasons.append("one more replica fits now: the next scheduling pass places it")
        return WhyReply(ok=True, job_id=job.job_id, state=job.state, reasons=reasons)

    # --- ledger commands from preemption ------------------------------------------------

    async def on_reserve_for_inference(self, envelope: Envelope, uow: UnitOfWork) -> None:
        command = envelope.payload(ReserveForInference)
        ledger = await self._keeper.hold(uow)
        if not await store.claim_decision(
            uow, command.decision_id, T.RESERVE_FOR_INFERENCE, command.reservation_id
        ):
            await _audit_repeat(uow, envelope, command.decision_id, command.reservation_id)
            return
        chosen: list[d.GpuRef] = []
        unknown: list[str] = []
        not_lendable: dict[str, str] = {}
        for allocation_id in dict.fromkeys(command.allocation_ids):
            try:
                allocation = ledger.allocation(allocation_id)
            except d.UnknownAllocation:
                unknown.append(allocation_id)
                continue
            for ref in allocation.gpus:
                slot = ledger.gpu(ref)
                if slot.pool is not Pool.SHARED:
                    not_lendable[str(ref)] = f"{slot.pool} pool"
                elif slot.status is d.GpuStatus.SHARED:
                    # Simplest honest rule: a GPU with fractional or MIG tenants is never lent.
                    not_lendable[str(ref)] = "shared by fractional or MIG tenants"
                elif slot.reserved_for not in (None, command.reservation_id):
                    not_lendable[str(ref)] = f"already reserved for {slot.reserved_for}"
                else:
                    chosen.append(ref)
        free = lending.free_to_lend(ledger, command.free_gpus, chosen)
        chosen.extend(free)
        reserved = (
            ledger.reserve_for_inference(command.reservation_id, chosen)
            if chosen
            else d.GpusReserved(command.reservation_id, ())
        )
        await self._keeper.save(uow, reserved.gpus)
        # Always answered, even when nothing could be reserved, so preemption learns the
        # outcome of its decision and can act on the shortfall.
        await uow.emit(
            uow.subjects.event(uow.source, T.GPUS_RESERVED),
            T.GPUS_RESERVED,
            GpusReserved(
                reservation_id=command.reservation_id,
                gpus=wire.gpus(reserved.gpus, ledger),
                pending=wire.gpus(reserved.pending, ledger),
            ),
            correlation_id=command.decision_id,
            causation_id=envelope.id,
        )
        short = command.free_gpus - len(free)
        await uow.audit(
            "gpus.reserved",
            entity=command.reservation_id,
            reason=(
                f"lent {len(reserved.gpus)} shared GPUs to inference "
                f"({len(reserved.pending)} on release of their training jobs)"
                + (f"; {short} fewer idle GPUs than asked" if short > 0 else "")
                + (f"; unknown allocations {', '.join(unknown)}" if unknown else "")
            ),
            details={
                "decision_id": command.decision_id,
                "gpus": [str(ref) for ref in reserved.gpus],
                "pending": [str(ref) for ref in reserved.pending],
                "free_asked": command.free_gpus,
                "free_given": len(free),
                "unknown_allocations": unknown,
                "not_lendable": not_lendable,
            },
            causation_id=envelope.id,
        )
        if len(reserved.gpus) > len(reserved.pending):
            # Idle GPUs serve inference now: a service below its replica target takes them.
            self._kick()

    async def on_return_to_shared(self, envelope: Envelope, uow: UnitOfWork) -> None:
        command = envelope.payload(ReturnToShared)
        ledger = await self._keeper.hold(uow)
        if not await store.claim_decision(
            uow, command.decision_id, T.RETURN_TO_SHARED, command.reservation_id
        ):
            await _audit_repeat(uow, envelope, command.decision_id, command.reservation_id)
            return
        chosen = lending.lent_to_return(ledger, command.reservation_id, command.gpus)
        returned = ledger.return_to_shared(gpus=chosen) if chosen else d.GpusReturned((), (), ())
        await self._keeper.save(uow, returned.gpus)
        await uow.emit(
            uow.subjects.event(uow.source, T.GPUS_RETURNED),
            T.GPUS_RETURNED,
            GpusReturned(
                reservation_id=command.reservation_id, gpus=wire.gpus(returned.gpus, ledger)
            ),
            correlation_id=command.decision_id,
            causation_id=envelope.id,
        )
        short = command.gpus - len(returned.gpus)
        await uow.audit(
            "gpus.returned",
            entity=command.reservation_id,
            reason=(
                f"returned {len(returned.gpus)} GPUs to the shared pool "
                f"({len(returned.freed)} free at once)"
                + (f"; the reservation held {short} fewer than asked" if short > 0 else "")
            ),
            details={
                "decision_id": command.decision_id,
                "gpus": [str(ref) for ref in returned.gpus],
                "freed": [str(ref) for ref in returned.freed],
                "asked": command.gpus,
            },
            causation_id=envelope.id,
        )
        if returned.freed:
            self._kick()

    # --- results from the cluster agent -------------------------------------------------

    async def on_mig_configured(self, envelope: Envelope, uow: UnitOfWork) -> None:
        """The agent applied a MIG layout change: its slices may now be used."""
        applied = envelope.payload(MigConfigured)
        ledger = await self._keeper.hold(uow)
        ref = d.GpuRef(applied.node, applied.gpu)
        layout = "+".join(applied.profiles) or "none"
        details = {"change_id": applied.change_id, "applied_at": applied.applied_at.isoformat()}
        try:
            current = mig.pending_change_id(ledger, ref)
            if current is not None and current != applied.change_id:
                # A late report of an earlier change (given up after the apply timeout).
                raise d.InvalidRequest(f"GPU {ref} awaits change {current}, not this one")
            event = ledger.apply_layout(ref, applied.profiles)
        except d.LedgerError as exc:
            # A report of a layout the GPU no longer has (or an unknown GPU): nothing to use.
            await uow.audit(
                "mig.report_ignored",
                entity=str(ref),
                reason=f"the cluster agent applied MIG layout {layout}, but {exc}",
                details=details,
                correlation_id=applied.change_id,
                causation_id=envelope.id,
            )
            return
        await self._keeper.save(uow, [ref])
        await uow.audit(
            "mig.layout_applied",
            entity=str(ref),
            reason=f"the cluster agent applied MIG layout {layout}"
            + ("" if event is not None else " (already known)"),
            details=details,
            correlation_id=applied.change_id,
            causation_id=envelope.id,
        )
        if event is not None:
            self._kick()  # replicas waiting for these slices

    async def on_mig_configure_failed(self, envelope: Envelope, uow: UnitOfWork) -> None:
        """The agent could not apply a MIG layout change: the GPU keeps its layout."""
        report = envelope.payload(MigConfigureFailed)
        ledger = await self._keeper.hold(uow)
        ref = d.GpuRef(report.node, report.gpu)
        if mig.pending_change_id(ledger, ref) != report.change_id:
            # Applied or given up already, or not a change of this GPU: nothing to undo.
            await uow.audit(
                "mig.report_ignored",
                entity=str(ref),
                reason=(
                    f"the cluster agent could not apply MIG change {report.change_id} "
                    f"({report.error}), but GPU {ref} has no such change pending"
                ),
                details={
                    "change_id": report.change_id,
                    "error": report.error,
                    "time": report.time.isoformat(),
                },
                correlation_id=report.change_id,
                causation_id=envelope.id,
            )
            return
        await mig.fail_change(
            uow, ledger, ref, mig.FailCause.REPORTED, report.error, causation_id=envelope.id
        )
        await self._keeper.save(uow, [ref])
        self._kick()  # the jobs that waited for those slices

    async def on_workload_started(self, envelope: Envelope, uow: UnitOfWork) -> None:
        """Record that the agent runs the allocation's workload: after an agent restart,
        only a started one it no longer lists was interrupted (see on_agent_ready)."""
        started = envelope.payload(WorkloadStarted)
        await store.record_started(uow, started.allocation_id, started.started_at)

    async def on_agent_ready(self, envelope: Envelope, uow: UnitOfWork) -> None:
        """The cluster agent (re)started: every live allocation on its nodes that it had
        reported started and does not list now lost its workload (a killed agent's
        workloads die with it) and is handled like an interrupted one. An allocation
        whose start command the agent has not consumed yet is not touched: the command is
        still durable in the COMMANDS stream and the agent starts it."""
        ready = envelope.payload(AgentReady)
        ledger = await self._keeper.hold(uow)
        running = set(ready.running)
        lost = [
            (allocation_id, job_id)
            for allocation_id, job_id in await store.started_on(uow, ready.nodes)
            if allocation_id not in running
        ]
        for allocation_id, job_id in lost:
            stopped = WorkloadStopped(
                allocation_id=allocation_id,
                job_id=job_id,
                reason=StopReason.INTERRUPTED,
                stopped_at=min(ready.time, utcnow()),
            )
            await self._stopped(uow, envelope, ledger, stopped)
        await uow.audit(
            "agent.ready",
            entity=ready.agent_id,
            reason=f"the cluster agent (re)started on {len(ready.nodes)} node(s) running "
            f"{len(running)} workload(s)"
            + (f"; {len(lost)} started workload(s) it lost are interrupted" if lost else ""),
            details={
                "nodes": ready.nodes,
                "running": sorted(running),
                "interrupted": [allocation_id for allocation_id, _ in lost],
            },
            causation_id=envelope.id,
        )

    async def on_workload_stopped(self, envelope: Envelope, uow: UnitOfWork) -> None:
        stopped = envelope.payload(WorkloadStopped)
        ledger = await self._keeper.hold(uow)
        await self._stopped(uow, envelope, ledger, stopped)

    async def _stopped(
        self, uow: UnitOfWork, envelope: Envelope, ledger: d.Ledger, stopped: WorkloadStopped
    ) -> None:
        held = await self._allocation_of(uow, stopped.allocation_id, stopped.job_id)
        if not held.live:
            await uow.audit(
                "allocation.release_ignored",
                entity=stopped.job_id,
                reason=f"allocation {stopped.allocation_id} was already released "
                f"({held.release_reason})",
                details={"allocation_id": stopped.allocation_id, "reason": stopped.reason},
                causation_id=envelope.id,
            )
            return
        now = utcnow()
        granted_at = held.allocation.granted_at
        # The agent's clock may run apart from ours: never before the grant or after now.
        released_at = max(min(stopped.stopped_at, now), granted_at)
        released = ledger.release(stopped.allocation_id, released_at)
        await store.release_allocation(uow, released.allocation_id, released_at, stopped.reason)
        await self._keeper.save(uow, released.gpus)
        await uow.emit(
            uow.subjects.event(uow.source, T.ALLOCATION_RELEASED),
            T.ALLOCATION_RELEASED,
            wire.allocation_released(released, stopped.reason, ledger),
            correlation_id=stopped.job_id,
            causation_id=envelope.id,
        )
        await uow.audit(
            "allocation.released",
            entity=stopped.job_id,
            reason=f"workload {stopped.reason}",
            details={
                "allocation_id": released.allocation_id,
                "gpus": [str(ref) for ref in released.gpus],
                "kept_for_inference": [str(ref) for ref in released.kept_for_inference],
                "exit_code": stopped.exit_code,
                "saga_id": stopped.saga_id,
            },
            causation_id=envelope.id,
        )
        # The allocation is released whatever happens next: the workload did stop. What
        # that means for the job is settled in a savepoint; if that fails for a reason
        # of the job's own, the job is parked (an agent restart settles many in a row).
        await requeue_or_park(
            uow, stopped.job_id, now, lambda: self._settle(uow, envelope, stopped, held, now)
        )
        self._kick()

    async def _settle(
        self,
        uow: UnitOfWork,
        envelope: Envelope,
        stopped: WorkloadStopped,
        held: store.AllocationRecord,
        now: datetime,
    ) -> float:
        if await cancel.settle_cancelled(
            uow, stopped.job_id, stopped.allocation_id, now, envelope.id
        ):
            return 0.0
        if stopped.reason is StopReason.INTERRUPTED:
            # Not the job's fault: like a node failure, for this one allocation.
            node = held.allocation.gpus[0].node if held.allocation.gpus else "?"
            return await requeue_lost(
                uow, held.allocation, node, now, envelope.id,
                cause=f"its workload on node {node} was interrupted (the cluster agent stopped)",
            )  # fmt: skip
        await self._settle_stopped_job(uow, envelope, stopped, held, now)
        return 0.0

    async def _settle_stopped_job(
        self,
        uow: UnitOfWork,
        envelope: Envelope,
        stopped: WorkloadStopped,
        held: store.AllocationRecord,
        now: datetime,
    ) -> None:
        job = await store.job(uow, stopped.job_id)
        assert job is not None  # allocations reference their job
        if job.spec.replicas is not None:
            ran_for = max(min(stopped.stopped_at, now) - held.allocation.granted_at, timedelta())
            await replicas.settle_stopped(
                uow, job, stopped, envelope.id, now, ran_for, self._backoff
            )
            return
        if job.allocation_id != stopped.allocation_id:
            return  # an older attempt's allocation; the job has moved on
        if stopped.reason in _STOPPED_STATE:
            state = _STOPPED_STATE[stopped.reason]
            reason = f"workload {stopped.reason} (exit code {stopped.exit_code})"
        elif held.eviction_outcome is not None or stopped.saga_id is None:
            # The saga's outcome is in (or no saga evicted it, e.g. a node drain, and
            # none will report): back to the queue with the checkpoint we know.
            state = JobState.QUEUED
            reason = "evicted; requeued to resume from its checkpoint"
        else:
            state = JobState.PREEMPTED
            reason = f"evicted by saga {stopped.saga_id}; requeued when its outcome arrives"
        await store.set_job_state(uow, job.job_id, state, now)
        await uow.audit(
            _STATE_ACTION[state],
            entity=job.job_id,
            reason=reason,
            details={
                "allocation_id": stopped.allocation_id,
                "attempt": job.attempt,
                "resume_from": _checkpoint_id(job.resume_from),
            },
            causation_id=envelope.id,
        )

    # --- eviction saga outcomes (checkpoint service) ------------------------------------

    async def on_eviction_completed(self, envelope: Envelope, uow: UnitOfWork) -> None:
        done = envelope.payload(EvictionCompleted)
        await self._settle_eviction(
            uow, envelope, EvictionOutcome.COMPLETED, done.saga_id, done.allocation_id,
            done.job_id, done.checkpoint,
        )  # fmt: skip

    async def on_eviction_forced(self, envelope: Envelope, uow: UnitOfWork) -> None:
        forced = envelope.payload(EvictionForced)
        await self._settle_eviction(
            uow, envelope, EvictionOutcome.FORCED, forced.saga_id, forced.allocation_id,
            forced.job_id, forced.checkpoint,
        )  # fmt: skip

    async def _settle_eviction(
        self,
        uow: UnitOfWork,
        envelope: Envelope,
        outcome: EvictionOutcome,
        saga_id: str,
        allocation_id: str,
        job_id: str,
        checkpoint: CheckpointInfo | None,
    ) -> None:
        await self._keeper.hold(uow)
        held = await self._allocation_of(uow, allocation_id, job_id)
        if held.eviction_outcome is not None:
            await uow.audit(
                "eviction.ignored",
                entity=job_id,
                reason=f"allocation {allocation_id} already has outcome {held.eviction_outcome}",
                details={"saga_id": saga_id, "outcome": outcome},
                causation_id=envelope.id,
            )
            return
        await store.record_eviction_outcome(uow, allocation_id, outcome, saga_id)
        job = await store.job(uow, job_id)
        assert job is not None  # allocations reference their job
        now = utcnow()
        # The checkpoint belongs to this attempt; a later attempt has its own progress.
        current = job.attempt == held.attempt
        if current and checkpoint is not None:
            await store.set_resume_from(uow, job_id, checkpoint, now)
        resume_from = checkpoint if current and checkpoint is not None else job.resume_from
        details = {
            "allocation_id": allocation_id,
            "saga_id": saga_id,
            "outcome": outcome,
            "resume_from": _checkpoint_id(resume_from),
        }
        if current and job.state is JobState.PREEMPTED:
            await store.set_job_state(uow, job_id, JobState.QUEUED, now)
            await uow.audit(
                "job.requeued",
                entity=job_id,
                reason=f"eviction {outcome}; resumes from "
                f"{_checkpoint_id(resume_from) or 'the start (no checkpoint)'}",
                details=details,
                causation_id=envelope.id,
            )
            self._kick()
        elif held.live:
            await uow.audit(
                "eviction.recorded",
                entity=job_id,
                reason=f"eviction {outcome}; the job is requeued once its workload stops",
                details=details,
                causation_id=envelope.id,
            )
        else:
            await uow.audit(
                "eviction.recorded",
                entity=job_id,
                reason=f"eviction {outcome} after the job was already {job.state}",
                details=details,
                causation_id=envelope.id,
            )

    async def on_eviction_aborted(self, envelope: Envelope, uow: UnitOfWork) -> None:
        aborted = envelope.payload(EvictionAborted)
        await self._keep_gpus(
            uow, envelope, "job.eviction_aborted", aborted.allocation_id, aborted.job_id,
            aborted.saga_id, f"{aborted.reason}; the job keeps its GPUs",
        )  # fmt: skip

    async def on_eviction_cancelled(self, envelope: Envelope, uow: UnitOfWork) -> None:
        cancelled = envelope.payload(EvictionCancelled)
        await self._keep_gpus(
            uow, envelope, "job.eviction_cancelled", cancelled.allocation_id, cancelled.job_id,
            cancelled.saga_id, f"{cancelled.reason}; the job keeps its GPUs",
        )  # fmt: skip

    async def _keep_gpus(
        self,
        uow: UnitOfWork,
        envelope: Envelope,
        action: str,
        allocation_id: str,
        job_id: str,
        saga_id: str,
        reason: str,
    ) -> None:
        """The victim keeps running, so the reservation waiting for its GPUs is lifted:
        when it ends they go back to training, not to inference. (If the controller still
        needs GPUs it reserves another victim's.)"""
        ledger = await self._keeper.hold(uow)
        held = await store.allocation(uow, allocation_id)
        waiting: tuple[d.GpuRef, ...] = ()
        if held is not None and held.live and allocation_id in ledger.allocations:
            waiting = tuple(
                ref
                for ref in ledger.allocation(allocation_id).gpus
                if ledger.gpu(ref).reserved_for is not None
            )
        if waiting:
            await self._keeper.return_lent(
                uow, waiting, causation_id=envelope.id, correlation_id=saga_id
            )
        await uow.audit(
            action,
            entity=job_id,
            reason=reason
            + (f"; {len(waiting)} GPUs no longer reserved for inference" if waiting else ""),
            details={
                "allocation_id": allocation_id,
                "saga_id": saga_id,
                "unreserved": [str(ref) for ref in waiting],
            },
            causation_id=envelope.id,
        )

    async def _allocation_of(
        self, uow: UnitOfWork, allocation_id: str, job_id: str
    ) -> store.AllocationRecord:
        held = await store.allocation(uow, allocation_id)
        if held is None:
            raise Rejected(f"unknown allocation {allocation_id!r}")
        if held.allocation.job_id != job_id:
            raise Rejected(
                f"allocation {allocation_id!r} belongs to job {held.allocation.job_id!r}, "
                f"not {job_id!r}"
            )
        return held


_STATE_ACTION = {
    JobState.COMPLETED: "job.completed",
    JobState.FAILED: "job.failed",
    JobState.QUEUED: "job.requeued",
    JobState.PREEMPTED: "job.preempted",
}


async def _audit_repeat(
    uow: UnitOfWork, envelope: Envelope, decision_id: str, reservation_id: str
) -> None:
    await uow.audit(
        "ledger.command_ignored",
        entity=reservation_id,
        reason=f"decision {decision_id} was already applied",
        details={"type": envelope.type, "decision_id": decision_id},
        causation_id=envelope.id,
    )


def _not_waiting(job: store.JobRecord) -> list[str]:
    if job.state is JobState.HELD:
        return [
            f"held for approval: {job.priority_class} is above team {job.spec.team}'s max "
            "priority class; an operator runs `gpusched approve "
            f"{job.job_id}` (or resubmit with a lower class)"
        ]
    if job.state is JobState.RUNNING:
        return [f"not waiting: running as allocation {job.allocation_id}"]
    if job.state is JobState.PREEMPTED:
        return ["evicted: requeued once its eviction saga reports the checkpoint to resume from"]
    if job.state is JobState.PARKED:
        return [
            f"parked: {job.parked_reason or 'the scheduler set it aside'}",
            f"it is not placed: an operator retries it with `gpusched approve {job.job_id}` "
            f"or removes it with `gpusched cancel {job.job_id}`",
        ]
    if job.state is JobState.CANCELLING:
        return [f"{job.cancel_reason or 'cancelled'}; its workloads are being stopped"]
    return [f"not waiting: the job is {job.state}"]


def _checkpoint_id(checkpoint: CheckpointInfo | None) -> str | None:
    return None if checkpoint is None else checkpoint.checkpoint_id


def _unreadable_view(row: Any) -> JobView:
    """What can be shown of a job whose stored spec does not parse: its columns, and
    the spec's GPU request if that part still parses."""
    spec = row.spec if isinstance(row.spec, dict) else {}
    try:
        gpus = GpuRequest.model_validate(spec.get("gpus"))
    except ValidationError:
        gpus = GpuRequest.model_construct(count=0)
    return JobView.model_construct(
        job_id=row.job_id,
        name=row.name,
        team=row.team,
        kind=_member(JobKind, row.kind),
        priority_class=_member(PriorityClassName, row.priority_class),
        state=row.state,
        attempt=row.attempt,
        gpus=gpus,
        allocation_id=row.allocation_id,
        allocated=[],
        resume_from=None,
        latest_checkpoint=None,
        submitted_at=row.submitted_at,
        warnings=[
            "the stored job spec cannot be read; only its columns are shown",
            *(str(w) for w in row.warnings or ()),
        ],
        share=None,
        reservation=None,
        replicas=None,
        parked_reason=row.parked_reason,
    )


def _member(enum: type[StrEnum], value: str) -> Any:
    """The enum member named by a stored column, or the text itself if it names none."""
    try:
        return enum(value)
    except ValueError:
        return value


def _unreadable_words(row: Any, exc: store.UnreadableJob) -> list[str]:
    if row.state == JobState.PARKED:
        return [
            f"parked: {row.parked_reason or exc}",
            f"it is not placed: remove it with `gpusched cancel {row.job_id}`",
        ]
    return [f"{exc}; the next scheduling pass parks it"]
