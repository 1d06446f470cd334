"""The controller's decisions as pure functions: pool reading + controller view -> what
to do. No I/O and no clock (``now`` is passed in); the sizing and victim rules are
domain/elastic.py's, this module adds what a running controller needs around them:
one decision in flight at a time, the cooldown between pool changes, idle shared GPUs
before evictions, and stale or incomplete readings.

Seams for the later work: hysteresis windows (a signal held long enough) belong before
``decide``'s threshold checks; minimum runtime belongs in the candidates the caller
passes; ``within_tier`` of ``choose_victims`` takes a fragmentation-aware order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from gpusched.domain.elastic import (
    ElasticThresholds,
    PoolSignals,
    VictimCandidate,
    VictimChoice,
    choose_victims,
    decide_expand,
    decide_shrink,
)

__all__ = [
    "ControllerLimits",
    "ControllerView",
    "Expand",
    "Hold",
    "PoolFigures",
    "PoolReading",
    "Shrink",
    "Withdraw",
    "decide",
    "replacement",
    "split_return",
]


@dataclass(frozen=True, slots=True)
class ControllerLimits:
    thresholds: ElasticThresholds
    cooldown_s: float
    # A snapshot older than this (a backlog after a restart) says nothing about now.
    max_reading_age_s: float


@dataclass(frozen=True, slots=True)
class PoolFigures:
    gpus: int
    util: float
    reporting_gpus: int

    @property
    def known(self) -> bool:
        return self.reporting_gpus > 0


@dataclass(frozen=True, slots=True)
class PoolReading:
    time: datetime
    inference: PoolFigures  # dedicated + lent GPUs
    shared: PoolFigures  # shared GPUs not lent


@dataclass(frozen=True, slots=True)
class ControllerView:
    """What the controller's own state says when a reading arrives."""

    in_flight: bool
    last_change_at: datetime | None
    last_shortfall_at: datetime | None
    lent_gpus: int
    shared_allocated_gpus: int  # GPUs held by live allocations in the shared pool
    candidates: tuple[VictimCandidate, ...]
    # Open evictions of the decision in flight not yet asked to cancel.
    withdrawable: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Withdraw:
    """The need that started the evictions in flight has gone: ask their sagas to
    cancel (a saga already evicting finishes; the others keep their jobs running)."""

    request_ids: tuple[str, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class Hold:
    reason: str


@dataclass(frozen=True, slots=True)
class Expand:
    """Lend ``gpus`` shared GPUs: ``free_gpus`` idle ones at once, the rest by evicting
    ``choice.victims``; ``shortfall`` GPUs could not be found at all."""

    signals: PoolSignals
    gpus: int
    free_gpus: int
    choice: VictimChoice
    shortfall: int
    reason: str

    @property
    def changes_pools(self) -> bool:
        return self.free_gpus > 0 or bool(self.choice.victims)


@dataclass(frozen=True, slots=True)
class Shrink:
    signals: PoolSignals
    gpus: int
    reason: str


Outcome = Hold | Expand | Shrink | Withdraw


def decide(
    reading: PoolReading, view: ControllerView, limits: ControllerLimits, now: datetime
) -> Outcome:
    age = (now - reading.time).total_seconds()
    if age > limits.max_reading_age_s:
        return Hold(f"reading is {age:.0f}s old")
    if not reading.inference.known:
        return Hold("no inference GPU reported")
    if view.in_flight:
        # The GPUs being freed do not serve yet, so a utilization back under the target
        # means the load itself fell: the evictions are no longer needed.
        target = limits.thresholds.target
        if view.withdrawable and reading.inference.util < target:
            return Withdraw(
                view.withdrawable,
                f"inference utilization {reading.inference.util:.2f} fell below the target "
                f"{target:.2f} before the evictions completed",
            )
        return Hold("a decision is in flight")
    shared_util = _shared_util(reading.shared)
    signals = PoolSignals(
        inference_util=reading.inference.util,
        shared_util=0.0 if shared_util is None else shared_util,
        inference_gpus=reading.inference.gpus,
        shared_available=reading.shared.gpus,
        lent_gpus=view.lent_gpus,
    )
    cooling = _cooldown_left(view.last_change_at, now, limits.cooldown_s)
    expand = decide_expand(signals, limits.thresholds)
    if expand is not None:
        if cooling > 0:
            return Hold(f"expand wanted, cooldown has {cooling:.0f}s left")
        free = min(expand.gpus, max(0, reading.shared.gpus - view.shared_allocated_gpus))
        choice = choose_victims(view.candidates, expand.gpus - free, now)
        outcome = Expand(
            signals=signals,
            gpus=expand.gpus,
            free_gpus=free,
            choice=choice,
            shortfall=expand.shortfall + choice.shortfall,
            reason=expand.reason,
        )
        if not outcome.changes_pools and _cooldown_left(
            view.last_shortfall_at, now, limits.cooldown_s
        ):
            # Nothing to lend and the shortfall was raised already: alert once per cooldown.
            return Hold("shortfall already raised")
        return outcome
    if shared_util is None:
        return Hold("no shared GPU reported")
    shrink = decide_shrink(signals, limits.thresholds)
    if shrink is None:
        return Hold("within the hysteresis band")
    if cooling > 0:
        return Hold(f"shrink wanted, cooldown has {cooling:.0f}s left")
    return Shrink(signals=signals, gpus=shrink.gpus, reason=shrink.reason)


def replacement(
    candidates: Iterable[VictimCandidate],
    missing: int,
    now: datetime,
    exclude: Iterable[str],
) -> VictimChoice:
    """Victims for GPUs an aborted eviction did not free, never one tried already."""
    excluded = set(exclude)
    return choose_victims([c for c in candidates if c.allocation_id not in excluded], missing, now)


def split_return(gpus: int, reservations: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
    """Spread a return of ``gpus`` over reservations given newest first, so the GPUs
    lent last go back first."""
    parts: list[tuple[str, int]] = []
    left = gpus
    for reservation_id, lent in reservations:
        if left <= 0:
            break
        take = min(left, lent)
        if take > 0:
            parts.append((reservation_id, take))
            left -= take
    return parts


def _shared_util(shared: PoolFigures) -> float | None:
    # A shared pool with nothing left in it (all lent) trains nothing; one whose GPUs
    # all went silent is unknown, and unknown must not read as idle.
    if shared.known:
        return shared.util
    return 0.0 if shared.gpus == 0 else None


def _cooldown_left(since: datetime | None, now: datetime, cooldown_s: float) -> float:
    if since is None:
        return 0.0
    return max(0.0, (since + timedelta(seconds=cooldown_s) - now).total_seconds())
