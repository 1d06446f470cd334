"""Billing's service layer: meter allocations, credit forced preemption, price statements.

The ledger records what happened (allocation opened/closed, work lost); pricing happens
only when a statement is asked for, with the price book of that moment, so a price
change never rewrites what was recorded.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from datetime import datetime
from decimal import Decimal

from gpusched.billing import metrics, statement, store
from gpusched.billing.api import ErrorCode, StatementReply, StatementRequest
from gpusched.contracts.envelope import Envelope, utcnow
from gpusched.contracts.messages import (
    AllocationGranted,
    AllocationReleased,
    ApiError,
    EvictionForced,
    GpuRef,
    GpuShare,
)
from gpusched.contracts.validation import Invalid, parse_request
from gpusched.domain.pricing import (
    MILLI_PER_GPU,
    PriceBook,
    UnknownGpuModel,
    build_statements,
    render_statement,
)
from gpusched.infra import access
from gpusched.infra.db import UnitOfWork, UnitOfWorkFactory
from gpusched.infra.errors import Rejected

log = logging.getLogger(__name__)

Clock = Callable[[], datetime]


def gpu_milli_by_model(gpus: list[GpuRef], share: GpuShare | None = None) -> dict[str, int]:
    # A granted GpuRef is one whole GPU, unless the grant holds a share of its one GPU
    # (a fraction, or a MIG slice: its compute slices / 7): then it is charged that share.
    if share is not None:
        return {gpu.model: share.milli for gpu in gpus[:1]}
    per_gpu = int(MILLI_PER_GPU)
    return {model: count * per_gpu for model, count in Counter(g.model for g in gpus).items()}


class LedgerHandlers:
    """Consumers of admission's and checkpoint's events, writing billing's ledger."""

    def __init__(self, book: PriceBook) -> None:
        self._book = book

    async def on_allocation_granted(self, envelope: Envelope, uow: UnitOfWork) -> None:
        granted = envelope.payload(AllocationGranted)
        gpu_milli = gpu_milli_by_model(granted.gpus, granted.share)
        recorded = await store.record_opened(
            uow,
            allocation_id=granted.allocation_id,
            at=granted.granted_at,
            team=granted.team,
            job_id=granted.job_id,
            kind=granted.kind.value,
            gpu_milli=gpu_milli,
            cpu_cores=granted.cpu_cores,
            memory_gb=granted.memory_gb,
            disk_gb=Decimal(0),
            message_id=envelope.id,
        )
        if not recorded:
            return  # the same allocation announced again under another envelope
        uow.on_commit(lambda: metrics.allocation_opened(granted.team, gpu_milli))
        unpriced = sorted(m for m in gpu_milli if not _priced(self._book, m))
        if unpriced:
            # Metered all the same (the usage happened); the statement request will fail
            # with unknown_gpu_model until the price book names the model.
            await uow.audit(
                "billing.unpriced",
                entity=granted.allocation_id,
                reason=f"no price for GPU model(s) {', '.join(unpriced)}",
                details={"team": granted.team, "job_id": granted.job_id, "models": unpriced},
                correlation_id=granted.job_id,
                causation_id=envelope.id,
            )

    async def on_allocation_released(self, envelope: Envelope, uow: UnitOfWork) -> None:
        released = envelope.payload(AllocationReleased)
        # Recorded even without a known opening: the pair is matched when priced, so the
        # order in which the two arrive does not matter.
        closing = await store.record_closed(
            uow,
            allocation_id=released.allocation_id,
            at=released.released_at,
            team=released.team,
            job_id=released.job_id,
            message_id=envelope.id,
        )
        opened_at = closing.opened_at
        if closing.recorded and opened_at is not None:
            uow.on_commit(
                lambda: metrics.allocation_closed(
                    self._book, released.team, opened_at, released.released_at, closing.gpu_milli
                )
            )

    async def on_eviction_forced(self, envelope: Envelope, uow: UnitOfWork) -> None:
        forced = envelope.payload(EvictionForced)
        usage = await store.find_allocation(uow, forced.allocation_id)
        if usage is None:
            # Admission's grant precedes the eviction on the same ordered consumer, so an
            # allocation billing never saw opened will not appear later.
            raise Rejected(
                f"forced eviction of allocation {forced.allocation_id} that billing has "
                "no usage for"
            )
        model = usage.main_gpu_model
        if not model:
            raise Rejected(f"forced eviction of allocation {forced.allocation_id} with no GPUs")
        credit = store.CreditRecord(
            saga_id=forced.saga_id,
            allocation_id=forced.allocation_id,
            team=usage.team,
            job_id=forced.job_id,
            gpu_model=model,
            # The float on the wire becomes its shortest decimal form, not its binary
            # expansion, so 120.1 lost GPU-seconds is credited as exactly 120.1.
            lost_gpu_seconds=Decimal(str(forced.lost_gpu_seconds)),
            at=envelope.time,
        )
        if not await store.record_credit(uow, credit, message_id=envelope.id):
            return
        uow.on_commit(
            lambda: metrics.credited(self._book, usage.team, model, credit.lost_gpu_seconds)
        )
        await uow.audit(
            "billing.credit",
            entity=forced.allocation_id,
            reason="work lost to a forced preemption is credited at its GPU model's price",
            details={
                "saga_id": forced.saga_id,
                "team": usage.team,
                "job_id": forced.job_id,
                "gpu_model": model,
                "lost_gpu_seconds": str(credit.lost_gpu_seconds),
            },
            correlation_id=forced.saga_id,
            causation_id=envelope.id,
        )


class StatementEndpoint:
    """`<p>.api.billing.statement`: price the ledger for a period, per team."""

    def __init__(self, uow: UnitOfWorkFactory, book: PriceBook, clock: Clock = utcnow) -> None:
        self._uow = uow
        self._book = book
        self._clock = clock

    async def __call__(self, raw: bytes) -> StatementReply:
        request = parse_request(StatementRequest, raw)
        if isinstance(request, Invalid):
            # Billing's published code for a bad request; the field is named as everywhere.
            error = request.error().model_copy(update={"code": ErrorCode.BAD_REQUEST})
            return StatementReply(ok=False, error=error)
        who = access.caller()
        if who.team is not None:
            # A team is billed, and reads the bill of, itself only.
            if request.team not in (None, who.team):
                why = f"a team reads its own statement ({who.team}), not {request.team}'s"
                return StatementReply(
                    ok=False, error=await access.forbid(self._uow, "read statement", "-", why)
                )
            request = request.model_copy(update={"team": who.team})
        elif not who.is_operator:
            why = "only a team (its own) or an operator reads statements"
            return StatementReply(
                ok=False, error=await access.forbid(self._uow, "read statement", "-", why)
            )
        now = self._clock()
        async with self._uow() as uow:
            end = request.period_end or now
            start = request.period_start or await store.first_activity(uow, request.team)
            if start is None or start >= end:
                return StatementReply(
                    ok=True, text=statement.empty_text(request.team, start or end, end)
                )
            records = await store.usage_between(uow, start, end, request.team)
            credit_records = await store.credits_between(uow, start, end, request.team)
            # An open allocation is billed up to the end of the period, but never for
            # time that has not happened yet.
            usages = statement.usages(records, billed_until=min(end, now))
            try:
                statements = build_statements(
                    usages, statement.credits(credit_records), self._book, start, end
                )
            except UnknownGpuModel as exc:
                log.warning("statement refused: %s", exc)
                return _error(ErrorCode.UNKNOWN_GPU_MODEL, str(exc))
            if not statements:
                return StatementReply(ok=True, text=statement.empty_text(request.team, start, end))
            await uow.audit(
                "billing.statement",
                entity=request.team or "all-teams",
                reason="usage priced for the period",
                details={
                    "period_start": start.isoformat(),
                    "period_end": end.isoformat(),
                    "totals": {s.team: str(s.total) for s in statements},
                    # The book the amounts came from, so a statement can be re-derived
                    # after the prices change.
                    "price_book": self._book.to_mapping(),
                },
            )
            await uow.commit()
        open_allocations = {r.allocation_id for r in records if r.closed_at is None}
        return StatementReply(
            ok=True,
            statements=[statement.view(s, open_allocations) for s in statements],
            text=statement.joined_text([render_statement(s) for s in statements]),
        )


def _priced(book: PriceBook, model: str) -> bool:
    try:
        book.gpu_hour_price(model)
    except UnknownGpuModel:
        return False
    return True


def _error(code: ErrorCode, message: str) -> StatementReply:
    return StatementReply(ok=False, error=ApiError(code=code.value, message=message))
