"""Billing's metrics: metered GPU time and its price, and the credits for lost work.

Counted from the events billing applies, when their transaction commits, with the
price book the service runs with: a running total for dashboards and alerts, in the
currency's units as floats. The statement (`gpusched bill`) stays the exact record
(Decimal, priced for its period). GPU time is counted when an allocation closes.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

from prometheus_client import Counter

from gpusched.domain.pricing import MILLI_PER_GPU, PriceBook, UnknownGpuModel

METERED_GPU_SECONDS = Counter(
    "gpusched_billed_gpu_seconds_total",
    "GPU-seconds metered for allocations that ended, by team and GPU model",
    ["team", "model"],
)
METERED_AMOUNT = Counter(
    "gpusched_billed_amount_total",
    "GPU time of ended allocations at the current price book, by team (currency units)",
    ["team"],
)
CREDITED_GPU_SECONDS = Counter(
    "gpusched_credited_gpu_seconds_total",
    "GPU-seconds of work lost to forced preemption and credited, by team",
    ["team"],
)
CREDITED_AMOUNT = Counter(
    "gpusched_credited_amount_total",
    "Credits for work lost to forced preemption at the current price book, by team",
    ["team"],
)


def _hours_price(book: PriceBook, model: str, gpu_seconds: Decimal) -> float | None:
    try:
        return float(book.gpu_hour_price(model) * gpu_seconds / 3600)
    except UnknownGpuModel:
        return None  # metered; priced once the book names the model (billing.unpriced)


def allocation_opened(team: str, gpu_milli: dict[str, int]) -> None:
    """Create the team's series at 0 when billing first meters it, so the first closing
    and the first credit show in increase() and rate()."""
    for model in gpu_milli:
        METERED_GPU_SECONDS.labels(team, model)
    METERED_AMOUNT.labels(team)
    CREDITED_GPU_SECONDS.labels(team)
    CREDITED_AMOUNT.labels(team)


def allocation_closed(
    book: PriceBook,
    team: str,
    opened_at: datetime,
    closed_at: datetime,
    gpu_milli: dict[str, int],
) -> None:
    seconds = Decimal(max(0.0, (closed_at - opened_at).total_seconds()))
    for model, milli in sorted(gpu_milli.items()):
        gpu_seconds = seconds * milli / MILLI_PER_GPU
        METERED_GPU_SECONDS.labels(team, model).inc(float(gpu_seconds))
        amount = _hours_price(book, model, gpu_seconds)
        if amount is not None:
            METERED_AMOUNT.labels(team).inc(amount)


def credited(book: PriceBook, team: str, model: str, lost_gpu_seconds: Decimal) -> None:
    CREDITED_GPU_SECONDS.labels(team).inc(float(lost_gpu_seconds))
    amount = _hours_price(book, model, lost_gpu_seconds)
    if amount is not None:
        CREDITED_AMOUNT.labels(team).inc(amount)
