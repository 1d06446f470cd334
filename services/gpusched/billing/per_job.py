"""`<p>.api.billing.job`: what one job cost and was credited, for `gpusched get`.

The team a job's usage was recorded under decides who may read it: that team, or an
operator. Nothing is written (a statement is audited; this is a read of one job).
"""

from __future__ import annotations

from datetime import timedelta

from gpusched.billing import statement, store
from gpusched.billing.api import ErrorCode, JobBillReply, JobBillRequest
from gpusched.billing.handlers import Clock
from gpusched.contracts.envelope import utcnow
from gpusched.contracts.messages import ApiError
from gpusched.contracts.validation import Invalid, parse_request
from gpusched.domain.pricing import PriceBook, UnknownGpuModel, build_statements
from gpusched.infra import access
from gpusched.infra.db import UnitOfWorkFactory

_TICK = timedelta(microseconds=1)


class JobBillEndpoint:
    def __init__(self, uow: UnitOfWorkFactory, book: PriceBook, clock: Clock = utcnow) -> None:
        self._uow = uow
        self._book = book
        self._clock = clock

    async def __call__(self, raw: bytes) -> JobBillReply:
        request = parse_request(JobBillRequest, raw)
        if isinstance(request, Invalid):
            error = request.error().model_copy(update={"code": ErrorCode.BAD_REQUEST})
            return JobBillReply(ok=False, error=error)
        who = access.caller()
        async with self._uow() as uow:
            records = await store.usage_of_job(uow, request.job_id)
            credit_records = await store.credits_of_job(uow, request.job_id)
        teams = {r.team for r in records} | {c.team for c in credit_records}
        if not who.is_operator and (who.team is None or teams - {who.team}):
            why = (
                f"it belongs to team {', '.join(sorted(teams))}"
                if who.team is not None
                else "only a team (its own jobs) or an operator reads a job's bill"
            )
            error = await access.forbid(self._uow, "read bill", request.job_id, why)
            return JobBillReply(ok=False, error=error)
        if not records and not credit_records:
            return JobBillReply(ok=True, job_id=request.job_id)
        now = self._clock()
        start = min([r.opened_at for r in records] + [c.at for c in credit_records])
        try:
            statements = build_statements(
                statement.usages(records, billed_until=now),
                statement.credits(credit_records),
                self._book,
                start,
                # The end is exclusive: a credit recorded this very instant is included.
                max([now] + [c.at for c in credit_records]) + _TICK,
            )
        except UnknownGpuModel as exc:
            return JobBillReply(
                ok=False, error=ApiError(code=ErrorCode.UNKNOWN_GPU_MODEL, message=str(exc))
            )
        open_allocations = {r.allocation_id for r in records if r.closed_at is None}
        # One team's usage: one statement (a job never changes team).
        views = [statement.view(s, open_allocations) for s in statements]
        return JobBillReply(ok=True, job_id=request.job_id, statement=views[0] if views else None)
