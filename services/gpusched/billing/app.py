"""Billing's composition root: the price book, the ledger consumer, the statement API."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import yaml

from gpusched.billing.api import job_bill_subject, statement_subject
from gpusched.billing.handlers import LedgerHandlers, StatementEndpoint
from gpusched.billing.per_job import JobBillEndpoint
from gpusched.contracts.messages import T
from gpusched.domain.pricing import PriceBook
from gpusched.infra import bus
from gpusched.infra.migrations import migrations_dir
from gpusched.infra.runtime import ServiceRuntime, run_service
from gpusched.infra.settings import BillingSettings, Settings
from gpusched.infra.textfiles import FileRefused, read_small_text

NAME = "billing"
SCHEMA = "billing"
DURABLE = "billing-ledger"


def load_price_book(settings: BillingSettings) -> PriceBook:
    """The price book file; settings supply the currency and default GPU price it omits.

    A missing or invalid book stops the service at start, not at the first statement.
    """
    path = Path(settings.price_book_path)
    try:
        data = yaml.safe_load(read_small_text(path))
    except (OSError, FileRefused, UnicodeDecodeError) as exc:
        raise RuntimeError(f"billing: cannot read the price book {path}: {exc}") from exc
    if not isinstance(data, Mapping):
        raise RuntimeError(f"billing: the price book {path} must be a mapping")
    merged = dict(data)
    merged.setdefault("currency", settings.currency)
    if settings.default_gpu_hour is not None:
        merged.setdefault("default_gpu_hour", str(settings.default_gpu_hour))
    try:
        return PriceBook.from_mapping(merged)
    except ValueError as exc:
        raise RuntimeError(f"billing: {path}: {exc}") from exc


async def build(rt: ServiceRuntime) -> None:
    book = load_price_book(rt.settings.billing)
    ledger = LedgerHandlers(book)
    s = rt.subjects
    # One consumer for both producers: the stream keeps a grant before the forced
    # eviction of the same allocation, so the credit always finds its usage.
    rt.consume(
        bus.Consumer(
            durable=DURABLE,
            stream=s.stream("EVENTS"),
            subjects=[
                s.event("admission", T.ALLOCATION_GRANTED),
                s.event("admission", T.ALLOCATION_RELEASED),
                s.event("checkpoint", T.EVICTION_FORCED),
            ],
            handlers={
                T.ALLOCATION_GRANTED: ledger.on_allocation_granted,
                T.ALLOCATION_RELEASED: ledger.on_allocation_released,
                T.EVICTION_FORCED: ledger.on_eviction_forced,
            },
        )
    )
    rt.serve(statement_subject(s.prefix), StatementEndpoint(rt.uow, book))
    rt.serve(job_bill_subject(s.prefix), JobBillEndpoint(rt.uow, book))


def main() -> None:
    run_service(ServiceRuntime(NAME, SCHEMA, Settings(), migrations_dir(__file__)), build)
