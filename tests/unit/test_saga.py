from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpusched.domain.saga import (
    ALLOWED,
    MAX_EVICT_ATTEMPTS,
    TERMINAL_STATES,
    Begin,
    CheckpointConfirmed,
    CheckpointFailed,
    CheckpointRef,
    DeadlinePolicy,
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
    SagaError,
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

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
STARTED = T0 - timedelta(hours=2)
GRACE = timedelta(minutes=5)
SAGA_ID, REQUEST_ID, ALLOCATION_ID, JOB_ID = "saga-1", "req-1", "alloc-1", "job-1"


def checkpoint(step: int = 100, stage: Stage = Stage.PERSISTED) -> CheckpointRef:
    return CheckpointRef(
        checkpoint_id=f"ckpt-{step}-{stage.value}",
        step=step,
        uri=f"s3://ckpt/job-1/{step}",
        bytes=1_000,
        sha256="ab" * 32,
        stage=stage,
    )


def begin_cmd(
    policy: DeadlinePolicy = DeadlinePolicy.ABORT, stage_required: Stage = Stage.PERSISTED
) -> Begin:
    return Begin(
        saga_id=SAGA_ID,
        request_id=REQUEST_ID,
        allocation_id=ALLOCATION_ID,
        job_id=JOB_ID,
        gpus=4,
        started_at=STARTED,
        grace_s=GRACE.total_seconds(),
        policy=policy,
        stage_required=stage_required,
        reason="inference surge",
    )


def saga_in(state: SagaState, policy: DeadlinePolicy = DeadlinePolicy.ABORT) -> Saga:
    """A saga resting in `state`, as it would be loaded from the database."""
    evicting = state in {SagaState.EVICTING, SagaState.EVICTED}
    return Saga(
        saga_id=SAGA_ID,
        request_id=REQUEST_ID,
        allocation_id=ALLOCATION_ID,
        job_id=JOB_ID,
        gpus=4,
        reason="inference surge",
        state=state,
        stage_required=Stage.PERSISTED,
        policy=policy,
        deadline=T0 + GRACE,
        started_at=STARTED,
        created_at=T0,
        updated_at=T0,
        checkpoint=checkpoint() if evicting else None,
        last_confirmed=checkpoint() if evicting else None,
        last_confirmed_at=T0 if evicting else None,
        evict_attempts=1 if evicting else 0,
    )


AFTER_DEADLINE = T0 + GRACE + timedelta(seconds=1)

# One representative input per type, addressed to the saga and (for the deadline) due.
INPUTS: dict[str, SagaInput] = {
    "Begin": begin_cmd(),
    "CheckpointConfirmed": CheckpointConfirmed(REQUEST_ID, JOB_ID, checkpoint()),
    "CheckpointFailed": CheckpointFailed(REQUEST_ID, JOB_ID, "disk full"),
    "WorkloadStopped": WorkloadStopped(ALLOCATION_ID, "evicted"),
    "EvictFailed": EvictFailed(ALLOCATION_ID, "api timeout"),
    "JobFinished": JobFinished(JOB_ID, succeeded=True),
    "NeedWithdrawn": NeedWithdrawn(REQUEST_ID),
    "DeadlineReached": DeadlineReached(AFTER_DEADLINE),
}


@dataclass(frozen=True)
class Expect:
    state: SagaState
    outcome: Outcome | None
    effects: tuple[type, ...]


REJECT = None
CANCELLED_BY_JOB = Expect(SagaState.COMPLETED, Outcome.JOB_FINISHED, (EmitEvictionCancelled,))
WITHDRAWN = Expect(
    SagaState.CANCELLED,
    Outcome.NEED_WITHDRAWN,
    (SendPreemptionCancelled, EmitEvictionCancelled),
)
S = SagaState

# Written out in full (not derived from ALLOWED) so that a change to the rules has to
# be made twice, once here on purpose.
EXPECTED: dict[tuple[SagaState, str], Expect | None] = {
    (S.REQUESTED, "Begin"): Expect(S.CHECKPOINTING, None, (SendCheckpointRequest,)),
    (S.REQUESTED, "CheckpointConfirmed"): REJECT,  # nothing was requested yet
    (S.REQUESTED, "CheckpointFailed"): REJECT,
    (S.REQUESTED, "WorkloadStopped"): CANCELLED_BY_JOB,
    (S.REQUESTED, "EvictFailed"): REJECT,
    (S.REQUESTED, "JobFinished"): CANCELLED_BY_JOB,
    # The job was never asked, so it is not told to stand down.
    (S.REQUESTED, "NeedWithdrawn"): Expect(
        S.CANCELLED, Outcome.NEED_WITHDRAWN, (EmitEvictionCancelled,)
    ),
    (S.REQUESTED, "DeadlineReached"): Expect(
        S.ABORTED, Outcome.DEADLINE_ABORTED, (EmitEvictionAborted,)
    ),
    (S.CHECKPOINTING, "Begin"): REJECT,
    (S.CHECKPOINTING, "CheckpointConfirmed"): Expect(S.EVICTING, None, (SendEvict,)),
    (S.CHECKPOINTING, "CheckpointFailed"): Expect(
        S.ABORTED,
        Outcome.CHECKPOINT_FAILED_ABORTED,
        (SendPreemptionCancelled, EmitEvictionAborted),
    ),
    (S.CHECKPOINTING, "WorkloadStopped"): CANCELLED_BY_JOB,
    (S.CHECKPOINTING, "EvictFailed"): REJECT,
    (S.CHECKPOINTING, "JobFinished"): CANCELLED_BY_JOB,
    (S.CHECKPOINTING, "NeedWithdrawn"): WITHDRAWN,
    (S.CHECKPOINTING, "DeadlineReached"): Expect(
        S.ABORTED, Outcome.DEADLINE_ABORTED, (SendPreemptionCancelled, EmitEvictionAborted)
    ),
    (S.CONFIRMED, "Begin"): REJECT,
    (S.CONFIRMED, "CheckpointConfirmed"): REJECT,
    (S.CONFIRMED, "CheckpointFailed"): REJECT,
    (S.CONFIRMED, "WorkloadStopped"): CANCELLED_BY_JOB,
    (S.CONFIRMED, "EvictFailed"): REJECT,
    (S.CONFIRMED, "JobFinished"): CANCELLED_BY_JOB,
    (S.CONFIRMED, "NeedWithdrawn"): WITHDRAWN,
    (S.CONFIRMED, "DeadlineReached"): REJECT,
    (S.EVICTING, "Begin"): REJECT,
    (S.EVICTING, "CheckpointConfirmed"): REJECT,
    (S.EVICTING, "CheckpointFailed"): REJECT,
    (S.EVICTING, "WorkloadStopped"): Expect(S.COMPLETED, Outcome.EVICTED, (EmitEvictionCompleted,)),
    (S.EVICTING, "EvictFailed"): Expect(S.EVICTING, None, (SendEvict,)),
    (S.EVICTING, "JobFinished"): Expect(S.EVICTING, None, ()),
    (S.EVICTING, "NeedWithdrawn"): REJECT,
    (S.EVICTING, "DeadlineReached"): REJECT,
    **{(S.EVICTED, name): REJECT for name in INPUTS},
    **{(state, name): REJECT for state in TERMINAL_STATES for name in INPUTS},
}


def effect_types(decision: Decision) -> tuple[type, ...]:
    return tuple(type(effect) for effect in decision.effects)


def test_the_expected_table_covers_every_state_and_every_input_type() -> None:
    assert set(EXPECTED) == {(state, name) for state in SagaState for name in INPUTS}


@pytest.mark.parametrize(
    ("state", "input_name"),
    [(state, name) for state in SagaState for name in INPUTS],
    ids=lambda value: str(value),
)
def test_every_state_either_takes_the_documented_transition_or_rejects_the_input(
    state: SagaState, input_name: str
) -> None:
    saga = saga_in(state)
    expected = EXPECTED[(state, input_name)]
    now = AFTER_DEADLINE

    if expected is None:
        with pytest.raises(IllegalTransition):
            decide(saga, INPUTS[input_name], now)
        return

    decision = decide(saga, INPUTS[input_name], now)
    assert decision.saga.state is expected.state
    assert decision.saga.outcome is expected.outcome
    assert effect_types(decision) == expected.effects
    assert decision.note


def test_allowed_table_agrees_with_what_decide_accepts() -> None:
    for state in SagaState:
        accepted = {name for name in INPUTS if EXPECTED[(state, name)] is not None}
        declared = {kind.__name__ for kind in ALLOWED[state]}
        # ALLOWED is by type; REQUESTED also takes a periodic confirmation.
        assert accepted <= declared, state


def test_begin_asks_the_job_for_a_checkpoint_due_after_the_grace_period() -> None:
    saga, effects = begin(begin_cmd(stage_required=Stage.SNAPSHOTTED), T0)

    assert saga.state is SagaState.CHECKPOINTING
    assert saga.deadline == T0 + GRACE
    assert effects == [
        SendCheckpointRequest(
            job_id=JOB_ID,
            request_id=REQUEST_ID,
            deadline=T0 + GRACE,
            stage_required=Stage.SNAPSHOTTED,
            reason="inference surge",
        )
    ]


def test_begin_rejects_a_naive_clock() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        begin(begin_cmd(), datetime(2025, 3, 1, 12, 0))


def test_a_satisfying_confirmation_passes_through_confirmed_and_sends_a_graceful_evict() -> None:
    saga, _ = begin(begin_cmd(), T0)
    ref = checkpoint(stage=Stage.PERSISTED)

    decision = decide(saga, CheckpointConfirmed(REQUEST_ID, JOB_ID, ref), T0 + timedelta(minutes=1))

    assert decision.path == (SagaState.CONFIRMED, SagaState.EVICTING)
    assert "CONFIRMED->EVICTING" in decision.note
    assert decision.saga.checkpoint == ref
    assert decision.effects == (SendEvict(ALLOCATION_ID, JOB_ID, forced=False),)


def test_a_snapshot_does_not_release_an_eviction_that_waits_for_persistence() -> None:
    saga, _ = begin(begin_cmd(stage_required=Stage.PERSISTED), T0)
    snap = checkpoint(step=200, stage=Stage.SNAPSHOTTED)

    waiting = decide(saga, CheckpointConfirmed(REQUEST_ID, JOB_ID, snap), T0 + timedelta(seconds=5))

    assert waiting.saga.state is SagaState.CHECKPOINTING
    assert waiting.effects == ()
    assert waiting.saga.last_confirmed == snap
    assert waiting.saga.checkpoint is None

    persisted = checkpoint(step=200, stage=Stage.PERSISTED)
    evicting = decide(
        waiting.saga, CheckpointConfirmed(REQUEST_ID, JOB_ID, persisted), T0 + timedelta(minutes=2)
    )
    assert evicting.saga.state is SagaState.EVICTING
    assert evicting.saga.checkpoint == persisted


def test_a_persisted_checkpoint_satisfies_a_snapshot_requirement() -> None:
    saga, _ = begin(begin_cmd(stage_required=Stage.SNAPSHOTTED), T0)

    decision = decide(saga, CheckpointConfirmed(REQUEST_ID, JOB_ID, checkpoint()), T0)

    assert decision.saga.state is SagaState.EVICTING


def test_a_snapshot_satisfies_a_snapshot_requirement() -> None:
    saga, _ = begin(begin_cmd(stage_required=Stage.SNAPSHOTTED), T0)
    snap = checkpoint(stage=Stage.SNAPSHOTTED)

    decision = decide(saga, CheckpointConfirmed(REQUEST_ID, JOB_ID, snap), T0)

    assert decision.saga.state is SagaState.EVICTING


@pytest.mark.parametrize(
    "state",
    [S.REQUESTED, S.CHECKPOINTING, S.CONFIRMED, S.EVICTING, S.EVICTED],
)
def test_a_periodic_checkpoint_is_recorded_for_lost_work_without_a_transition(
    state: SagaState,
) -> None:
    saga = saga_in(state)
    ref = checkpoint(step=500)
    later = T0 + timedelta(minutes=3)

    decision = decide(saga, CheckpointConfirmed(None, JOB_ID, ref), later)

    assert decision.saga.state is state
    assert decision.effects == ()
    assert decision.saga.last_confirmed == ref
    assert decision.saga.last_confirmed_at == later


def test_a_stale_periodic_checkpoint_does_not_move_the_lost_work_baseline() -> None:
    saga = replace(saga_in(S.CHECKPOINTING), last_confirmed=checkpoint(900), last_confirmed_at=T0)

    with pytest.raises(IllegalTransition, match="not newer"):
        decide(saga, CheckpointConfirmed(None, JOB_ID, checkpoint(800)), T0 + timedelta(hours=1))


def test_a_periodic_checkpoint_after_the_end_is_rejected() -> None:
    with pytest.raises(IllegalTransition):
        decide(saga_in(S.COMPLETED), CheckpointConfirmed(None, JOB_ID, checkpoint()), T0)


@pytest.mark.parametrize(
    "event",
    [
        CheckpointConfirmed("req-other", JOB_ID, checkpoint()),
        CheckpointConfirmed(REQUEST_ID, "job-other", checkpoint()),
        CheckpointConfirmed(None, "job-other", checkpoint()),
        CheckpointFailed("req-other", JOB_ID, "boom"),
        CheckpointFailed(REQUEST_ID, "job-other", "boom"),
        WorkloadStopped("alloc-other", "stopped"),
        EvictFailed("alloc-other", "boom"),
        JobFinished("job-other", succeeded=True),
        NeedWithdrawn("req-other"),
    ],
    ids=lambda event: type(event).__name__,
)
def test_an_input_naming_another_request_job_or_allocation_is_foreign(event: SagaInput) -> None:
    with pytest.raises(ForeignMessage):
        decide(saga_in(S.CHECKPOINTING), event, T0)


def test_a_foreign_confirmation_cannot_release_the_eviction() -> None:
    saga, _ = begin(begin_cmd(), T0)

    with pytest.raises(ForeignMessage, match="req-other"):
        decide(saga, CheckpointConfirmed("req-other", JOB_ID, checkpoint()), T0)
    with pytest.raises(ForeignMessage, match="job-other"):
        decide(saga, CheckpointConfirmed(REQUEST_ID, "job-other", checkpoint()), T0)


def test_a_deadline_that_is_not_yet_due_is_rejected() -> None:
    saga, _ = begin(begin_cmd(), T0)
    early = T0 + GRACE - timedelta(microseconds=1)

    with pytest.raises(IllegalTransition, match="not due"):
        decide(saga, DeadlineReached(early), early)


def test_a_deadline_is_due_at_exactly_the_deadline() -> None:
    saga, _ = begin(begin_cmd(), T0)

    decision = decide(saga, DeadlineReached(T0 + GRACE), T0 + GRACE)

    assert decision.saga.state is SagaState.ABORTED


def test_forced_eviction_charges_lost_work_since_the_last_confirmed_checkpoint() -> None:
    saga, _ = begin(begin_cmd(policy=DeadlinePolicy.FORCE), T0)
    periodic = checkpoint(step=50)
    saga = decide(saga, CheckpointConfirmed(None, JOB_ID, periodic), T0 + timedelta(minutes=1)).saga
    at_deadline = T0 + GRACE

    decision = decide(saga, DeadlineReached(at_deadline), at_deadline)

    # 4 GPUs x the 4 minutes since the periodic checkpoint was confirmed.
    assert decision.saga.state is SagaState.FORCED
    assert decision.saga.outcome is Outcome.DEADLINE_FORCED
    assert decision.saga.lost_gpu_seconds == 4 * 240.0
    assert decision.effects == (
        SendEvict(ALLOCATION_ID, JOB_ID, forced=True),
        EmitEvictionForced(SAGA_ID, ALLOCATION_ID, JOB_ID, 4 * 240.0, periodic),
    )


def test_forced_eviction_without_any_checkpoint_charges_from_the_allocation_start() -> None:
    saga, _ = begin(begin_cmd(policy=DeadlinePolicy.FORCE), T0)

    decision = decide(saga, DeadlineReached(T0 + GRACE), T0 + GRACE)

    assert decision.saga.lost_gpu_seconds == 4 * (2 * 3600 + 300)


def test_a_forced_fraction_is_charged_its_part_of_the_gpu() -> None:
    cmd = replace(begin_cmd(policy=DeadlinePolicy.FORCE), gpus=1, share_milli=250)
    saga, _ = begin(cmd, T0)

    decision = decide(saga, DeadlineReached(T0 + GRACE), T0 + GRACE)

    assert decision.saga.lost_gpu_seconds == 0.25 * (2 * 3600 + 300)
    assert Saga.from_dict(decision.saga.to_dict()) == decision.saga
    # A saga stored before fractions were victims held whole GPUs.
    old = {k: v for k, v in decision.saga.to_dict().items() if k != "share_milli"}
    assert Saga.from_dict(old).share_milli == 1000
    with pytest.raises(ValueError, match="share_milli"):
        begin(replace(cmd, share_milli=0), T0)


def test_lost_work_is_never_negative() -> None:
    saga = replace(
        saga_in(S.CHECKPOINTING, DeadlinePolicy.FORCE),
        last_confirmed=checkpoint(),
        last_confirmed_at=AFTER_DEADLINE + timedelta(hours=1),
    )

    decision = decide(saga, DeadlineReached(AFTER_DEADLINE), AFTER_DEADLINE)

    assert decision.saga.lost_gpu_seconds == 0.0


def test_a_failed_checkpoint_applies_the_force_policy_at_once() -> None:
    saga, _ = begin(begin_cmd(policy=DeadlinePolicy.FORCE), T0)

    decision = decide(saga, CheckpointFailed(REQUEST_ID, JOB_ID, "disk full"), T0)

    assert decision.saga.state is SagaState.FORCED
    assert decision.saga.outcome is Outcome.CHECKPOINT_FAILED_FORCED
    assert effect_types(decision) == (SendEvict, EmitEvictionForced)
    assert decision.effects[0] == SendEvict(ALLOCATION_ID, JOB_ID, forced=True)


def test_a_periodic_checkpoint_failure_is_not_the_sagas_concern() -> None:
    with pytest.raises(IllegalTransition):
        decide(saga_in(S.CHECKPOINTING), CheckpointFailed(None, JOB_ID, "disk full"), T0)


def test_eviction_is_retried_then_aborted_after_three_attempts() -> None:
    saga, _ = begin(begin_cmd(), T0)
    saga = decide(saga, CheckpointConfirmed(REQUEST_ID, JOB_ID, checkpoint()), T0).saga
    assert saga.evict_attempts == 1

    retries = []
    for _ in range(MAX_EVICT_ATTEMPTS - 1):
        decision = decide(saga, EvictFailed(ALLOCATION_ID, "api timeout"), T0)
        retries.append(decision.effects)
        saga = decision.saga
    final = decide(saga, EvictFailed(ALLOCATION_ID, "api timeout"), T0)

    assert retries == [(SendEvict(ALLOCATION_ID, JOB_ID, forced=False),)] * 2
    assert final.saga.state is SagaState.ABORTED
    assert final.saga.outcome is Outcome.EVICT_FAILED
    assert final.effects == (
        SendPreemptionCancelled(JOB_ID, REQUEST_ID),
        EmitEvictionAborted(SAGA_ID, ALLOCATION_ID, JOB_ID, Outcome.EVICT_FAILED),
    )


def test_a_completed_eviction_hands_over_the_confirmed_checkpoint() -> None:
    saga, _ = begin(begin_cmd(), T0)
    ref = checkpoint(step=700)
    saga = decide(saga, CheckpointConfirmed(REQUEST_ID, JOB_ID, ref), T0).saga

    decision = decide(saga, WorkloadStopped(ALLOCATION_ID, "evicted"), T0 + timedelta(seconds=30))

    assert decision.path == (SagaState.EVICTED, SagaState.COMPLETED)
    assert decision.effects == (EmitEvictionCompleted(SAGA_ID, ALLOCATION_ID, JOB_ID, ref),)


def test_a_job_finishing_during_eviction_leaves_completion_to_the_workload_stop() -> None:
    saga = saga_in(S.EVICTING)

    decision = decide(saga, JobFinished(JOB_ID, succeeded=True), T0)

    assert decision.saga == saga
    assert decision.effects == ()


def test_a_saga_survives_a_round_trip_through_its_dict_form() -> None:
    saga, _ = begin(begin_cmd(policy=DeadlinePolicy.FORCE), T0)
    saga = decide(saga, CheckpointConfirmed(None, JOB_ID, checkpoint(10)), T0).saga
    saga = decide(saga, DeadlineReached(AFTER_DEADLINE), AFTER_DEADLINE).saga

    assert Saga.from_dict(saga.to_dict()) == saga


def test_a_dict_with_a_naive_timestamp_is_refused() -> None:
    data = saga_in(S.CHECKPOINTING).to_dict()
    data["deadline"] = "2025-03-01T12:05:00"

    with pytest.raises(ValueError, match="timezone-aware"):
        Saga.from_dict(data)


# --- property: random input sequences ------------------------------------------------

STAGES = st.sampled_from(list(Stage))
CHECKPOINTS = st.builds(checkpoint, step=st.integers(0, 20), stage=STAGES)
REQUEST_IDS = st.sampled_from([REQUEST_ID, REQUEST_ID, None, "req-other"])
JOB_IDS = st.sampled_from([JOB_ID, JOB_ID, JOB_ID, "job-other"])
ALLOCATION_IDS = st.sampled_from([ALLOCATION_ID, ALLOCATION_ID, "alloc-other"])
SOME_TIME = st.builds(lambda s: T0 + timedelta(seconds=s), st.integers(0, 900))

RANDOM_INPUTS: st.SearchStrategy[SagaInput] = st.one_of(
    st.builds(CheckpointConfirmed, REQUEST_IDS, JOB_IDS, CHECKPOINTS),
    st.builds(CheckpointFailed, REQUEST_IDS, JOB_IDS, st.just("boom")),
    st.builds(WorkloadStopped, ALLOCATION_IDS, st.just("stopped")),
    st.builds(EvictFailed, ALLOCATION_IDS, st.just("boom")),
    st.builds(JobFinished, JOB_IDS, st.booleans()),
    st.builds(NeedWithdrawn, st.sampled_from([REQUEST_ID, "req-other"])),
    st.builds(DeadlineReached, SOME_TIME),
    st.builds(begin_cmd, st.sampled_from(list(DeadlinePolicy)), STAGES),
)
TERMINAL_EFFECTS = (
    EmitEvictionCompleted,
    EmitEvictionAborted,
    EmitEvictionForced,
    EmitEvictionCancelled,
)


def releases_the_eviction(saga: Saga, event: SagaInput) -> bool:
    return (
        isinstance(event, CheckpointConfirmed)
        and event.request_id == saga.request_id
        and event.job_id == saga.job_id
        and event.checkpoint.stage.satisfies(saga.stage_required)
    )


@settings(max_examples=400, deadline=None)
@given(
    policy=st.sampled_from(list(DeadlinePolicy)),
    stage_required=STAGES,
    steps=st.lists(st.tuples(RANDOM_INPUTS, st.integers(0, 120)), max_size=25),
)
def test_no_input_sequence_evicts_unconfirmed_work_gracefully_or_leaves_a_terminal_state(
    policy: DeadlinePolicy,
    stage_required: Stage,
    steps: list[tuple[SagaInput, int]],
) -> None:
    saga, _ = begin(begin_cmd(policy, stage_required), T0)
    now = T0
    released = False
    terminal_decisions = 0
    terminal_effects: list[SagaEffect] = []

    for event, advance_s in steps:
        now += timedelta(seconds=advance_s)
        was_terminal = saga.state in TERMINAL_STATES
        try:
            decision = decide(saga, event, now)
        except SagaError:
            continue
        assert not was_terminal, f"{event} was accepted after {saga.state}"
        graceful = [e for e in decision.effects if isinstance(e, SendEvict) and not e.forced]
        released = released or releases_the_eviction(saga, event)
        assert not graceful or released
        terminal_effects += [e for e in decision.effects if isinstance(e, TERMINAL_EFFECTS)]
        if decision.saga.state in TERMINAL_STATES:
            terminal_decisions += 1
            assert decision.saga.outcome is not None
        saga = decision.saga

    assert terminal_decisions <= 1
    assert len(terminal_effects) == terminal_decisions
    assert (saga.outcome is not None) == (saga.state in TERMINAL_STATES)
