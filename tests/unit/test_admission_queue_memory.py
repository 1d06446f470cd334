"""What the in-memory queue costs the garbage collector, and its records' plain-value form."""

from __future__ import annotations

import dataclasses
import gc
from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from gpusched.admission.index import QueueIndex
from gpusched.admission.queue import JobState
from gpusched.admission.store import JobRecord
from gpusched.contracts.messages import (
    CheckpointInfo,
    GpuRequest,
    JobKind,
    PriorityClassName,
    Replicas,
    StageName,
    SubmitJob,
)

T0 = datetime(2025, 3, 1, 9, 0, tzinfo=UTC)
CHECKPOINT = CheckpointInfo(
    checkpoint_id="ckpt-1", step=10, uri="file:///c/1", bytes=1, sha256="0" * 64,
    stage=StageName.PERSISTED,
)  # fmt: skip


def queued(number: int, **more: object) -> JobRecord:
    spec = SubmitJob(
        name=f"train-{number}", team=("vision", "nlp")[number % 2],
        priority_class=PriorityClassName.P1_NORMAL, gpus=GpuRequest(count=1 + number % 8),
        workload={"kind": "process", "argv": ["python", "train.py", str(number)]},
    )  # fmt: skip
    return JobRecord.of(
        f"job-{number:06d}", spec, JobState.QUEUED, 0, None, None,
        T0 + timedelta(seconds=number), ("a warning",), False, {"traceparent": "00-ab-cd-01"},
        **more,
    )  # fmt: skip


def tracked() -> int:
    gc.collect()
    return len(gc.get_objects())


def test_a_deep_queue_gives_the_cyclic_collector_nothing_more_to_walk() -> None:
    # Every full collection walks every object the collector tracks: a queue of
    # parsed requests made those walks, and the pauses, grow with the queue.
    index = QueueIndex()
    before = tracked()
    for number in range(20_000):
        index.put(queued(number))
    after = tracked()

    assert len(index) == 20_000
    # The index's own dicts and lists only, not anything per job.
    assert after - before < 100


def test_a_job_taken_from_the_index_is_the_job_put_in() -> None:
    job = queued(7, latest_checkpoint=CHECKPOINT, replica_target=3, parked_reason="why")
    requeued = JobRecord.of(
        "job-requeued", job.spec, JobState.QUEUED, 2, None, CHECKPOINT, T0, (), True, {},
    )  # fmt: skip
    index = QueueIndex([job, requeued])

    assert index.get(job.job_id) == job
    assert index.get("job-requeued") == requeued
    assert index.get(job.job_id).spec == job.spec  # type: ignore[union-attr]


@settings(max_examples=50, deadline=None)
@given(
    kind=st.sampled_from(JobKind),
    count=st.integers(1, 64),
    model=st.none() | st.sampled_from(["A100-80GB", "H100-80GB"]),
    memory=st.none() | st.floats(0.5, 80.0),
    milli=st.none() | st.integers(1, 1000),
    replicas=st.none() | st.tuples(st.integers(1, 4), st.integers(4, 8)),
    trace=st.dictionaries(st.sampled_from(["traceparent", "tracestate"]), st.text(max_size=20)),
)
def test_a_record_round_trips_through_its_row_of_plain_values(
    kind: JobKind,
    count: int,
    model: str | None,
    memory: float | None,
    milli: int | None,
    replicas: tuple[int, int] | None,
    trace: dict[str, str],
) -> None:
    spec = SubmitJob(
        name="job", team="vision", kind=kind, gpus=GpuRequest(
            count=count, model=model, memory_gib=memory, milli=milli,
            min_count=None if count == 1 else 1,
        ),
        replicas=None if replicas is None else Replicas(min=replicas[0], max=replicas[1]),
    )  # fmt: skip
    job = JobRecord.of(
        "job-1", spec, JobState.QUEUED, 1, None, CHECKPOINT, T0, ("w",), True, trace,
        replica_restart_at=T0,
    )  # fmt: skip

    assert JobRecord.from_row(job.as_row()) == job
    assert JobRecord.from_row(job.as_row()).gpus == spec.gpus
    waiting = dataclasses.replace(job, wait_audited=False)
    assert JobRecord.from_row(JobRecord.audited_row(waiting.as_row())) == job
