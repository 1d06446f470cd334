"""Signals held over windows (DESIGN §7): a pool reading says what is true now; the
controller acts only on a condition that has been true for its whole window.

Pure: ``fold`` turns (what was held, a new reading) into what is held now, and the
caller keeps the result in the database, so the windows survive a restart and a
failover to another replica. A condition that lapses for a single reading starts its
window again: a load oscillating around a threshold never holds long enough to act.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from gpusched.domain.elastic import ElasticThresholds

__all__ = [
    "HeldSignals",
    "PoolFigures",
    "PoolReading",
    "ServiceReading",
    "SignalLimits",
    "expand_causes",
    "fold",
    "held_for",
    "shrink_cause",
]


@dataclass(frozen=True, slots=True)
class PoolFigures:
    gpus: int
    util: float
    reporting_gpus: int

    @property
    def known(self) -> bool:
        return self.reporting_gpus > 0


@dataclass(frozen=True, slots=True)
class ServiceReading:
    service: str
    p99_ms: float
    queue_depth: int


@dataclass(frozen=True, slots=True)
class PoolReading:
    time: datetime
    inference: PoolFigures  # dedicated + lent GPUs
    shared: PoolFigures  # shared GPUs not lent
    services: tuple[ServiceReading, ...] = ()
    window_s: float = 0.0  # the span the figures average, ending at ``time``

    @property
    def window_start(self) -> datetime:
        return self.time - timedelta(seconds=self.window_s)


@dataclass(frozen=True, slots=True)
class SignalLimits:
    expand_hold_s: float = 30.0
    shrink_hold_s: float = 600.0
    # Per inference service: its P99 SLO. A P99 above ``slo_fraction`` of it expands.
    slo_ms: Mapping[str, float] = field(default_factory=dict)
    slo_fraction: float = 0.80
    # Requests waiting in one service's queue above which the pool expands; None: off.
    queue_above: int | None = None


@dataclass(frozen=True, slots=True)
class HeldSignals:
    """Since when each condition has been true without a break (None: not true now)."""

    reading_at: datetime | None = None  # the newest reading folded in
    expand_since: datetime | None = None
    shrink_since: datetime | None = None


def expand_causes(
    reading: PoolReading, thresholds: ElasticThresholds, limits: SignalLimits
) -> tuple[str, ...]:
    """Every reason this reading asks for more inference GPUs, in a fixed order."""
    causes: list[str] = []
    if reading.inference.known and reading.inference.util > thresholds.expand_above:
        causes.append(
            f"inference utilization {reading.inference.util:.2f} > {thresholds.expand_above:.2f}"
        )
    for service in sorted(reading.services, key=lambda s: s.service):
        slo = limits.slo_ms.get(service.service)
        if slo is not None and service.p99_ms > limits.slo_fraction * slo:
            causes.append(
                f"{service.service} P99 {service.p99_ms:.0f} ms > "
                f"{limits.slo_fraction:.0%} of its {slo:.0f} ms SLO"
            )
        if limits.queue_above is not None and service.queue_depth > limits.queue_above:
            causes.append(f"{service.service} queue {service.queue_depth} > {limits.queue_above}")
    return tuple(causes)


def shrink_cause(reading: PoolReading, thresholds: ElasticThresholds) -> str | None:
    """Inference quiet and the shared pool not busy: the lent GPUs may go back."""
    inference, shared = reading.inference, reading.shared
    if not inference.known or inference.util >= thresholds.shrink_below:
        return None
    # A shared pool with nothing left in it (all lent) trains nothing; one whose GPUs
    # all went silent is unknown, and unknown must not read as idle.
    if shared.known:
        shared_util = shared.util
    elif shared.gpus == 0:
        shared_util = 0.0
    else:
        return None
    if shared_util >= thresholds.shared_below:
        return None
    return (
        f"inference utilization {inference.util:.2f} < {thresholds.shrink_below:.2f} and "
        f"shared utilization {shared_util:.2f} < {thresholds.shared_below:.2f}"
    )


def fold(
    held: HeldSignals,
    reading: PoolReading,
    thresholds: ElasticThresholds,
    limits: SignalLimits,
    last_change_at: datetime | None = None,
) -> HeldSignals:
    """What is held after ``reading``. A reading older than one folded already (replicas
    may apply snapshots out of order) changes nothing. A window never starts before the
    last pool change: a reading whose window began before it averages a pool that no
    longer exists (the GPUs just lent or returned do not show in it yet), so it is kept
    as the newest reading but starts no window and continues none."""
    if held.reading_at is not None and reading.time <= held.reading_at:
        return held
    if last_change_at is not None and reading.window_start < last_change_at:
        return replace(held, reading_at=reading.time, expand_since=None, shrink_since=None)
    start = reading.time

    def since(was: datetime | None, true_now: bool) -> datetime | None:
        if not true_now:
            return None
        return start if was is None else was

    return replace(
        held,
        reading_at=reading.time,
        expand_since=since(held.expand_since, bool(expand_causes(reading, thresholds, limits))),
        shrink_since=since(held.shrink_since, shrink_cause(reading, thresholds) is not None),
    )


def held_for(since: datetime | None, now: datetime) -> float:
    """Seconds a condition has held at ``now``; -1 when it does not hold."""
    if since is None:
        return -1.0
    return max(0.0, (now - since).total_seconds())
