"""When a starving gang's stored reservation ends: pure, time passed in."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from gpusched.admission.queue import JobState
from gpusched.admission.reservations import (
    Reservation,
    ReservationEnd,
    describe,
    ended_reason,
    lapsed,
)
from gpusched.admission.store import JobRecord
from gpusched.contracts.messages import GpuRequest, SubmitJob

T0 = datetime(2026, 1, 1, tzinfo=UTC)
STARVE = timedelta(minutes=30)


def gang(state: JobState = JobState.QUEUED, job_id: str = "job-big") -> JobRecord:
    spec = SubmitJob(name="big", team="vision", gpus=GpuRequest(count=4))
    return JobRecord.of(
        job_id=job_id, spec=spec, state=state, attempt=0, allocation_id=None, resume_from=None,
        submitted_at=T0, warnings=(), wait_audited=True, trace={},
    )  # fmt: skip


HELD = Reservation("job-big", ("shared-00",), T0 + timedelta(minutes=5), "waited 300 s")


@given(st.integers(min_value=0, max_value=int(STARVE.total_seconds()) - 1))
def test_a_reservation_holds_while_its_gang_is_queued_and_under_the_timeout(waited: int) -> None:
    assert lapsed(HELD, gang(), T0 + timedelta(seconds=waited), STARVE) is None


@given(st.integers(min_value=0, max_value=10**6))
def test_a_reservation_ends_once_its_gang_waited_the_timeout(extra: int) -> None:
    now = T0 + STARVE + timedelta(seconds=extra)

    assert lapsed(HELD, gang(), now, STARVE) is ReservationEnd.TIMED_OUT


def test_a_reservation_ends_when_its_job_left_the_queue_or_is_gone() -> None:
    now = T0 + timedelta(minutes=10)
    for state in (JobState.HELD, JobState.RUNNING, JobState.FAILED, JobState.COMPLETED):
        assert lapsed(HELD, gang(state), now, STARVE) is ReservationEnd.LEFT_QUEUE
    assert lapsed(HELD, None, now, STARVE) is ReservationEnd.LEFT_QUEUE
    assert lapsed(HELD, gang(job_id="job-other"), now, STARVE) is ReservationEnd.LEFT_QUEUE


def test_the_words_name_the_node_how_long_it_is_held_and_why_it_ended() -> None:
    words = describe(HELD, HELD.since + timedelta(seconds=42))

    assert "shared-00" in words and "42 s" in words and "waited 300 s" in words
    assert "placed" in ended_reason(ReservationEnd.PLACED, gang(), STARVE)
    assert "1800 s" in ended_reason(ReservationEnd.TIMED_OUT, gang(), STARVE)
    left = ended_reason(ReservationEnd.LEFT_QUEUE, replace(gang(), state=JobState.HELD), STARVE)
    assert "held" in left
