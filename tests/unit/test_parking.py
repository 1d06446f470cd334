"""The words a parked job and a cancel carry: pure, no I/O."""

from __future__ import annotations

from pydantic import ValidationError

from gpusched.admission.cancel import saga_id, who_and_why
from gpusched.admission.parking import reason_for
from gpusched.admission.store import UnreadableJob
from gpusched.contracts.messages import CancelJob, WorkloadSpec
from gpusched.domain.ledger import InvalidRequest


def test_an_unreadable_row_names_the_job_the_field_and_the_way_out() -> None:
    try:
        WorkloadSpec.model_validate({"step_seconds": None})
    except ValidationError as exc:
        cause = exc
    reason = reason_for(UnreadableJob("job-1", cause))
    assert reason.startswith("job job-1's stored row cannot be read: ")
    assert "step_seconds" in reason
    assert reason.endswith("fix or cancel the job (`gpusched cancel`)")
    assert "\n" not in reason


def test_a_ledger_refusal_is_said_as_such_and_any_other_failure_names_its_type() -> None:
    refused = reason_for(InvalidRequest("GPU inf-00/0 needs MIG layout 2g.20gb first"))
    assert refused == "refused by the ledger: GPU inf-00/0 needs MIG layout 2g.20gb first"
    bug = reason_for(KeyError("gpus"), "settling its ended workload")
    assert bug == "settling its ended workload failed on this job: KeyError: 'gpus'"


def test_a_long_multi_line_error_becomes_one_bounded_line() -> None:
    reason = reason_for(RuntimeError("x" * 2000 + "\nsecond line"))
    assert "\n" not in reason and len(reason) < 600


def test_a_cancel_says_who_and_why_and_its_eviction_names_the_job() -> None:
    assert who_and_why(CancelJob(job_id="job-1", operator="alice", reason="oops")) == (
        "cancelled by alice: oops"
    )
    assert who_and_why(CancelJob(job_id="job-1", operator="bob")) == "cancelled by bob"
    assert saga_id("job-1") == "cancel-job-1"
