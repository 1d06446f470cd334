"""From ledger records to priced statements and their wire form (pure: no I/O, no clock)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime

from gpusched.billing.api import CreditView, LineView, StatementView
from gpusched.billing.store import AllocationUsage, CreditRecord
from gpusched.domain.pricing import ZERO, Credit, Statement, Usage, UsageKind


def usages(records: Iterable[AllocationUsage], billed_until: datetime) -> list[Usage]:
    """The priced form of each allocation; an open one runs until `billed_until`.

    An allocation holding GPUs of several models becomes one usage per model (each
    priced at its own model's price); its CPU, memory and disk go with the first, so
    they are billed once.
    """
    out: list[Usage] = []
    for record in records:
        start = record.opened_at
        end = record.closed_at if record.closed_at is not None else billed_until
        # A release stamped before its grant (clock skew between producers) bills nothing
        # rather than failing the whole statement.
        end = max(start, end)
        models = sorted(record.gpu_milli.items()) or [("", 0)]
        for i, (model, milli) in enumerate(models):
            first = i == 0
            out.append(
                Usage(
                    team=record.team,
                    allocation_id=record.allocation_id,
                    job_id=record.job_id,
                    kind=UsageKind(record.kind),
                    start=start,
                    end=end,
                    gpu_model=model,
                    gpu_milli=milli,
                    cpu_cores=record.cpu_cores if first else ZERO,
                    memory_gb=record.memory_gb if first else ZERO,
                    disk_gb=record.disk_gb if first else ZERO,
                )
            )
    return out


def credits(records: Iterable[CreditRecord]) -> list[Credit]:
    return [
        Credit(
            team=r.team,
            job_id=r.job_id,
            allocation_id=r.allocation_id,
            gpu_model=r.gpu_model,
            lost_gpu_seconds=r.lost_gpu_seconds,
            at=r.at,
        )
        for r in records
    ]


def view(statement: Statement, open_allocations: set[str]) -> StatementView:
    return StatementView(
        team=statement.team,
        currency=statement.currency,
        period_start=statement.period_start,
        period_end=statement.period_end,
        lines=[
            LineView(
                allocation_id=li.allocation_id,
                job_id=li.job_id,
                kind=li.kind.value,
                gpu_model=li.gpu_model,
                start=li.start,
                end=li.end,
                open=li.allocation_id in open_allocations,
                gpu_seconds=li.gpu_seconds,
                gpu_cost=li.gpu_cost,
                cpu_cost=li.cpu_cost,
                memory_cost=li.memory_cost,
                disk_cost=li.disk_cost,
                requests=li.requests,
                request_cost=li.request_cost,
                total=li.total,
            )
            for li in statement.lines
        ],
        credits=[
            CreditView(
                allocation_id=c.allocation_id,
                job_id=c.job_id,
                gpu_model=c.gpu_model,
                at=c.at,
                lost_gpu_seconds=c.lost_gpu_seconds,
                amount=c.amount,
            )
            for c in statement.credits
        ],
        subtotal=statement.subtotal,
        credits_total=statement.credits_total,
        total=statement.total,
    )


def empty_text(team: str | None, start: datetime, end: datetime) -> str:
    who = f"team {team}" if team else "any team"
    return f"No usage or credits for {who} in {start.isoformat()} .. {end.isoformat()}\n"


def joined_text(rendered: Sequence[str]) -> str:
    return "\n".join(rendered)
