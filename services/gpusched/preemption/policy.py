"""The controller's decisions as pure functions: (held signals, the latest reading, the
controller's own state, now) -> what to do. No I/O and no clock of its own; the sizing
and victim rules are domain/elastic.py's, the windows are signals.py's. This module
adds what a running controller needs around them: a condition held for its window,
one decision in flight at a time, the cooldown between pool changes, the minimum time
lent GPUs stay lent, the eviction rate limit, idle shared GPUs before evictions, and
stale or incomplete readings.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from gpusched.domain.elastic import (
    ElasticThresholds,
    PoolSignals,
    VictimCandidate,
    VictimChoice,
    VictimOrder,
    choose_victims,
    decide_expand,
    decide_shrink,
    least_lost_work_first,
)
from gpusched.domain.inventory import GpuRef
from gpusched.infra.settings import PreemptionSettings
from gpusched.preemption.signals import (
    HeldSignals,
    PoolFigures,
    PoolReading,
    ServiceReading,
    SignalLimits,
    expand_causes,
    held_for,
    shrink_cause,
)

__all__ = [
    "ControllerLimits",
    "ControllerView",
    "Expand",
    "Hold",
    "LentReservation",
    "PoolFigures",
    "PoolReading",
    "ServiceReading",
    "Shrink",
    "Withdraw",
    "decide",
    "expand_due",
    "replacement",
    "returnable",
    "split_return",
]

EVICTION_RATE_WINDOW_S = 60.0  # max_evictions_per_min counts requests in this window


@dataclass(frozen=True, slots=True)
class ControllerLimits:
    thresholds: ElasticThresholds
    cooldown_s: float
    # A snapshot older than this (a backlog after a restart) says nothing about now.
    max_reading_age_s: float
    signals: SignalLimits = field(default_factory=SignalLimits)
    min_lend_s: float = 0.0
    min_runtime_s: float = 0.0
    max_evictions_per_min: int | None = None
    # How victims of one priority tier are ranked (a replay swaps it to measure what
    # ranking by lost work is worth).
    victim_order: VictimOrder = least_lost_work_first

    @classmethod
    def from_settings(cls, p: PreemptionSettings, max_reading_age_s: float) -> ControllerLimits:
        """The limits of a preemption settings section; ``max_reading_age_s``: ingest's
        staleness (a snapshot older than that is not acted on)."""
        return cls(
            # Refuses thresholds outside 0 < shrink_below < target < expand_above.
            thresholds=ElasticThresholds(
                expand_above=p.expand_above,
                target=p.target,
                shrink_below=p.shrink_below,
                shared_below=p.shared_below,
            ),
            cooldown_s=p.cooldown_s,
            max_reading_age_s=max_reading_age_s,
            signals=SignalLimits(
                expand_hold_s=p.expand_hold_s,
                shrink_hold_s=p.shrink_hold_s,
                slo_ms=dict(p.slo_ms),
                slo_fraction=p.slo_fraction,
                queue_above=p.queue_above,
            ),
            min_lend_s=p.min_lend_s,
            min_runtime_s=p.min_runtime_s,
            max_evictions_per_min=p.max_evictions_per_min,
        )


@dataclass(frozen=True, slots=True)
class LentReservation:
    reservation_id: str
    gpus: int
    lent_at: datetime  # when its newest GPU was lent


@dataclass(frozen=True, slots=True)
class ControllerView:
    """What the controller's own state says when it decides."""

    in_flight: bool
    last_change_at: datetime | None
    last_shortfall_at: datetime | None
    reservations: tuple[LentReservation, ...]
    shared_allocated_gpus: int  # GPUs held by live allocations in the shared pool
    candidates: tuple[VictimCandidate, ...]
    # Open evictions of the decision in flight not yet asked to cancel.
    withdrawable: tuple[str, ...] = ()
    # Eviction requests made in the last EVICTION_RATE_WINDOW_S.
    recent_evictions: int = 0
    # NVLink island of each GPU (from the inventory), to prefer freeing whole islands.
    islands: Mapping[GpuRef, str] | None = None

    @property
    def lent_gpus(self) -> int:
        return sum(r.gpus for r in self.reservations)


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
    ``choice.victims``; ``shortfall`` GPUs could not be found at all; ``choice.deferred``
    waits for the eviction rate limit."""

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
    # (reservation, GPUs) to return, newest first, only from GPUs lent >= min_lend_s.
    returns: tuple[tuple[str, int], ...]
    reason: str


Outcome = Hold | Expand | Shrink | Withdraw


def decide(
    reading: PoolReading,
    held: HeldSignals,
    view: ControllerView,
    limits: ControllerLimits,
    now: datetime,
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
    shared = reading.shared
    signals = PoolSignals(
        inference_util=reading.inference.util,
        shared_util=shared.util if shared.known else 0.0,
        inference_gpus=reading.inference.gpus,
        shared_available=shared.gpus,
        lent_gpus=view.lent_gpus,
    )
    cooling = _cooldown_left(view.last_change_at, now, limits.cooldown_s)
    causes = expand_causes(reading, limits.thresholds, limits.signals)
    if causes:
        return _expand(reading, held, view, limits, now, signals, causes, cooling)
    if shrink_cause(reading, limits.thresholds) is None:
        return Hold("within the hysteresis band")
    return _shrink(held, view, limits, now, signals, cooling)


def expand_due(
    reading: PoolReading, held: HeldSignals, limits: ControllerLimits, now: datetime
) -> bool:
    """True when an expand condition holds now and has held for its window: only then
    does a decision need the victim candidates (the caller loads them on that)."""
    return (
        bool(expand_causes(reading, limits.thresholds, limits.signals))
        and held_for(held.expand_since, now) >= limits.signals.expand_hold_s
    )


def _expand(
    reading: PoolReading,
    held: HeldSignals,
    view: ControllerView,
    limits: ControllerLimits,
    now: datetime,
    signals: PoolSignals,
    causes: tuple[str, ...],
    cooling: float,
) -> Outcome:
    window = limits.signals.expand_hold_s
    held_s = held_for(held.expand_since, now)
    if held_s < window:
        return Hold(
            f"expand wanted ({'; '.join(causes)}), held {max(held_s, 0):.0f}s of {window:.0f}s"
        )
    if cooling > 0:
        return Hold(f"expand wanted, cooldown has {cooling:.0f}s left")
    util_cause = reading.inference.util > limits.thresholds.expand_above
    expand = decide_expand(
        signals,
        limits.thresholds,
        triggered_by=None if util_cause else "; ".join(causes),
    )
    assert expand is not None  # a cause holds, so decide_expand sizes a change
    reason = f"{expand.reason}; held {held_s:.0f}s >= {window:.0f}s"
    free = min(expand.gpus, max(0, reading.shared.gpus - view.shared_allocated_gpus))
    allowance = None
    if limits.max_evictions_per_min is not None:
        allowance = max(0, limits.max_evictions_per_min - view.recent_evictions)
    choice = choose_victims(
        view.candidates,
        expand.gpus - free,
        now,
        min_runtime_s=limits.min_runtime_s,
        max_victims=allowance,
        within_tier=limits.victim_order,
        island_of=view.islands,
    )
    if choice.deferred:
        reason += f"; {choice.deferred} GPUs wait for the eviction rate limit"
    outcome = Expand(
        signals=signals,
        gpus=expand.gpus,
        free_gpus=free,
        choice=choice,
        shortfall=expand.shortfall + choice.shortfall,
        reason=reason,
    )
    if not outcome.changes_pools:
        if not outcome.shortfall:
            return Hold("expand wanted, every victim waits for the eviction rate limit")
        if _cooldown_left(view.last_shortfall_at, now, limits.cooldown_s):
            # Nothing to lend and the shortfall was raised already: alert once per cooldown.
            return Hold("shortfall already raised")
    return outcome


def _shrink(
    held: HeldSignals,
    view: ControllerView,
    limits: ControllerLimits,
    now: datetime,
    signals: PoolSignals,
    cooling: float,
) -> Outcome:
    shrink = decide_shrink(signals, limits.thresholds)
    if shrink is None:
        return Hold("nothing lent to return")
    window = limits.signals.shrink_hold_s
    held_s = held_for(held.shrink_since, now)
    if held_s < window:
        return Hold(f"shrink wanted, held {max(held_s, 0):.0f}s of {window:.0f}s")
    if cooling > 0:
        return Hold(f"shrink wanted, cooldown has {cooling:.0f}s left")
    ready = returnable(view.reservations, now, limits.min_lend_s)
    returns = tuple(split_return(shrink.gpus, [(r.reservation_id, r.gpus) for r in ready]))
    gpus = sum(n for _, n in returns)
    if gpus == 0:
        return Hold(
            f"shrink wanted, every lent GPU is inside its {limits.min_lend_s:.0f}s min lend"
        )
    reason = f"{shrink.reason}; held {held_s:.0f}s >= {window:.0f}s"
    if gpus < shrink.gpus:
        reason += (
            f"; {shrink.gpus - gpus} GPUs stay lent until their {limits.min_lend_s:.0f}s min lend"
        )
    return Shrink(signals=signals, gpus=gpus, returns=returns, reason=reason)


def returnable(
    reservations: Iterable[LentReservation], now: datetime, min_lend_s: float
) -> list[LentReservation]:
    """Reservations lent at least ``min_lend_s`` ago, newest first: a surge that comes
    back minutes later finds its GPUs still lent instead of evicting training again."""
    cutoff = now - timedelta(seconds=min_lend_s)
    ready = [r for r in reservations if r.lent_at <= cutoff]
    return sorted(ready, key=lambda r: (-r.lent_at.timestamp(), r.reservation_id))


def replacement(
    candidates: Iterable[VictimCandidate],
    missing: int,
    now: datetime,
    exclude: Iterable[str],
    limits: ControllerLimits,
    recent_evictions: int = 0,
    island_of: Mapping[GpuRef, str] | None = None,
) -> VictimChoice:
    """Victims for GPUs an aborted eviction did not free, never one tried already, under
    the same min runtime and eviction rate limit as the first choice."""
    excluded = set(exclude)
    allowance = None
    if limits.max_evictions_per_min is not None:
        allowance = max(0, limits.max_evictions_per_min - recent_evictions)
    return choose_victims(
        [c for c in candidates if c.allocation_id not in excluded],
        missing,
        now,
        min_runtime_s=limits.min_runtime_s,
        max_victims=allowance,
        within_tier=limits.victim_order,
        island_of=island_of,
    )


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


def _cooldown_left(since: datetime | None, now: datetime, cooldown_s: float) -> float:
    if since is None:
        return 0.0
    return max(0.0, (since + timedelta(seconds=cooldown_s) - now).total_seconds())
