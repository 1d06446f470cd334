"""Request/reply endpoints: read-only views of the catalogue and the sagas."""

from __future__ import annotations

from gpusched.checkpoint import store
from gpusched.checkpoint.api import (
    GetSaga,
    GetSagaReply,
    LatestCheckpoint,
    LatestCheckpointReply,
    checkpoint_info,
    saga_view,
)
from gpusched.contracts.messages import ApiError
from gpusched.contracts.validation import Invalid, parse_request
from gpusched.domain.saga import Stage
from gpusched.infra.db import UnitOfWorkFactory


class Queries:
    def __init__(self, uow: UnitOfWorkFactory) -> None:
        self._uow = uow

    async def latest_checkpoint(self, raw: bytes) -> LatestCheckpointReply:
        request = parse_request(LatestCheckpoint, raw)
        if isinstance(request, Invalid):
            return LatestCheckpointReply(ok=False, error=request.error())
        min_stage = Stage.SNAPSHOTTED if request.min_stage is None else Stage(request.min_stage)
        async with self._uow() as uow:
            entry = await store.latest_checkpoint(uow, request.job_id, min_stage)
        if entry is None:
            return LatestCheckpointReply(ok=True)
        return LatestCheckpointReply(
            ok=True, checkpoint=checkpoint_info(entry.checkpoint), confirmed_at=entry.confirmed_at
        )

    async def get_saga(self, raw: bytes) -> GetSagaReply:
        request = parse_request(GetSaga, raw)
        if isinstance(request, Invalid):
            return GetSagaReply(ok=False, error=request.error())
        async with self._uow() as uow:
            if request.saga_id is not None:
                saga = await store.get_saga(uow, request.saga_id)
            else:
                assert request.job_id is not None
                saga = await store.current_saga_of_job(uow, request.job_id)
        if saga is None:
            wanted = f"saga {request.saga_id}" if request.saga_id else f"job {request.job_id}"
            return GetSagaReply(
                ok=False, error=ApiError(code="not_found", message=f"no saga for {wanted}")
            )
        return GetSagaReply(ok=True, saga=saga_view(saga))
