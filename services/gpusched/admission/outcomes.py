"""Outcome handlers: what the cluster agent and the eviction sagas report back.

Every handler parses its payload first (a malformed one is dead-lettered before
anything is touched), then holds the ledger (see keeper) for the rest of its
transaction: job states and GPU slots change only under that lock, so a release and
the eviction outcome of the same allocation never race, whatever order they arrive in.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta

from gpusched.contracts.envelope import Envelope, utcnow
from gpusched.contracts.messages import (
    AgentReady,
    CheckpointInfo,
    EvictionAborted,
    EvictionCancelled,
    EvictionCompleted,
    EvictionForced,
    MigConfigured,
    MigConfigureFailed,
    StopReason,
    T,
    WorkloadStarted,
    WorkloadStopped,
)
from gpusched.domain import ledger as d
from gpusched.infra.db import UnitOfWork
from gpusched.infra.errors import Rejected

from . import cancel, lending, mig, replicas, store, wire
from .keeper import LedgerKeeper
from .nodes import requeue_lost, requeue_or_park
from .queue import Clock, EvictionOutcome, JobState

_STOPPED_STATE = {
    StopReason.COMPLETED: JobState.COMPLETED,
    StopReason.FAILED: JobState.FAILED,
}


class Outcomes:
    def __init__(
        self,
        keeper: LedgerKeeper,
        kick: Callable[[], None],
        backoff: replicas.Backoff = replicas.DEFAULT_BACKOFF,
        clock: Clock = utcnow,
    ) -> None:
        self._keeper = keeper
        self._kick = kick
        self._backoff = backoff
        self._clock = clock

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
                stopped_at=min(ready.time, self._clock()),
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
        now = self._clock()
        granted_at = held.allocation.granted_at
        # The agent's clock may run apart from ours: never before the grant or after now.
        released_at = max(min(stopped.stopped_at, now), granted_at)
        released = ledger.release(stopped.allocation_id, released_at)
        await store.release_allocation(uow, released.allocation_id, released_at, stopped.reason)
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
            node = held.allocation.nodes[0] if held.allocation.nodes else "?"
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
        if job.replicas is not None:
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
        now = self._clock()
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
        if held is not None and held.live:
            waiting = lending.waiting_for(ledger, allocation_id)
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


def _checkpoint_id(checkpoint: CheckpointInfo | None) -> str | None:
    return None if checkpoint is None else checkpoint.checkpoint_id
