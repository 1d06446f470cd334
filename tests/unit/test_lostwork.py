"""The lost-work rule, and that every place counting lost work counts it the same way."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from gpusched.domain.elastic import VictimCandidate
from gpusched.domain.inventory import GpuRef, Pool
from gpusched.domain.ledger import PriorityClass
from gpusched.domain.lostwork import lost_gpu_seconds, lost_work_since
from gpusched.domain.saga import Begin, DeadlinePolicy, Stage, begin
from gpusched.domain.saga import lost_gpu_seconds as saga_lost_gpu_seconds

T0 = datetime(2026, 3, 1, 9, 0, tzinfo=UTC)

runs = st.integers(0, 100_000)
checkpoints = st.one_of(st.none(), st.integers(-10_000, 200_000))


def _at(seconds: int | None) -> datetime | None:
    return None if seconds is None else T0 + timedelta(seconds=seconds)


def test_a_run_without_a_checkpoint_loses_everything_since_it_started() -> None:
    assert lost_gpu_seconds(4, T0, None, T0 + timedelta(seconds=100)) == 400.0


def test_a_checkpoint_from_before_the_run_saves_nothing_of_the_run() -> None:
    earlier = T0 - timedelta(hours=1)
    assert lost_work_since(T0, earlier) == T0
    assert lost_gpu_seconds(2, T0, earlier, T0 + timedelta(seconds=50)) == 100.0


def test_a_run_that_cannot_checkpoint_loses_its_whole_run_whatever_it_claims() -> None:
    later = T0 + timedelta(seconds=40)
    assert lost_work_since(T0, later, checkpointable=False) == T0
    assert lost_gpu_seconds(1, T0, later, T0 + timedelta(seconds=60), checkpointable=False) == 60


def test_a_checkpoint_in_the_future_of_now_loses_nothing_rather_than_a_negative_amount() -> None:
    assert lost_gpu_seconds(8, T0, T0 + timedelta(seconds=90), T0 + timedelta(seconds=30)) == 0.0


@given(gpus=st.integers(1, 64), ran=runs, checkpoint_after=checkpoints)
def test_lost_work_counts_gpu_seconds_since_the_later_of_start_and_checkpoint(
    gpus: int, ran: int, checkpoint_after: int | None
) -> None:
    lost = lost_gpu_seconds(gpus, T0, _at(checkpoint_after), T0 + timedelta(seconds=ran))

    assert 0 <= lost <= gpus * ran
    if checkpoint_after is None or checkpoint_after <= 0:
        assert lost == gpus * ran
    elif checkpoint_after < ran:
        assert lost == gpus * (ran - checkpoint_after)


@given(gpus=st.integers(1, 16), ran=runs, checkpoint_after=checkpoints)
def test_the_saga_and_the_victim_choice_count_lost_work_by_the_same_rule(
    gpus: int, ran: int, checkpoint_after: int | None
) -> None:
    now = T0 + timedelta(seconds=ran)
    checkpoint_at = _at(checkpoint_after)
    expected = lost_gpu_seconds(gpus, T0, checkpoint_at, now)

    candidate = VictimCandidate(
        "alloc", "job", "team", PriorityClass.P1_NORMAL, gpus,
        tuple(GpuRef("n", i) for i in range(gpus)), T0, checkpoint_at, True, pool=Pool.SHARED,
    )  # fmt: skip
    assert candidate.lost_work_gpu_seconds(now) == expected

    saga, _ = begin(
        Begin(
            saga_id="s", request_id="r", allocation_id="alloc", job_id="job", gpus=gpus,
            started_at=T0, grace_s=60, policy=DeadlinePolicy.FORCE,
            stage_required=Stage.PERSISTED, reason="test", last_confirmed_at=checkpoint_at,
        ),
        T0,
    )  # fmt: skip
    assert saga_lost_gpu_seconds(saga, now) == expected
