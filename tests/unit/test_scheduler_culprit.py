"""Which failures of a scheduling pass set a job aside: pure, no I/O."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from gpusched.admission.keeper import LedgerKeeper
from gpusched.admission.parking import Where
from gpusched.admission.queue import JobState
from gpusched.admission.scheduler import Scheduler
from gpusched.admission.store import JobRecord, UnreadableJob
from gpusched.contracts.messages import GpuRequest, SubmitJob
from gpusched.infra.errors import Unavailable


def _scheduler() -> Scheduler:
    unused: Any = None
    return Scheduler(unused, LedgerKeeper(), unused, 1.0)


def _job(job_id: str) -> JobRecord:
    return JobRecord.of(
        job_id=job_id,
        spec=SubmitJob(name="train", team="vision", gpus=GpuRequest(count=1)),
        state=JobState.QUEUED,
        attempt=0,
        allocation_id=None,
        resume_from=None,
        submitted_at=datetime.now(UTC),
        warnings=(),
        wait_audited=False,
        trace={},
    )


def test_a_failure_on_the_job_being_placed_names_that_job() -> None:
    scheduler = _scheduler()
    scheduler._current = (_job("job-1"), Where.PLACEMENT)
    assert scheduler._culprit(ZeroDivisionError("bug")) == ("job-1", Where.PLACEMENT)


def test_an_unreadable_row_names_its_own_job_whatever_the_pass_was_doing() -> None:
    scheduler = _scheduler()
    scheduler._current = (_job("job-1"), Where.PLACEMENT)
    assert scheduler._culprit(UnreadableJob("job-2", ValueError("bad"))) == (
        "job-2",
        Where.UNREADABLE,
    )


def test_an_outage_never_names_a_job() -> None:
    scheduler = _scheduler()
    scheduler._current = (_job("job-1"), Where.PLACEMENT)
    assert scheduler._culprit(Unavailable("postgres is down")) is None
    assert scheduler._culprit(ConnectionResetError()) is None


def test_a_failure_outside_any_job_names_none() -> None:
    assert _scheduler()._culprit(RuntimeError("bulk write failed")) is None
