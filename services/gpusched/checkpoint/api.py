"""The checkpoint service's request/reply API: payloads and subjects.

Requests are plain JSON (no envelope), like the jobs API (DESIGN §4):
- `<p>.api.checkpoints.latest` {job_id, min_stage?} -> {ok, checkpoint | null}: the latest
  usable checkpoint of a job (highest step; at the same step a persisted one first).
- `<p>.api.sagas.get` {saga_id} or {job_id} -> {ok, saga}: an eviction saga, for the CLI
  and operators; by job, its live saga if it has one, else its most recent.
- `<p>.api.checkpoints.history` {job_id} -> {ok, sagas, checkpoints}: a job's eviction
  history and its catalogued checkpoints, newest first (`gpusched get` and `why`); a team
  may read its own jobs' (the team of each job comes from admission's grants).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, Strict, model_validator

from gpusched.contracts.messages import ApiError, CheckpointInfo, StageName
from gpusched.contracts.subjects import Subjects
from gpusched.contracts.validation import Id
from gpusched.domain.saga import CheckpointRef, DeadlinePolicy, Outcome, Saga, SagaState


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def latest_checkpoint_subject(subjects: Subjects) -> str:
    return f"{subjects.prefix}.api.checkpoints.latest"


def get_saga_subject(subjects: Subjects) -> str:
    return f"{subjects.prefix}.api.sagas.get"


def job_history_subject(subjects: Subjects) -> str:
    return f"{subjects.prefix}.api.checkpoints.history"


class LatestCheckpoint(_Wire):
    job_id: str
    min_stage: StageName | None = None  # e.g. only persisted ones, for a resume elsewhere


class LatestCheckpointReply(_Wire):
    ok: bool
    checkpoint: CheckpointInfo | None = None
    confirmed_at: datetime | None = None
    error: ApiError | None = None


class GetSaga(_Wire):
    saga_id: str | None = None
    job_id: str | None = None

    @model_validator(mode="after")
    def _exactly_one_key(self) -> GetSaga:
        if (self.saga_id is None) == (self.job_id is None):
            raise ValueError("give exactly one of saga_id and job_id")
        return self


class SagaView(_Wire):
    saga_id: str
    request_id: str
    allocation_id: str
    job_id: str
    gpus: int
    reason: str
    state: SagaState
    outcome: Outcome | None
    stage_required: StageName
    policy: DeadlinePolicy
    deadline: datetime
    started_at: datetime
    created_at: datetime
    updated_at: datetime
    checkpoint: CheckpointInfo | None  # the confirmation the eviction waited for
    last_confirmed: CheckpointInfo | None
    evict_attempts: int
    lost_gpu_seconds: float


class GetSagaReply(_Wire):
    ok: bool
    saga: SagaView | None = None
    error: ApiError | None = None


def checkpoint_info(ref: CheckpointRef | None) -> CheckpointInfo | None:
    if ref is None:
        return None
    return CheckpointInfo(
        checkpoint_id=ref.checkpoint_id,
        step=ref.step,
        uri=ref.uri,
        bytes=ref.bytes,
        sha256=ref.sha256,
        stage=StageName(ref.stage.value),
    )


def saga_view(saga: Saga) -> SagaView:
    return SagaView(
        saga_id=saga.saga_id,
        request_id=saga.request_id,
        allocation_id=saga.allocation_id,
        job_id=saga.job_id,
        gpus=saga.gpus,
        reason=saga.reason,
        state=saga.state,
        outcome=saga.outcome,
        stage_required=StageName(saga.stage_required.value),
        policy=saga.policy,
        deadline=saga.deadline,
        started_at=saga.started_at,
        created_at=saga.created_at,
        updated_at=saga.updated_at,
        checkpoint=checkpoint_info(saga.checkpoint),
        last_confirmed=checkpoint_info(saga.last_confirmed),
        evict_attempts=saga.evict_attempts,
        lost_gpu_seconds=saga.lost_gpu_seconds,
    )


# The most of each a history reply holds (the newest ones); a job evicted more often than
# this shows its latest evictions.
HISTORY_MAX = 100


class JobHistory(_Wire):
    job_id: Id
    limit: Annotated[int, Strict(), Field(ge=1, le=HISTORY_MAX)] = 20


class CatalogueView(_Wire):
    checkpoint: CheckpointInfo
    confirmed_at: datetime
    request_id: str | None  # None: a periodic checkpoint


class JobHistoryReply(_Wire):
    ok: bool
    job_id: str | None = None
    sagas: list[SagaView] = Field(default_factory=list)
    checkpoints: list[CatalogueView] = Field(default_factory=list)
    error: ApiError | None = None
