"""Request/reply endpoints: read-only views of the catalogue and the sagas."""

from __future__ import annotations

from gpusched.checkpoint import store
from gpusched.checkpoint.api import (
    CatalogueView,
    GetSaga,
    GetSagaReply,
    JobHistory,
    JobHistoryReply,
    LatestCheckpoint,
    LatestCheckpointReply,
    checkpoint_info,
    saga_view,
)
from gpusched.contracts.messages import ApiError
from gpusched.contracts.validation import Invalid, parse_request
from gpusched.domain.saga import Stage
from gpusched.infra import access
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

    async def job_history(self, raw: bytes) -> JobHistoryReply:
        """A job's sagas and checkpoints: an operator's for any job, a team's for its own."""
        request = parse_request(JobHistory, raw)
        if isinstance(request, Invalid):
            return JobHistoryReply(ok=False, error=request.error())
        who = access.caller()
        async with self._uow() as uow:
            team = None if who.is_operator else await store.team_of(uow, request.job_id)
            sagas = await store.sagas_of_job(uow, request.job_id, request.limit)
            rows = await store.checkpoints_of_job(uow, request.job_id, request.limit)
        if not who.is_operator:
            # A job this service never saw has no history to hide; one it saw is shown to
            # its own team only (and to nobody but operators while its team is unknown).
            seen = team is not None or bool(sagas) or bool(rows)
            if who.team is None or (seen and team != who.team):
                why = (
                    f"it belongs to team {team}"
                    if team is not None
                    else "its team is not known to the checkpoint service"
                    if who.team is not None
                    else "only a team (its own jobs) or an operator reads a job's history"
                )
                error = await access.forbid(self._uow, "read history", request.job_id, why)
                return JobHistoryReply(ok=False, error=error)
        return JobHistoryReply(
            ok=True,
            job_id=request.job_id,
            sagas=[saga_view(saga) for saga in sagas],
            checkpoints=[
                CatalogueView(
                    checkpoint=info,
                    confirmed_at=row.entry.confirmed_at,
                    request_id=row.request_id,
                )
                for row in rows
                if (info := checkpoint_info(row.entry.checkpoint)) is not None
            ],
        )
