"""The service layer of the eviction saga: messages in, saga decisions, outbox out.

Every input follows one recipe: lock the saga row, fold the input with the pure
`saga.decide`, store the new saga, turn each effect into an outbox message and write
one audit record per state the saga entered. A late, duplicate or foreign input
(IllegalTransition / ForeignMessage) is audited as `saga.input_ignored` and acked:
it is normal life on an at-least-once bus, not a dead letter.

Job events name their job by the envelope's correlation id (the SDK sets it to the job
id); job.completed/failed may instead carry it only in their payload. Handlers see
envelopes, not subjects: the edge (`validation.check_subject`) has already refused a
job event whose correlation id or job_id is not the job of the events subject it came
on, so a job can speak only for itself (its credentials name only its own subject).

A claim counts only if storage confirms it, or if its URI's scheme is one the service
cannot read and the deployment trusts for the job's priority class (TrustPolicy). The
class comes from admission's grants and the eviction requests, never from the claim.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from itertools import pairwise
from typing import Any, Final
from weakref import WeakKeyDictionary

from gpusched.checkpoint import metrics, store
from gpusched.checkpoint.api import checkpoint_info
from gpusched.checkpoint.policy import EvictionPolicies, TrustPolicy
from gpusched.checkpoint.storage import CheckpointStorage, FsspecStorage
from gpusched.checkpoint.verification import (
    ClaimCheck,
    MalformedUri,
    Verdict,
    judge_unverifiable,
    uri_scheme,
)
from gpusched.contracts import messages as wire
from gpusched.contracts.envelope import Envelope, utcnow
from gpusched.contracts.errors import MalformedMessage
from gpusched.contracts.messages import T
from gpusched.contracts.subjects import check_token
from gpusched.domain.saga import (
    TERMINAL_STATES,
    CheckpointConfirmed,
    CheckpointFailed,
    CheckpointRef,
    DeadlineReached,
    Decision,
    EmitEvictionAborted,
    EmitEvictionCancelled,
    EmitEvictionCompleted,
    EmitEvictionForced,
    EvictFailed,
    ForeignMessage,
    IllegalTransition,
    JobFinished,
    NeedWithdrawn,
    Outcome,
    Saga,
    SagaEffect,
    SagaInput,
    SagaState,
    SendCheckpointRequest,
    SendEvict,
    SendPreemptionCancelled,
    Stage,
    WorkloadStopped,
    begin,
    decide,
)
from gpusched.infra.db import UnitOfWork

SERVICE: Final = "checkpoint"
# Saga ids derive from the request id, so the same request always names the same saga.
_SAGA_NAMESPACE: Final = uuid.UUID("6f1c3e52-5b0e-4d8e-9a57-1f3c2b7d9e10")


class AuditAction(StrEnum):
    CHECKPOINT_REQUESTED = "checkpoint.requested"
    CHECKPOINT_CONFIRMED = "checkpoint.confirmed"
    CHECKPOINT_RECORDED = "checkpoint.recorded"
    CHECKPOINT_UNVERIFIED = "checkpoint.unverified"
    CHECKPOINT_TRUSTED = "checkpoint.trusted"
    CHECKPOINT_RETIRED = "checkpoint.retired"
    EVICT = "evict"
    WORKLOAD_EVICTED = "workload.evicted"
    EVICTION_COMPLETED = "eviction.completed"
    EVICTION_ABORTED = "eviction.aborted"
    EVICTION_FORCED = "eviction.forced"
    EVICTION_CANCELLED = "eviction.cancelled"
    SAGA_UPDATED = "saga.updated"
    INPUT_IGNORED = "saga.input_ignored"


# The action recorded when a saga enters a state on its way, and when it ends (by why
# it ended: a job that finished on its own completes the saga but cancels the eviction).
_ENTERED: Final[Mapping[SagaState, AuditAction]] = {
    SagaState.CHECKPOINTING: AuditAction.CHECKPOINT_REQUESTED,
    SagaState.CONFIRMED: AuditAction.CHECKPOINT_CONFIRMED,
    SagaState.EVICTING: AuditAction.EVICT,
    SagaState.EVICTED: AuditAction.WORKLOAD_EVICTED,
}
_ENDED: Final[Mapping[Outcome, AuditAction]] = {
    Outcome.EVICTED: AuditAction.EVICTION_COMPLETED,
    Outcome.JOB_FINISHED: AuditAction.EVICTION_CANCELLED,
    Outcome.NEED_WITHDRAWN: AuditAction.EVICTION_CANCELLED,
    Outcome.DEADLINE_ABORTED: AuditAction.EVICTION_ABORTED,
    Outcome.CHECKPOINT_FAILED_ABORTED: AuditAction.EVICTION_ABORTED,
    Outcome.EVICT_FAILED: AuditAction.EVICTION_ABORTED,
    Outcome.DEADLINE_FORCED: AuditAction.EVICTION_FORCED,
    Outcome.CHECKPOINT_FAILED_FORCED: AuditAction.EVICTION_FORCED,
}


@dataclass(frozen=True)
class Claim:
    """A job's checkpoint claim as read from its checkpoint.confirmed, with the verdict
    reached without the database: storage's, or `malformed` (then `scheme` is None);
    None where storage cannot read the scheme (the job's class and the trust decide)."""

    message_id: str
    job_id: str
    request_id: str | None
    ref: CheckpointRef
    kind: wire.CheckpointKind
    scheme: str | None
    verdict: Verdict | None


def saga_id_for(request_id: str) -> str:
    return str(uuid.uuid5(_SAGA_NAMESPACE, request_id))


class SagaHandlers:
    def __init__(
        self,
        policies: EvictionPolicies,
        clock: Callable[[], datetime] = utcnow,
        *,
        storage: CheckpointStorage | None = None,
        trust: TrustPolicy | None = None,
        retention_per_job: int = 5,
    ) -> None:
        self._policies = policies
        self._now = clock
        self._storage: CheckpointStorage = FsspecStorage() if storage is None else storage
        self._trust = TrustPolicy({}) if trust is None else trust
        self._retention = retention_per_job

    # --- a batch of messages sharing one transaction ----------------------------------------

    async def prepare(self, envelopes: Sequence[Envelope], uow: UnitOfWork) -> None:
        """The consumers' prepare hook (bus.Consumer.prepare): before a batch's handlers,
        lock every saga they will read and find every latest checkpoint they will ask
        for in one statement (store.lock_for_batch), while storage is read for all of
        its claims at once rather than one after another. A message whose payload cannot
        be read here is left to its handler, which says why."""
        saga_ids: set[str] = set()
        requests: set[str] = set()
        live_jobs: set[str] = set()
        job_requests: set[tuple[str, str]] = set()
        latest_of: set[str] = set()
        claims: list[Envelope] = []
        for envelope in envelopes:
            try:
                _what_it_reads(
                    envelope, saga_ids, requests, live_jobs, job_requests, latest_of, claims
                )
            except MalformedMessage:
                continue
        read = _CLAIMS.setdefault(uow, {})

        async def read_claim(envelope: Envelope) -> None:
            # Whatever goes wrong here, the handler reads the claim again and meets it
            # there; only the statement below may fail the batch (nothing else here
            # uses its connection).
            with contextlib.suppress(Exception):
                read[envelope.id] = await self.read_claim(envelope)

        await asyncio.gather(
            *(read_claim(envelope) for envelope in claims),
            store.lock_for_batch(
                uow,
                saga_ids=saga_ids,
                requests=requests,
                live_jobs=live_jobs,
                job_requests=job_requests,
                latest_of=latest_of,
            ),
        )

    # --- commands from preemption ---------------------------------------------------------

    async def on_eviction_requested(self, envelope: Envelope, uow: UnitOfWork) -> None:
        request = envelope.payload(wire.EvictionRequested)
        _require_token(request.job_id, "job id")
        now = self._now()
        known, latest = await store.lock_request_and_latest(uow, request.request_id, request.job_id)
        if known is not None:
            why = "the request has a saga already"
            await _ignored(uow, known, "EvictionRequested", why, envelope.id)
            return
        try:
            saga, effects = begin(
                self._policies.begin(
                    saga_id=saga_id_for(request.request_id),
                    request_id=request.request_id,
                    allocation_id=request.allocation_id,
                    job_id=request.job_id,
                    gpus=request.gpus,
                    started_at=request.started_at,
                    priority_class=request.priority_class.value,
                    reason=request.reason,
                    latest=None if latest is None else (latest.checkpoint, latest.confirmed_at),
                    share_milli=request.share_milli,
                ),
                now,
            )
        except ValueError as exc:  # e.g. a started_at without a time zone
            raise MalformedMessage(f"{envelope.type}: {exc}") from exc
        # The job's class is remembered with the insert (one round trip), saga or not.
        job_class = (request.priority_class.value, now, request.team)
        if not await store.insert_saga(uow, saga, job_class):
            # The partial unique index said no: the allocation has a live saga (or a
            # replica applying another copy of this request inserted it first).
            live = await store.find_live_by_allocation(uow, request.allocation_id)
            why = "the allocation already has a live eviction saga"
            await uow.audit(
                AuditAction.INPUT_IGNORED,
                entity=live.saga_id if live is not None else request.request_id,
                reason=f"eviction request {request.request_id} ignored: {why}",
                details={
                    "input": "EvictionRequested",
                    "request_id": request.request_id,
                    "allocation_id": request.allocation_id,
                    "job_id": request.job_id,
                    "live_saga_id": None if live is None else live.saga_id,
                    "live_request_id": None if live is None else live.request_id,
                },
                causation_id=envelope.id,
            )
            return
        started = Decision(
            saga=saga,
            effects=tuple(effects),
            note=(
                f"REQUESTED->CHECKPOINTING: asked job {saga.job_id} for a "
                f"{saga.stage_required.value} checkpoint by {saga.deadline.isoformat()} "
                f"({saga.reason}); on deadline: {saga.policy.value}"
            ),
            path=(SagaState.CHECKPOINTING,),
        )
        await _carry_out(uow, SagaState.REQUESTED, started, "EvictionRequested", envelope.id)

    async def on_eviction_withdrawn(self, envelope: Envelope, uow: UnitOfWork) -> None:
        withdrawn = envelope.payload(wire.EvictionWithdrawn)
        saga = await store.lock_by_request(uow, withdrawn.request_id)
        if saga is None:
            await uow.audit(
                AuditAction.INPUT_IGNORED,
                entity=withdrawn.request_id,
                reason="withdrawal of an eviction request that has no saga",
                details={"input": "NeedWithdrawn", "request_id": withdrawn.request_id},
                causation_id=envelope.id,
            )
            return
        await self._apply(uow, saga, NeedWithdrawn(withdrawn.request_id), envelope.id)

    # --- admission's grants: each job's priority class ---------------------------------

    async def on_allocation_granted(self, envelope: Envelope, uow: UnitOfWork) -> None:
        granted = envelope.payload(wire.AllocationGranted)
        job_id = _require_token(granted.job_id, "job id")
        await store.remember_class(
            uow, job_id, granted.priority_class.value, self._now(), granted.team
        )

    # --- job events -----------------------------------------------------------------------

    async def on_checkpoint_confirmed(self, envelope: Envelope, uow: UnitOfWork) -> None:
        claim = _CLAIMS.get(uow, {}).pop(envelope.id, None)  # read by `prepare`
        if claim is None:
            claim = await self.read_claim(envelope)
        await self.apply_claim(claim, uow)

    async def read_claim(self, envelope: Envelope) -> Claim:
        """A checkpoint.confirmed and what storage says of its claim, without the
        database: storage is read (up to the verification budget, never longer) before
        any saga row is locked; `apply_claim` then judges and applies it."""
        confirmed = envelope.payload(wire.CheckpointConfirmed)
        job_id = _job_of(envelope)
        ref = CheckpointRef(
            checkpoint_id=confirmed.checkpoint_id,
            step=confirmed.step,
            uri=confirmed.uri,
            bytes=confirmed.bytes,
            sha256=confirmed.sha256,
            stage=Stage(confirmed.stage.value),
        )
        scheme: str | None
        verdict: Verdict | None
        try:
            scheme = uri_scheme(ref.uri)
        except MalformedUri as exc:
            scheme, verdict = None, Verdict(ClaimCheck.MALFORMED, str(exc))
        else:
            verdict = await self._storage.verify(ref, confirmed.kind)
        return Claim(
            envelope.id, job_id, confirmed.request_id, ref, confirmed.kind, scheme, verdict
        )

    async def apply_claim(self, claim: Claim, uow: UnitOfWork) -> None:
        """Catalogue and apply a claim storage was read for (`read_claim`), or audit why
        it does not count."""
        job_id, ref = claim.job_id, claim.ref
        verdict, facts = await self._judge(uow, claim)
        uow.on_commit(lambda: metrics.claim_judged(verdict.check))
        now = self._now()
        sagas = await store.lock_live_by_job(uow, job_id, claim.request_id)
        if not verdict.counts:
            # Not catalogued (a resume must not load it) and not applied: the saga keeps
            # waiting, and its deadline decides if no true confirmation follows.
            await _unverified(
                uow, job_id, claim.request_id, ref, verdict, facts, sagas, claim.message_id
            )
            return
        catalogued = await store.record_checkpoint(uow, job_id, claim.request_id, ref, now)
        if catalogued is not None:
            await _announce(
                uow, job_id, claim.request_id, ref, verdict, facts, now, claim.message_id
            )
            if catalogued > self._retention:
                await self._retire_old_checkpoints(uow, job_id, claim.message_id)
        event = CheckpointConfirmed(claim.request_id, job_id, ref)
        for saga in sagas:
            await self._apply(uow, saga, event, claim.message_id, now)

    async def _judge(self, uow: UnitOfWork, claim: Claim) -> tuple[Verdict, dict[str, str | None]]:
        """The verdict on a claim, and what it rests on for the audit record: the URI's
        scheme and (unless storage checked it) the job's priority class."""
        if claim.scheme is None:
            assert claim.verdict is not None  # the malformed URI's
            priority_class = await store.class_of(uow, claim.job_id)
            return claim.verdict, {"scheme": None, "priority_class": priority_class}
        if claim.verdict is not None:
            return claim.verdict, {"scheme": claim.scheme, "kind": claim.kind.value}
        priority_class = await store.class_of(uow, claim.job_id)
        trusted = self._trust.trusts(priority_class, claim.scheme)
        verdict = judge_unverifiable(claim.job_id, claim.scheme, priority_class, trusted)
        return verdict, {"scheme": claim.scheme, "priority_class": priority_class}

    async def _retire_old_checkpoints(
        self, uow: UnitOfWork, job_id: str, causation_id: str
    ) -> None:
        retired = await store.retire_checkpoints(uow, job_id, self._retention)
        if retired:
            await uow.audit(
                AuditAction.CHECKPOINT_RETIRED,
                entity=job_id,
                reason=(
                    f"catalogue keeps the newest {self._retention} checkpoints of job {job_id} "
                    "and any a saga references"
                ),
                details={"job_id": job_id, "retired": retired},
                causation_id=causation_id,
            )

    async def on_checkpoint_failed(self, envelope: Envelope, uow: UnitOfWork) -> None:
        failed = envelope.payload(wire.CheckpointFailed)
        job_id = _job_of(envelope)
        event = CheckpointFailed(failed.request_id, job_id, failed.error)
        for saga in await store.lock_live_by_job(uow, job_id, failed.request_id):
            await self._apply(uow, saga, event, envelope.id)

    async def on_job_completed(self, envelope: Envelope, uow: UnitOfWork) -> None:
        completed = envelope.payload(wire.JobCompleted)
        await self._job_finished(envelope, uow, _job_of(envelope, completed.job_id), True)

    async def on_job_failed(self, envelope: Envelope, uow: UnitOfWork) -> None:
        failed = envelope.payload(wire.JobFailed)
        await self._job_finished(envelope, uow, _job_of(envelope, failed.job_id), False)

    async def _job_finished(
        self, envelope: Envelope, uow: UnitOfWork, job_id: str, succeeded: bool
    ) -> None:
        for saga in await store.lock_live_by_job(uow, job_id):
            await self._apply(uow, saga, JobFinished(job_id, succeeded), envelope.id)

    # --- cluster agent results ------------------------------------------------------------

    async def on_workload_stopped(self, envelope: Envelope, uow: UnitOfWork) -> None:
        stopped = envelope.payload(wire.WorkloadStopped)
        if stopped.saga_id is not None:
            saga = await store.lock_saga(uow, stopped.saga_id)
        else:
            # Most workloads stop without any eviction: no live saga, nothing to do.
            saga = await store.lock_live_by_allocation(uow, stopped.allocation_id)
        if saga is not None:
            event = WorkloadStopped(stopped.allocation_id, stopped.reason.value)
            await self._apply(uow, saga, event, envelope.id)

    async def on_evict_failed(self, envelope: Envelope, uow: UnitOfWork) -> None:
        failed = envelope.payload(wire.EvictFailed)
        saga = await store.lock_saga(uow, failed.saga_id)
        if saga is not None:
            event = EvictFailed(failed.allocation_id, failed.error)
            await self._apply(uow, saga, event, envelope.id)

    # --- the deadline timer ---------------------------------------------------------------

    async def sweep(self, uow: UnitOfWork, limit: int) -> int:
        """Apply DeadlineReached to up to `limit` overdue sagas; how many were due."""
        # The service clock both set the deadlines and judges them, so the query takes
        # it as a parameter rather than trusting the database's now().
        now = self._now()
        due = await store.lock_due(uow, now, limit)
        for saga in due:
            await self._apply(uow, saga, DeadlineReached(now), None, now)
        return len(due)

    # --- the recipe -----------------------------------------------------------------------

    async def _apply(
        self,
        uow: UnitOfWork,
        saga: Saga,
        event: SagaInput,
        causation_id: str | None,
        now: datetime | None = None,
    ) -> None:
        name = type(event).__name__
        try:
            decision = decide(saga, event, now or self._now())
        except (IllegalTransition, ForeignMessage) as exc:
            await _ignored(uow, saga, name, str(exc), causation_id)
            return
        await store.save_saga(uow, decision.saga)
        await _carry_out(uow, saga.state, decision, name, causation_id)


async def _carry_out(
    uow: UnitOfWork,
    before: SagaState,
    decision: Decision,
    input_name: str,
    causation_id: str | None,
) -> None:
    saga = decision.saga
    if saga.state in TERMINAL_STATES and before not in TERMINAL_STATES:
        uow.on_commit(lambda: metrics.saga_ended(saga))
    trace = await store.saga_trace(uow, saga.saga_id) if decision.effects else None
    for effect in decision.effects:
        await _emit(uow, saga, effect, causation_id, trace)
    details = {
        "input": input_name,
        "effects": [type(effect).__name__ for effect in decision.effects],
        **_describe(saga),
    }
    if not decision.path:
        # No state entered, but the saga still changed (or chose to keep waiting).
        if any(isinstance(effect, SendEvict) for effect in decision.effects):
            action = AuditAction.EVICT  # a retry after a failed eviction
        elif input_name == CheckpointConfirmed.__name__:
            action = AuditAction.CHECKPOINT_RECORDED
        else:
            action = AuditAction.SAGA_UPDATED
        await uow.audit(
            action,
            entity=saga.saga_id,
            reason=decision.note,
            details={**details, "from": before.value, "to": before.value},
            causation_id=causation_id,
        )
        return
    for source, entered in pairwise((before, *decision.path)):
        action = _ENDED[_outcome(saga)] if entered in TERMINAL_STATES else _ENTERED[entered]
        await uow.audit(
            action,
            entity=saga.saga_id,
            reason=decision.note,
            details={**details, "from": source.value, "to": entered.value},
            causation_id=causation_id,
        )


def _outcome(saga: Saga) -> Outcome:
    if saga.outcome is None:
        raise AssertionError(f"saga {saga.saga_id} ended in {saga.state} without an outcome")
    return saga.outcome


async def _emit(
    uow: UnitOfWork,
    saga: Saga,
    effect: SagaEffect,
    causation_id: str | None,
    trace: dict[str, str] | None,
) -> None:
    s = uow.subjects
    ids = {"saga_id": saga.saga_id, "request_id": saga.request_id}
    subject: str
    message_type: T
    payload: wire.Wire
    match effect:
        case SendCheckpointRequest():
            subject, message_type = s.job_control(effect.job_id), T.CHECKPOINT_REQUESTED
            payload = wire.CheckpointRequested(
                request_id=effect.request_id,
                job_id=effect.job_id,
                reason=effect.reason,
                deadline=effect.deadline,
                stage_required=wire.StageName(effect.stage_required.value),
            )
        case SendEvict():
            subject, message_type = s.command("agent", T.EVICT_WORKLOAD), T.EVICT_WORKLOAD
            payload = wire.EvictWorkload(
                allocation_id=effect.allocation_id,
                job_id=effect.job_id,
                saga_id=saga.saga_id,
                forced=effect.forced,
            )
        case SendPreemptionCancelled():
            subject, message_type = s.job_control(effect.job_id), T.PREEMPTION_CANCELLED
            payload = wire.PreemptionCancelled(request_id=effect.request_id)
        case EmitEvictionCompleted():
            subject, message_type = s.event(SERVICE, T.EVICTION_COMPLETED), T.EVICTION_COMPLETED
            payload = wire.EvictionCompleted(
                **ids,
                allocation_id=effect.allocation_id,
                job_id=effect.job_id,
                checkpoint=checkpoint_info(effect.checkpoint),
            )
        case EmitEvictionAborted():
            subject, message_type = s.event(SERVICE, T.EVICTION_ABORTED), T.EVICTION_ABORTED
            payload = wire.EvictionAborted(
                **ids,
                allocation_id=effect.allocation_id,
                job_id=effect.job_id,
                reason=effect.reason.value,
            )
        case EmitEvictionForced():
            subject, message_type = s.event(SERVICE, T.EVICTION_FORCED), T.EVICTION_FORCED
            payload = wire.EvictionForced(
                **ids,
                allocation_id=effect.allocation_id,
                job_id=effect.job_id,
                lost_gpu_seconds=effect.lost_gpu_seconds,
                checkpoint=checkpoint_info(effect.last_checkpoint),
            )
        case EmitEvictionCancelled():
            subject, message_type = s.event(SERVICE, T.EVICTION_CANCELLED), T.EVICTION_CANCELLED
            payload = wire.EvictionCancelled(
                **ids,
                allocation_id=effect.allocation_id,
                job_id=effect.job_id,
                reason=effect.reason.value,
            )
    await uow.emit(
        subject,
        message_type,
        payload,
        correlation_id=saga.saga_id,
        causation_id=causation_id,
        trace_headers=trace,
    )


async def _announce(
    uow: UnitOfWork,
    job_id: str,
    request_id: str | None,
    checkpoint: CheckpointRef,
    verdict: Verdict,
    facts: Mapping[str, str | None],
    confirmed_at: datetime,
    causation_id: str,
) -> None:
    """Tell the rest of the system about a catalogued checkpoint, in the transaction that
    catalogues it: only the first cataloguing of a checkpoint at a stage announces it, so
    a redelivered or repeated claim is announced once. Admission (resume, `jobs.get`) and
    preemption (lost work, victim choice) follow this event, never the job's raw claims."""
    await uow.emit(
        uow.subjects.event(SERVICE, T.CHECKPOINT_VERIFIED),
        T.CHECKPOINT_VERIFIED,
        wire.CheckpointVerified(
            job_id=job_id,
            request_id=request_id,
            checkpoint=_info(checkpoint),
            confirmed_at=confirmed_at,
        ),
        correlation_id=job_id,
        causation_id=causation_id,
    )
    if verdict.check is ClaimCheck.TRUSTED:
        # Storage this service cannot read, of a scheme the deployment trusts for the
        # job's class: catalogued unverified, and the audit stream says so.
        await uow.audit(
            AuditAction.CHECKPOINT_TRUSTED,
            entity=job_id,
            reason=(
                f"checkpoint {checkpoint.checkpoint_id} of job {job_id} trusted without "
                f"verification: {verdict.why}"
            ),
            details={
                "job_id": job_id,
                "request_id": request_id,
                "checkpoint": checkpoint.to_dict(),
                "verification": verdict.check.value,
                **facts,
            },
            causation_id=causation_id,
        )


def _info(ref: CheckpointRef) -> wire.CheckpointInfo:
    return wire.CheckpointInfo(
        checkpoint_id=ref.checkpoint_id,
        step=ref.step,
        uri=ref.uri,
        bytes=ref.bytes,
        sha256=ref.sha256,
        stage=wire.StageName(ref.stage.value),
    )


async def _unverified(
    uow: UnitOfWork,
    job_id: str,
    request_id: str | None,
    claim: CheckpointRef,
    verdict: Verdict,
    facts: Mapping[str, str | None],
    sagas: list[Saga],
    causation_id: str,
) -> None:
    # One record per saga the claim was meant for, so each saga's audit trail says why
    # it kept waiting; a periodic claim with no saga to affect is recorded on the job.
    concerned = [s for s in sagas if request_id is None or s.request_id == request_id]
    details = {
        "job_id": job_id,
        "request_id": request_id,
        "claim": claim.to_dict(),
        "verification": verdict.check.value,
        **facts,
    }
    targets: list[tuple[str, Saga | None]] = [(s.saga_id, s) for s in concerned]
    for entity, saga in targets or [(job_id, None)]:
        await uow.audit(
            AuditAction.CHECKPOINT_UNVERIFIED,
            entity=entity,
            reason=f"checkpoint {claim.checkpoint_id} of job {job_id} refused: {verdict.why}",
            details={**details, **({} if saga is None else _describe(saga))},
            causation_id=causation_id,
        )


async def _ignored(
    uow: UnitOfWork, saga: Saga, input_name: str, why: str, causation_id: str | None
) -> None:
    await uow.audit(
        AuditAction.INPUT_IGNORED,
        entity=saga.saga_id,
        reason=why,
        details={"input": input_name, **_describe(saga)},
        causation_id=causation_id,
    )


def _describe(saga: Saga) -> dict[str, Any]:
    return {
        "saga_id": saga.saga_id,
        "request_id": saga.request_id,
        "job_id": saga.job_id,
        "allocation_id": saga.allocation_id,
        "state": saga.state.value,
        "outcome": None if saga.outcome is None else saga.outcome.value,
        "deadline": saga.deadline.isoformat(),
        "stage_required": saga.stage_required.value,
        "policy": saga.policy.value,
        "checkpoint": None if saga.checkpoint is None else saga.checkpoint.to_dict(),
        "last_confirmed": (None if saga.last_confirmed is None else saga.last_confirmed.to_dict()),
        "lost_gpu_seconds": saga.lost_gpu_seconds,
    }


# The claims `prepare` read for a batch's checkpoint.confirmed, by message id.
_CLAIMS: WeakKeyDictionary[UnitOfWork, dict[str, Claim]] = WeakKeyDictionary()


def _what_it_reads(
    envelope: Envelope,
    saga_ids: set[str],
    requests: set[str],
    live_jobs: set[str],
    job_requests: set[tuple[str, str]],
    latest_of: set[str],
    claims: list[Envelope],
) -> None:
    """Add what the handler of `envelope` will lock or read to the sets (`prepare`)."""

    def reads_job_sagas(envelope: Envelope, request_id: str | None) -> None:
        job_id = _job_of(envelope)
        live_jobs.add(job_id)
        if request_id is not None:
            # Only if it is this job's: a job may name any request id.
            job_requests.add((job_id, request_id))

    match envelope.type:
        case T.EVICTION_REQUESTED:
            request = envelope.payload(wire.EvictionRequested)
            requests.add(request.request_id)
            latest_of.add(request.job_id)
        case T.EVICTION_WITHDRAWN:
            requests.add(envelope.payload(wire.EvictionWithdrawn).request_id)
        case T.CHECKPOINT_CONFIRMED:
            reads_job_sagas(envelope, envelope.payload(wire.CheckpointConfirmed).request_id)
            claims.append(envelope)
        case T.CHECKPOINT_FAILED:
            reads_job_sagas(envelope, envelope.payload(wire.CheckpointFailed).request_id)
        case T.JOB_COMPLETED:
            live_jobs.add(_job_of(envelope, envelope.payload(wire.JobCompleted).job_id))
        case T.JOB_FAILED:
            live_jobs.add(_job_of(envelope, envelope.payload(wire.JobFailed).job_id))
        case T.WORKLOAD_STOPPED:
            stopped = envelope.payload(wire.WorkloadStopped)
            if stopped.saga_id is not None:
                saga_ids.add(stopped.saga_id)
        case T.EVICT_FAILED:
            saga_ids.add(envelope.payload(wire.EvictFailed).saga_id)


def _job_of(envelope: Envelope, named: str | None = None) -> str:
    """The job a job event is about: its correlation id, which the SDK sets to the job
    id, else the job id its payload names."""
    job_id = envelope.correlation_id or named
    if job_id is None:
        raise MalformedMessage(f"{envelope.type}: no job id (the correlation id names the job)")
    if named is not None and named != job_id:
        raise MalformedMessage(
            f"{envelope.type}: correlation id {job_id!r} and job_id {named!r} disagree"
        )
    return _require_token(job_id, "job id")


def _require_token(value: str, what: str) -> str:
    # The job id becomes a subject token of its control subject; one that cannot be
    # one would only fail later, in the outbox.
    try:
        return check_token(value, what)
    except ValueError as exc:
        raise MalformedMessage(str(exc)) from exc
