"""Elastic-pool policy (DESIGN §7): when to lend shared GPUs to inference, how many,
which training allocations to evict for them, and when to give them back.

Pure functions over values; the preemption service feeds them pool state and acts on
the decisions. Hysteresis windows, cooldowns and minimum runtime are not here yet:
``PoolSignals`` is the seam where held-for-long-enough signals will arrive, and
``choose_victims`` takes the within-tier order as a parameter.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import NamedTuple

from gpusched.domain.inventory import GpuRef, Pool
from gpusched.domain.ledger import Allocation, PriorityClass

__all__ = [
    "ElasticThresholds",
    "ExpandDecision",
    "PoolSignals",
    "PriorityClass",
    "ShrinkDecision",
    "VictimCandidate",
    "VictimChoice",
    "VictimOrder",
    "VictimReason",
    "choose_victims",
    "decide_expand",
    "decide_shrink",
    "expand_need",
    "least_lost_work_first",
    "shrink_release",
]

# Float products like 0.7 * 10 / 0.7 land a hair above 10; rounding first keeps
# ceil/floor from adding or dropping a whole GPU.
_DECIMALS = 9


def _ceil(value: float) -> int:
    return math.ceil(round(value, _DECIMALS))


def _floor(value: float) -> int:
    return math.floor(round(value, _DECIMALS))


def _check_fraction(name: str, value: float) -> None:
    # Catches percentages (85 instead of 0.85) before they size an eviction.
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be within 0..1, got {value}")


def _check_count(name: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


@dataclass(frozen=True, slots=True)
class ElasticThresholds:
    expand_above: float = 0.80
    target: float = 0.70
    shrink_below: float = 0.40
    shared_below: float = 0.60

    def __post_init__(self) -> None:
        # The gap between shrink_below and expand_above is the hysteresis band; a
        # target outside it would make one expansion trigger the next shrink.
        if not 0.0 < self.shrink_below < self.target < self.expand_above <= 1.0:
            raise ValueError(
                "thresholds must satisfy 0 < shrink_below < target < expand_above <= 1, got "
                f"{self.shrink_below}, {self.target}, {self.expand_above}"
            )
        if not 0.0 < self.shared_below <= 1.0:
            raise ValueError(f"shared_below must be within (0, 1], got {self.shared_below}")


def expand_need(
    util: float, inference_gpus: int, shared_available: int, target: float = 0.70
) -> int:
    """GPUs to lend so inference utilization returns to ``target``.

    ``ceil(util * inference_gpus / target) - inference_gpus``, at least 1, at most
    ``shared_available`` (0 when nothing can be lent). ``inference_gpus`` is the
    current inference capacity: dedicated plus already lent.
    """
    _check_fraction("util", util)
    _check_count("inference_gpus", inference_gpus)
    _check_count("shared_available", shared_available)
    wanted = _uncapped_need(util, inference_gpus, target)
    return min(wanted, shared_available)


def _uncapped_need(util: float, inference_gpus: int, target: float) -> int:
    if not 0.0 < target <= 1.0:
        raise ValueError(f"target must be within (0, 1], got {target}")
    return max(1, _ceil(util * inference_gpus / target) - inference_gpus)


def shrink_release(
    util: float, inference_gpus: int, lent_gpus: int, threshold: float = 0.40
) -> int:
    """GPUs to give back: ``floor((threshold - util) * inference_gpus)``, at least 1,
    at most ``lent_gpus`` (0 when nothing is lent; the dedicated pool never shrinks)."""
    _check_fraction("util", util)
    _check_fraction("threshold", threshold)
    _check_count("inference_gpus", inference_gpus)
    _check_count("lent_gpus", lent_gpus)
    if lent_gpus == 0:
        return 0
    return min(max(1, _floor((threshold - util) * inference_gpus)), lent_gpus)


@dataclass(frozen=True, slots=True)
class PoolSignals:
    """What the controller knows when it decides.

    Today one reading is trusted as is; windows, hold times and cooldowns will
    decide upstream whether a reading counts, then arrive here.
    """

    inference_util: float  # 0..1, average over the inference serving capacity
    shared_util: float  # 0..1, average over the shared GPUs not lent
    inference_gpus: int  # dedicated + lent GPUs serving inference
    shared_available: int  # shared GPUs not lent yet (busy or not: training can be evicted)
    lent_gpus: int  # shared GPUs currently lent to inference

    def __post_init__(self) -> None:
        _check_fraction("inference_util", self.inference_util)
        _check_fraction("shared_util", self.shared_util)
        _check_count("inference_gpus", self.inference_gpus)
        _check_count("shared_available", self.shared_available)
        _check_count("lent_gpus", self.lent_gpus)


@dataclass(frozen=True, slots=True)
class ExpandDecision:
    """Lend ``gpus`` shared GPUs to inference.

    ``gpus`` may be 0 with ``shortfall > 0`` when the shared pool has nothing left to
    lend: the caller raises the shortfall alert instead of choosing victims.
    """

    gpus: int
    shortfall: int
    signals: PoolSignals
    reason: str


@dataclass(frozen=True, slots=True)
class ShrinkDecision:
    gpus: int
    signals: PoolSignals
    reason: str


def decide_expand(
    signals: PoolSignals, thresholds: ElasticThresholds | None = None
) -> ExpandDecision | None:
    limits = thresholds or ElasticThresholds()
    util = signals.inference_util
    if util <= limits.expand_above:
        return None
    wanted = _uncapped_need(util, signals.inference_gpus, limits.target)
    gpus = expand_need(util, signals.inference_gpus, signals.shared_available, limits.target)
    reason = (
        f"inference utilization {util:.2f} > {limits.expand_above:.2f} on "
        f"{signals.inference_gpus} GPUs: {wanted} more bring it to {limits.target:.2f}; "
        f"lending {gpus} of {signals.shared_available} available shared GPUs"
    )
    if gpus < wanted:
        reason += f", short by {wanted - gpus}"
    return ExpandDecision(gpus=gpus, shortfall=wanted - gpus, signals=signals, reason=reason)


def decide_shrink(
    signals: PoolSignals, thresholds: ElasticThresholds | None = None
) -> ShrinkDecision | None:
    limits = thresholds or ElasticThresholds()
    util = signals.inference_util
    if (
        signals.lent_gpus == 0
        or util >= limits.shrink_below
        or signals.shared_util >= limits.shared_below
    ):
        return None
    gpus = shrink_release(util, signals.inference_gpus, signals.lent_gpus, limits.shrink_below)
    reason = (
        f"inference utilization {util:.2f} < {limits.shrink_below:.2f} on "
        f"{signals.inference_gpus} GPUs and shared utilization {signals.shared_util:.2f} < "
        f"{limits.shared_below:.2f}: returning {gpus} of {signals.lent_gpus} lent GPUs"
    )
    return ShrinkDecision(gpus=gpus, signals=signals, reason=reason)


# --- victims ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class VictimCandidate:
    """One live allocation, evicted whole (a gang) or not at all."""

    allocation_id: str
    job_id: str
    team: str
    priority_class: PriorityClass
    gpus: int
    gpu_refs: tuple[GpuRef, ...]
    started_at: datetime
    last_checkpoint_at: datetime | None
    checkpointable: bool
    # Serving pool of the allocation; only SHARED ones can be evicted for inference.
    pool: Pool = field(kw_only=True)

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus != len(self.gpu_refs):
            raise ValueError(
                f"allocation {self.allocation_id}: gpus={self.gpus} but "
                f"{len(self.gpu_refs)} GPU refs"
            )

    @classmethod
    def from_allocation(
        cls,
        allocation: Allocation,
        *,
        checkpointable: bool,
        last_checkpoint_at: datetime | None = None,
        started_at: datetime | None = None,
    ) -> VictimCandidate:
        """``started_at`` defaults to the grant time when the job has not reported."""
        return cls(
            allocation.allocation_id,
            allocation.job_id,
            allocation.team,
            allocation.priority_class,
            len(allocation.gpus),
            allocation.gpus,
            started_at or allocation.granted_at,
            last_checkpoint_at,
            checkpointable,
            pool=allocation.pool,
        )

    def lost_work_since(self) -> datetime:
        # A checkpoint older than this run is where the run resumed from, so the run's
        # start bounds the loss; a job that cannot checkpoint loses its whole run.
        if not self.checkpointable or self.last_checkpoint_at is None:
            return self.started_at
        return max(self.last_checkpoint_at, self.started_at)

    def lost_work_gpu_seconds(self, now: datetime) -> float:
        return self.gpus * max(0.0, (now - self.lost_work_since()).total_seconds())


class VictimReason(NamedTuple):
    allocation_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class VictimChoice:
    victims: tuple[VictimCandidate, ...]
    freed: int
    shortfall: int
    # One entry per candidate: eligible ones in ranking order, then the ineligible.
    reasons: tuple[VictimReason, ...]

    @property
    def allocation_ids(self) -> tuple[str, ...]:
        return tuple(victim.allocation_id for victim in self.victims)


VictimOrder = Callable[[VictimCandidate, datetime], tuple[float | str, ...]]
"""Sort key within one priority tier; a fragmentation-aware order can replace it."""


def least_lost_work_first(candidate: VictimCandidate, now: datetime) -> tuple[float | str, ...]:
    # Larger first on ties frees the need with fewer evictions; the id makes it total.
    return (candidate.lost_work_gpu_seconds(now), -candidate.gpus, candidate.allocation_id)


def choose_victims(
    candidates: Iterable[VictimCandidate],
    need: int,
    now: datetime,
    *,
    within_tier: VictimOrder = least_lost_work_first,
) -> VictimChoice:
    """Pick shared-pool training allocations to evict until ``need`` GPUs are freed.

    p2-offline before p1-normal; p0-urgent and inference are never chosen. Stops as
    soon as ``freed >= need``; ``shortfall`` is what is still missing.
    """
    if now.tzinfo is None or now.utcoffset() is None:
        raise ValueError(f"now must be timezone-aware, got {now.isoformat()}")
    _check_count("need", need)
    pool = list(candidates)
    ids = [candidate.allocation_id for candidate in pool]
    if len(set(ids)) != len(ids):
        raise ValueError("candidates list an allocation twice")

    eligible: list[VictimCandidate] = []
    skipped: list[VictimReason] = []
    for candidate in sorted(pool, key=lambda candidate: candidate.allocation_id):
        reason = _ineligibility(candidate)
        if reason is None:
            eligible.append(candidate)
        else:
            skipped.append(VictimReason(candidate.allocation_id, reason))
    eligible.sort(key=lambda c: (c.priority_class.preemption_rank, *within_tier(c, now)))

    victims: list[VictimCandidate] = []
    ranked: list[VictimReason] = []
    freed = 0
    for candidate in eligible:
        if freed >= need:
            ranked.append(
                VictimReason(
                    candidate.allocation_id,
                    f"skipped: need of {need} GPUs already met by higher-ranked victims",
                )
            )
            continue
        victims.append(candidate)
        freed += candidate.gpus
        lost = candidate.lost_work_gpu_seconds(now)
        since = (
            "last checkpoint"
            if candidate.lost_work_since() != candidate.started_at
            else "start of run"
        )
        ranked.append(
            VictimReason(
                candidate.allocation_id,
                f"chosen: {candidate.priority_class}, {lost:.0f} GPU-seconds since "
                f"{since} at risk, frees {candidate.gpus} GPUs ({freed} of {need})",
            )
        )
    return VictimChoice(
        victims=tuple(victims),
        freed=freed,
        shortfall=max(0, need - freed),
        reasons=(*ranked, *skipped),
    )


def _ineligibility(candidate: VictimCandidate) -> str | None:
    if not candidate.priority_class.preemptible:
        return f"skipped: {candidate.priority_class} is never preempted for inference"
    if candidate.pool is not Pool.SHARED:
        return f"skipped: runs in the {candidate.pool} pool, not the shared pool"
    return None
