"""The checkpoint-confirmed-before-evict saga (DESIGN §3.4) as a pure state machine.

`begin` opens a saga from an eviction request; `decide` folds one input into it and
returns the new saga plus the effects the checkpoint service must put in its outbox.
Nothing here does I/O or reads a clock: the caller passes `now` (an aware datetime),
and `now` is the only clock `decide` trusts (timestamps inside inputs are informational).

Rejections are exceptions, never silent no-ops, so the handler can audit them:
- `IllegalTransition`: the input is legitimate but has nothing to do in this state
  (duplicate, late, not yet due, too late). Audit and ack.
- `ForeignMessage`: the input names another request, job or allocation. Audit and ack.

CONFIRMED and EVICTED are passed through within a single decision (CONFIRMED ->
EVICTING, EVICTED -> COMPLETED), so `decide` never returns a saga resting in them; they
remain real states so a saga loaded in them is still handled, and `Decision.path`
records that they were entered. The same holds for REQUESTED, which `begin` leaves at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from enum import StrEnum
from types import MappingProxyType
from typing import Final, TypeAlias

from gpusched.domain import lostwork

MAX_EVICT_ATTEMPTS: Final = 3


class SagaState(StrEnum):
    REQUESTED = "requested"
    CHECKPOINTING = "checkpointing"
    CONFIRMED = "confirmed"
    EVICTING = "evicting"
    EVICTED = "evicted"
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    ABORTED = "aborted"
    FORCED = "forced"


TERMINAL_STATES: Final = frozenset(
    {SagaState.COMPLETED, SagaState.CANCELLED, SagaState.ABORTED, SagaState.FORCED}
)


class Stage(StrEnum):
    SNAPSHOTTED = "snapshotted"
    PERSISTED = "persisted"

    def satisfies(self, required: Stage) -> bool:
        # A persisted checkpoint was snapshotted on its way to storage, so it meets
        # either requirement; a snapshot only in host memory dies with the workload.
        return _STAGE_RANK[self] >= _STAGE_RANK[required]


_STAGE_RANK: Final = {Stage.SNAPSHOTTED: 1, Stage.PERSISTED: 2}


class DeadlinePolicy(StrEnum):
    ABORT = "abort"
    FORCE = "force"


class Outcome(StrEnum):
    """Why a saga reached its terminal state."""

    EVICTED = "evicted"
    JOB_FINISHED = "job_finished"
    NEED_WITHDRAWN = "need_withdrawn"
    DEADLINE_ABORTED = "deadline_aborted"
    DEADLINE_FORCED = "deadline_forced"
    CHECKPOINT_FAILED_ABORTED = "checkpoint_failed_aborted"
    CHECKPOINT_FAILED_FORCED = "checkpoint_failed_forced"
    EVICT_FAILED = "evict_failed"


class SagaError(Exception):
    """Base of the saga's domain errors."""


class IllegalTransition(SagaError):
    def __init__(self, state: SagaState, input_name: str, why: str) -> None:
        super().__init__(f"{input_name} is not accepted in state {state.value}: {why}")
        self.state = state
        self.input_name = input_name
        self.why = why


class ForeignMessage(SagaError):
    def __init__(self, saga_id: str, input_name: str, why: str) -> None:
        super().__init__(f"{input_name} does not belong to saga {saga_id}: {why}")
        self.saga_id = saga_id
        self.input_name = input_name
        self.why = why


@dataclass(frozen=True)
class CheckpointRef:
    checkpoint_id: str
    step: int
    uri: str
    bytes: int
    sha256: str
    stage: Stage

    def is_newer_than(self, other: CheckpointRef | None) -> bool:
        if other is None:
            return True
        if self.step != other.step:
            return self.step > other.step
        # The same step reported again once persisted is progress, not a duplicate.
        return _STAGE_RANK[self.stage] > _STAGE_RANK[other.stage]

    def to_dict(self) -> dict[str, object]:
        return {
            "checkpoint_id": self.checkpoint_id,
            "step": self.step,
            "uri": self.uri,
            "bytes": self.bytes,
            "sha256": self.sha256,
            "stage": self.stage.value,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> CheckpointRef:
        return cls(
            checkpoint_id=_str(data, "checkpoint_id"),
            step=_int(data, "step"),
            uri=_str(data, "uri"),
            bytes=_int(data, "bytes"),
            sha256=_str(data, "sha256"),
            stage=Stage(_str(data, "stage")),
        )


@dataclass(frozen=True)
class Saga:
    """All the state of one eviction, in one serializable value."""

    saga_id: str
    request_id: str
    allocation_id: str
    job_id: str
    gpus: int
    reason: str
    state: SagaState
    stage_required: Stage
    policy: DeadlinePolicy
    deadline: datetime
    started_at: datetime  # allocation start: the lost-work baseline when no checkpoint exists
    created_at: datetime
    updated_at: datetime
    checkpoint: CheckpointRef | None = None  # the confirmation this eviction waited for
    last_confirmed: CheckpointRef | None = None  # newest confirmed checkpoint of any origin
    last_confirmed_at: datetime | None = None
    evict_attempts: int = 0
    outcome: Outcome | None = None
    lost_gpu_seconds: float = 0.0
    # The part of its one GPU a fraction holds (1/1000); 1000: whole GPUs.
    share_milli: int = 1000

    @property
    def is_terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    def to_dict(self) -> dict[str, object]:
        return {
            "saga_id": self.saga_id,
            "request_id": self.request_id,
            "allocation_id": self.allocation_id,
            "job_id": self.job_id,
            "gpus": self.gpus,
            "reason": self.reason,
            "state": self.state.value,
            "stage_required": self.stage_required.value,
            "policy": self.policy.value,
            "deadline": self.deadline.isoformat(),
            "started_at": self.started_at.isoformat(),
            "created_at": self.created_at.isoformat(),
            "updated_at": self.updated_at.isoformat(),
            "checkpoint": None if self.checkpoint is None else self.checkpoint.to_dict(),
            "last_confirmed": (
                None if self.last_confirmed is None else self.last_confirmed.to_dict()
            ),
            "last_confirmed_at": (
                None if self.last_confirmed_at is None else self.last_confirmed_at.isoformat()
            ),
            "evict_attempts": self.evict_attempts,
            "outcome": None if self.outcome is None else self.outcome.value,
            "lost_gpu_seconds": self.lost_gpu_seconds,
            "share_milli": self.share_milli,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> Saga:
        outcome = data.get("outcome")
        lost = data.get("lost_gpu_seconds", 0.0)
        if not isinstance(lost, int | float) or isinstance(lost, bool):
            raise ValueError(f"saga field 'lost_gpu_seconds' must be a number, got {lost!r}")
        return cls(
            saga_id=_str(data, "saga_id"),
            request_id=_str(data, "request_id"),
            allocation_id=_str(data, "allocation_id"),
            job_id=_str(data, "job_id"),
            gpus=_int(data, "gpus"),
            reason=_str(data, "reason"),
            state=SagaState(_str(data, "state")),
            stage_required=Stage(_str(data, "stage_required")),
            policy=DeadlinePolicy(_str(data, "policy")),
            deadline=_datetime(data, "deadline"),
            started_at=_datetime(data, "started_at"),
            created_at=_datetime(data, "created_at"),
            updated_at=_datetime(data, "updated_at"),
            checkpoint=_checkpoint(data, "checkpoint"),
            last_confirmed=_checkpoint(data, "last_confirmed"),
            last_confirmed_at=(
                None
                if data.get("last_confirmed_at") is None
                else _datetime(data, "last_confirmed_at")
            ),
            evict_attempts=_int(data, "evict_attempts"),
            outcome=None if outcome is None else Outcome(_str(data, "outcome")),
            lost_gpu_seconds=float(lost),
            # Sagas stored before fractions were victims held whole GPUs.
            share_milli=_int(data, "share_milli") if "share_milli" in data else 1000,
        )


# --- inputs ------------------------------------------------------------------------


@dataclass(frozen=True)
class Begin:
    """The eviction request that opens a saga."""

    saga_id: str
    request_id: str
    allocation_id: str
    job_id: str
    gpus: int
    started_at: datetime
    grace_s: float
    policy: DeadlinePolicy
    stage_required: Stage
    reason: str
    # The checkpoint catalogue may already know a periodic checkpoint of this job;
    # without it a forced eviction would charge lost work from the allocation start.
    last_confirmed: CheckpointRef | None = None
    last_confirmed_at: datetime | None = None
    share_milli: int = 1000


@dataclass(frozen=True)
class CheckpointConfirmed:
    request_id: str | None  # None for a periodic checkpoint the job took on its own
    job_id: str
    checkpoint: CheckpointRef


@dataclass(frozen=True)
class CheckpointFailed:
    request_id: str | None
    job_id: str
    error: str


@dataclass(frozen=True)
class WorkloadStopped:
    allocation_id: str
    reason: str


@dataclass(frozen=True)
class EvictFailed:
    allocation_id: str
    error: str


@dataclass(frozen=True)
class JobFinished:
    job_id: str
    succeeded: bool


@dataclass(frozen=True)
class NeedWithdrawn:
    request_id: str


@dataclass(frozen=True)
class DeadlineReached:
    now: datetime  # when the timer fired; `decide`'s own `now` judges whether it is due


SagaInput: TypeAlias = (
    Begin
    | CheckpointConfirmed
    | CheckpointFailed
    | WorkloadStopped
    | EvictFailed
    | JobFinished
    | NeedWithdrawn
    | DeadlineReached
)


# --- effects -----------------------------------------------------------------------


@dataclass(frozen=True)
class SendCheckpointRequest:
    job_id: str
    request_id: str
    deadline: datetime
    stage_required: Stage
    reason: str


@dataclass(frozen=True)
class SendEvict:
    allocation_id: str
    job_id: str
    forced: bool


@dataclass(frozen=True)
class SendPreemptionCancelled:
    job_id: str
    request_id: str


@dataclass(frozen=True)
class EmitEvictionCompleted:
    saga_id: str
    allocation_id: str
    job_id: str
    checkpoint: CheckpointRef | None


@dataclass(frozen=True)
class EmitEvictionAborted:
    saga_id: str
    allocation_id: str
    job_id: str
    reason: Outcome


@dataclass(frozen=True)
class EmitEvictionForced:
    saga_id: str
    allocation_id: str
    job_id: str
    lost_gpu_seconds: float
    last_checkpoint: CheckpointRef | None


@dataclass(frozen=True)
class EmitEvictionCancelled:
    saga_id: str
    allocation_id: str
    job_id: str
    reason: Outcome


SagaEffect: TypeAlias = (
    SendCheckpointRequest
    | SendEvict
    | SendPreemptionCancelled
    | EmitEvictionCompleted
    | EmitEvictionAborted
    | EmitEvictionForced
    | EmitEvictionCancelled
)


@dataclass(frozen=True)
class Decision:
    saga: Saga
    effects: tuple[SagaEffect, ...]
    note: str  # human reason, recorded in the audit stream
    path: tuple[SagaState, ...] = ()  # states entered by this decision, in order


# Which input types each state accepts at all; the content of an accepted input can
# still be rejected (a confirmation for another job, a deadline not yet due, ...).
_LIVE_BEFORE_EVICT: Final[frozenset[type[SagaInput]]] = frozenset(
    {CheckpointConfirmed, WorkloadStopped, JobFinished, NeedWithdrawn}
)
ALLOWED: Final[Mapping[SagaState, frozenset[type[SagaInput]]]] = MappingProxyType(
    {
        SagaState.REQUESTED: _LIVE_BEFORE_EVICT | {Begin, DeadlineReached},
        SagaState.CHECKPOINTING: _LIVE_BEFORE_EVICT | {CheckpointFailed, DeadlineReached},
        SagaState.CONFIRMED: _LIVE_BEFORE_EVICT,
        SagaState.EVICTING: frozenset(
            {CheckpointConfirmed, WorkloadStopped, EvictFailed, JobFinished}
        ),
        SagaState.EVICTED: frozenset({CheckpointConfirmed}),
        SagaState.COMPLETED: frozenset(),
        SagaState.CANCELLED: frozenset(),
        SagaState.ABORTED: frozenset(),
        SagaState.FORCED: frozenset(),
    }
)

_BEFORE_EVICT: Final = frozenset(
    {SagaState.REQUESTED, SagaState.CHECKPOINTING, SagaState.CONFIRMED}
)


def begin(cmd: Begin, now: datetime) -> tuple[Saga, list[SagaEffect]]:
    """Open a saga and ask the job for a checkpoint (REQUESTED -> CHECKPOINTING)."""
    _require_aware(now, "now")
    _require_aware(cmd.started_at, "started_at")
    if cmd.last_confirmed_at is not None:
        _require_aware(cmd.last_confirmed_at, "last_confirmed_at")
    if cmd.grace_s < 0:
        raise ValueError(f"grace_s must not be negative, got {cmd.grace_s}")
    if cmd.gpus < 0:
        raise ValueError(f"gpus must not be negative, got {cmd.gpus}")
    if not 1 <= cmd.share_milli <= 1000:
        raise ValueError(f"share_milli must be within 1..1000, got {cmd.share_milli}")
    requested = Saga(
        saga_id=cmd.saga_id,
        request_id=cmd.request_id,
        allocation_id=cmd.allocation_id,
        job_id=cmd.job_id,
        gpus=cmd.gpus,
        reason=cmd.reason,
        state=SagaState.REQUESTED,
        stage_required=cmd.stage_required,
        policy=cmd.policy,
        deadline=now + timedelta(seconds=cmd.grace_s),
        started_at=cmd.started_at,
        created_at=now,
        updated_at=now,
        last_confirmed=cmd.last_confirmed,
        last_confirmed_at=cmd.last_confirmed_at,
        share_milli=cmd.share_milli,
    )
    decision = decide(requested, cmd, now)
    return decision.saga, list(decision.effects)


def decide(saga: Saga, event: SagaInput, now: datetime) -> Decision:
    """Fold one input into the saga. Raises IllegalTransition or ForeignMessage."""
    _require_aware(now, "now")
    name = type(event).__name__
    if saga.is_terminal:
        raise IllegalTransition(saga.state, name, f"the saga ended ({saga.outcome})")
    _require_addressed_to(saga, event)
    if type(event) not in ALLOWED[saga.state]:
        raise IllegalTransition(saga.state, name, _WHY_NOT[saga.state])
    match event:
        case Begin():
            return _on_begin(saga, now)
        case CheckpointConfirmed():
            return _on_checkpoint_confirmed(saga, event, now)
        case CheckpointFailed():
            return _on_checkpoint_failed(saga, event, now)
        case DeadlineReached():
            return _on_deadline_reached(saga, now)
        case WorkloadStopped():
            return _on_workload_stopped(saga, event, now)
        case EvictFailed():
            return _on_evict_failed(saga, event, now)
        case JobFinished():
            return _on_job_finished(saga, event, now)
        case NeedWithdrawn():
            return _on_need_withdrawn(saga, now)


_WHY_NOT: Final = {
    SagaState.REQUESTED: "the checkpoint has not been requested yet",
    SagaState.CHECKPOINTING: "no eviction command has been sent",
    SagaState.CONFIRMED: "the checkpoint is already confirmed",
    SagaState.EVICTING: "the eviction is in flight",
    SagaState.EVICTED: "the workload has already stopped",
}


def lost_gpu_seconds(saga: Saga, now: datetime) -> float:
    """GPU-seconds of training since the newest verified checkpoint (or allocation start);
    a fraction of a GPU counts its part of it."""
    lost = lostwork.lost_gpu_seconds(saga.gpus, saga.started_at, saga.last_confirmed_at, now)
    return lost * saga.share_milli / 1000 if saga.share_milli < 1000 else lost


def _require_addressed_to(saga: Saga, event: SagaInput) -> None:
    name = type(event).__name__
    mismatches: list[str] = []
    match event:
        case Begin():
            if event.saga_id != saga.saga_id:
                mismatches.append(f"saga {event.saga_id}")
            if event.request_id != saga.request_id:
                mismatches.append(f"request {event.request_id}")
        case CheckpointConfirmed() | CheckpointFailed():
            if event.job_id != saga.job_id:
                mismatches.append(f"job {event.job_id}")
            if event.request_id is not None and event.request_id != saga.request_id:
                mismatches.append(f"request {event.request_id}")
        case JobFinished():
            if event.job_id != saga.job_id:
                mismatches.append(f"job {event.job_id}")
        case WorkloadStopped() | EvictFailed():
            if event.allocation_id != saga.allocation_id:
                mismatches.append(f"allocation {event.allocation_id}")
        case NeedWithdrawn():
            if event.request_id != saga.request_id:
                mismatches.append(f"request {event.request_id}")
        case DeadlineReached():
            pass
    if mismatches:
        raise ForeignMessage(saga.saga_id, name, "it names " + " and ".join(mismatches))


def _on_begin(saga: Saga, now: datetime) -> Decision:
    effect = SendCheckpointRequest(
        job_id=saga.job_id,
        request_id=saga.request_id,
        deadline=saga.deadline,
        stage_required=saga.stage_required,
        reason=saga.reason,
    )
    return Decision(
        saga=replace(saga, state=SagaState.CHECKPOINTING, updated_at=now),
        effects=(effect,),
        note=(
            f"REQUESTED->CHECKPOINTING: asked job {saga.job_id} for a "
            f"{saga.stage_required.value} checkpoint by {saga.deadline.isoformat()}"
        ),
        path=(SagaState.CHECKPOINTING,),
    )


def _on_checkpoint_confirmed(saga: Saga, event: CheckpointConfirmed, now: datetime) -> Decision:
    ref = event.checkpoint
    if event.request_id is None:
        return _record_checkpoint(saga, event, now, "periodic checkpoint")
    if saga.state is not SagaState.CHECKPOINTING:
        raise IllegalTransition(saga.state, type(event).__name__, _WHY_NOT[saga.state])
    if not ref.stage.satisfies(saga.stage_required):
        # Keep waiting: evicting now would lose the snapshot still held in host memory.
        return _record_checkpoint(
            saga,
            event,
            now,
            f"checkpoint only {ref.stage.value}, eviction waits for {saga.stage_required.value}",
        )
    confirmed = replace(
        saga,
        state=SagaState.EVICTING,
        checkpoint=ref,
        last_confirmed=ref,
        last_confirmed_at=now,
        evict_attempts=1,
        updated_at=now,
    )
    return Decision(
        saga=confirmed,
        effects=(SendEvict(saga.allocation_id, saga.job_id, forced=False),),
        note=(
            f"CHECKPOINTING->CONFIRMED->EVICTING: checkpoint {ref.checkpoint_id} at step "
            f"{ref.step} is {ref.stage.value}; evicting allocation {saga.allocation_id}"
        ),
        path=(SagaState.CONFIRMED, SagaState.EVICTING),
    )


def _record_checkpoint(
    saga: Saga, event: CheckpointConfirmed, now: datetime, what: str
) -> Decision:
    ref, known = event.checkpoint, saga.last_confirmed
    if known is not None and not ref.is_newer_than(known):
        if event.request_id is None:
            # Redelivered or out-of-order: recording it would move the lost-work
            # baseline forward to a checkpoint older than one already known.
            raise IllegalTransition(
                saga.state,
                type(event).__name__,
                f"step {ref.step} ({ref.stage.value}) is not newer than known step "
                f"{known.step} ({known.stage.value})",
            )
        return Decision(saga=saga, effects=(), note=f"{what}; not newer than the one known")
    return Decision(
        saga=replace(saga, last_confirmed=ref, last_confirmed_at=now, updated_at=now),
        effects=(),
        note=f"{what} {ref.checkpoint_id} at step {ref.step} recorded for lost-work accounting",
    )


def _on_checkpoint_failed(saga: Saga, event: CheckpointFailed, now: datetime) -> Decision:
    name = type(event).__name__
    if event.request_id is None:
        raise IllegalTransition(saga.state, name, "a periodic checkpoint failure is not ours")
    return _apply_policy(
        saga,
        now,
        abort=Outcome.CHECKPOINT_FAILED_ABORTED,
        force=Outcome.CHECKPOINT_FAILED_FORCED,
        why=f"checkpoint failed: {event.error}",
    )


def _on_deadline_reached(saga: Saga, now: datetime) -> Decision:
    if now < saga.deadline:
        raise IllegalTransition(
            saga.state, DeadlineReached.__name__, f"not due until {saga.deadline.isoformat()}"
        )
    return _apply_policy(
        saga,
        now,
        abort=Outcome.DEADLINE_ABORTED,
        force=Outcome.DEADLINE_FORCED,
        why=f"no confirmed checkpoint by the deadline {saga.deadline.isoformat()}",
    )


def _apply_policy(
    saga: Saga, now: datetime, *, abort: Outcome, force: Outcome, why: str
) -> Decision:
    if saga.policy is DeadlinePolicy.ABORT:
        return _abort(saga, now, abort, why)
    lost = lost_gpu_seconds(saga, now)
    forced = replace(
        saga,
        state=SagaState.FORCED,
        outcome=force,
        lost_gpu_seconds=lost,
        evict_attempts=saga.evict_attempts + 1,
        updated_at=now,
    )
    return Decision(
        saga=forced,
        effects=(
            SendEvict(saga.allocation_id, saga.job_id, forced=True),
            EmitEvictionForced(
                saga.saga_id, saga.allocation_id, saga.job_id, lost, saga.last_confirmed
            ),
        ),
        note=(
            f"{saga.state.name}->FORCED: {why}; policy force, {lost:.0f} GPU-seconds of work lost"
        ),
        path=(SagaState.FORCED,),
    )


def _abort(saga: Saga, now: datetime, outcome: Outcome, why: str) -> Decision:
    return Decision(
        saga=replace(saga, state=SagaState.ABORTED, outcome=outcome, updated_at=now),
        effects=(
            *_stand_down(saga),
            EmitEvictionAborted(saga.saga_id, saga.allocation_id, saga.job_id, outcome),
        ),
        note=f"{saga.state.name}->ABORTED: {why}; another victim must be chosen",
        path=(SagaState.ABORTED,),
    )


def _stand_down(saga: Saga) -> tuple[SagaEffect, ...]:
    # Only a job that was asked to checkpoint has anything to stand down from.
    if saga.state is SagaState.REQUESTED:
        return ()
    return (SendPreemptionCancelled(saga.job_id, saga.request_id),)


def _on_workload_stopped(saga: Saga, event: WorkloadStopped, now: datetime) -> Decision:
    if saga.state is SagaState.EVICTING:
        return Decision(
            saga=replace(saga, state=SagaState.COMPLETED, outcome=Outcome.EVICTED, updated_at=now),
            effects=(
                EmitEvictionCompleted(
                    saga.saga_id, saga.allocation_id, saga.job_id, saga.checkpoint
                ),
            ),
            note=(
                f"EVICTING->EVICTED->COMPLETED: workload stopped ({event.reason}); "
                f"resume from {_checkpoint_id(saga.checkpoint)}"
            ),
            path=(SagaState.EVICTED, SagaState.COMPLETED),
        )
    return _finished_on_its_own(saga, now, f"workload stopped on its own ({event.reason})")


def _on_job_finished(saga: Saga, event: JobFinished, now: datetime) -> Decision:
    result = "succeeded" if event.succeeded else "failed"
    if saga.state is SagaState.EVICTING:
        # The evict command is already out; its WorkloadStopped completes the saga, and
        # finishing here would leave that result without an owner.
        return Decision(saga=saga, effects=(), note=f"job {result} during eviction; awaiting stop")
    return _finished_on_its_own(saga, now, f"job {result}")


def _finished_on_its_own(saga: Saga, now: datetime, why: str) -> Decision:
    return Decision(
        saga=replace(saga, state=SagaState.COMPLETED, outcome=Outcome.JOB_FINISHED, updated_at=now),
        effects=(
            EmitEvictionCancelled(
                saga.saga_id, saga.allocation_id, saga.job_id, Outcome.JOB_FINISHED
            ),
        ),
        note=f"{saga.state.name}->COMPLETED: {why}; nothing evicted",
        path=(SagaState.COMPLETED,),
    )


def _on_evict_failed(saga: Saga, event: EvictFailed, now: datetime) -> Decision:
    if saga.evict_attempts >= MAX_EVICT_ATTEMPTS:
        return _abort(
            saga,
            now,
            Outcome.EVICT_FAILED,
            f"eviction failed {saga.evict_attempts} times, last: {event.error}",
        )
    attempt = saga.evict_attempts + 1
    return Decision(
        saga=replace(saga, evict_attempts=attempt, updated_at=now),
        effects=(SendEvict(saga.allocation_id, saga.job_id, forced=False),),
        note=f"eviction failed ({event.error}); attempt {attempt} of {MAX_EVICT_ATTEMPTS}",
    )


def _on_need_withdrawn(saga: Saga, now: datetime) -> Decision:
    return Decision(
        saga=replace(
            saga, state=SagaState.CANCELLED, outcome=Outcome.NEED_WITHDRAWN, updated_at=now
        ),
        effects=(
            *_stand_down(saga),
            EmitEvictionCancelled(
                saga.saga_id, saga.allocation_id, saga.job_id, Outcome.NEED_WITHDRAWN
            ),
        ),
        note=f"{saga.state.name}->CANCELLED: the inference need was withdrawn",
        path=(SagaState.CANCELLED,),
    )


def _checkpoint_id(ref: CheckpointRef | None) -> str:
    return "nothing" if ref is None else f"checkpoint {ref.checkpoint_id}"


def _require_aware(value: datetime, what: str) -> None:
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{what} must be a timezone-aware datetime, got {value!r}")


def _str(data: Mapping[str, object], key: str) -> str:
    value = data.get(key)
    if not isinstance(value, str):
        raise ValueError(f"saga field {key!r} must be a string, got {value!r}")
    return value


def _int(data: Mapping[str, object], key: str) -> int:
    value = data.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"saga field {key!r} must be an integer, got {value!r}")
    return value


def _datetime(data: Mapping[str, object], key: str) -> datetime:
    value = datetime.fromisoformat(_str(data, key))
    _require_aware(value, f"saga field {key!r}")
    return value


def _checkpoint(data: Mapping[str, object], key: str) -> CheckpointRef | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"saga field {key!r} must be an object, got {value!r}")
    return CheckpointRef.from_dict(value)
