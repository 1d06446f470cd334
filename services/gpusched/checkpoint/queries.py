"""Request/reply endpoints: read-only views of the catalogue and the sagas."""

from __future__ import annotations

from pydantic import ValidationError

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
from gpusched.domain.saga import Stage
from gpusched.infra.db import UnitOfWorkFactory


def _invalid(exc: ValidationError) -> ApiError:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ())) or "(root)"
    return ApiError(code="invalid_request", message=f"{where}: {err.get('msg', 'invalid')}")


class Queries:
    def __init__(self, uow: UnitOfWorkFactory) -> None:
        self._uow = uow

    async def latest_checkpoint(self, raw: bytes) -> LatestCheckpointReply:
        try:
            request = LatestCheckpoint.model_validate_json(raw)
        except ValidationError as exc:
            return LatestCheckpointReply(ok=False, error=_invalid(exc))
        min_stage = Stage.SNAPSHOTTED if request.min_stage is None else Stage(request.min_stage)
        async with self._uow() as uow:
            entry = await store.latest_checkpoint(uow, request.job_id, min_stage)
        if entry is None:
            return LatestCheckpointReply(ok=True)
        return LatestCheckpointReply(
            ok=True, checkpoint=checkpoint_info(entry.checkpoint), confirmed_at=entry.confirmed_at
        )

    async def get_saga(self, raw: bytes) -> GetSagaReply:
        try:
            request = GetSaga.model_validate_json(raw)
        except ValidationError as exc:
            return GetSagaReply(ok=False, error=_invalid(exc))
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
