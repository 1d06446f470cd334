"""Elastic-pool policy (DESIGN §7): when to lend shared GPUs to inference, how many,
which training allocations to evict for them, and when to give them back.

Pure functions over values; the preemption service feeds them pool state and acts on
the decisions. Whether a signal held long enough, cooldowns and rate limits are the
controller's (services/gpusched/preemption/policy.py); this module sizes a change and
picks its victims.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import NamedTuple

from gpusched.domain import lostwork
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
    signals: PoolSignals,
    thresholds: ElasticThresholds | None = None,
    *,
    triggered_by: str | None = None,
) -> ExpandDecision | None:
    """Size an expansion. ``triggered_by`` names another cause (a service's P99 near its
    SLO, a queue) that expands even with utilization under ``expand_above``: then the
    formula still sizes it, and it lends at least one GPU."""
    limits = thresholds or ElasticThresholds()
    util = signals.inference_util
    if util <= limits.expand_above and triggered_by is None:
        return None
    wanted = _uncapped_need(util, signals.inference_gpus, limits.target)
    gpus = expand_need(util, signals.inference_gpus, signals.shared_available, limits.target)
    cause = (
        triggered_by
        if triggered_by is not None
        else f"inference utilization {util:.2f} > {limits.expand_above:.2f}"
    )
    reason = (
        f"{cause} on {signals.inference_gpus} GPUs at utilization {util:.2f}: {wanted} more "
        f"bring it to {limits.target:.2f}; lending {gpus} of {signals.shared_available} "
        "available shared GPUs"
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
    """One live allocation, evicted whole (a gang) or not at all. A fraction of one GPU
    (``share`` below 1) frees its GPU only with every other tenant of it: the victim
    choice takes the ``tenants`` of a GPU together, or none of them."""

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
    # Over the team's guaranteed quota: reclaimed before guaranteed capacity (DESIGN §7).
    borrowed: bool = field(default=False, kw_only=True)
    # A fraction of its one GPU (0 < share < 1), and how many allocations share that GPU,
    # itself included: all of them are victims together or none is. 1.0: whole GPUs.
    share: float = field(default=1.0, kw_only=True)
    tenants: int = field(default=1, kw_only=True)
    # Epoch seconds of started_at and of lost_work_since(): a victim choice ranks
    # thousands of candidates, and float arithmetic is what keeps it within budget.
    started_ts: float = field(init=False, repr=False, compare=False)
    lost_since_ts: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus != len(self.gpu_refs):
            raise ValueError(
                f"allocation {self.allocation_id}: gpus={self.gpus} but "
                f"{len(self.gpu_refs)} GPU refs"
            )
        if not 0 < self.share <= 1 or self.tenants < 1:
            raise ValueError(
                f"allocation {self.allocation_id}: share={self.share} tenants={self.tenants}"
            )
        if self.fraction and self.gpus != 1:
            raise ValueError(f"allocation {self.allocation_id}: a fraction holds one GPU")
        object.__setattr__(self, "started_ts", self.started_at.timestamp())
        object.__setattr__(self, "lost_since_ts", self.lost_work_since().timestamp())

    @property
    def fraction(self) -> bool:
        return self.share < 1 or self.tenants > 1

    @property
    def share_milli(self) -> int:
        """``share`` in 1/1000 of a GPU (1000: whole GPUs), as an eviction request says."""
        return max(1, min(1000, round(self.share * 1000)))

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
        return lostwork.lost_work_since(
            self.started_at, self.last_checkpoint_at, checkpointable=self.checkpointable
        )

    def lost_work_gpu_seconds(self, now: datetime) -> float:
        return self.lost_work_at(now.timestamp())

    def lost_work_at(self, now_ts: float) -> float:
        lost = lostwork.lost_gpu_seconds_at(self.gpus, self.lost_since_ts, now_ts)
        return lost * self.share if self.share < 1 else lost


class VictimReason(NamedTuple):
    allocation_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class VictimChoice:
    victims: tuple[VictimCandidate, ...]
    freed: int
    # GPUs no eligible candidate could free: the shortfall alert's count.
    shortfall: int
    # Eligible candidates ranked until the need was met: chosen or put off by the limit.
    ranked: tuple[VictimReason, ...]
    # Eligible candidates ranked after the need was met, in ranking order. Ids only: on a
    # large cluster they are thousands, and they all share one reason (``not_needed``).
    not_needed_ids: tuple[str, ...]
    # The ineligible in allocation id order, and why (parallel, for the same reason).
    ineligible_ids: tuple[str, ...]
    ineligible_reasons: tuple[str, ...]
    need: int
    # GPUs eligible victims could free but the eviction rate limit put off.
    deferred: int = 0

    @property
    def allocation_ids(self) -> tuple[str, ...]:
        return tuple(victim.allocation_id for victim in self.victims)

    @property
    def not_needed(self) -> str:
        return f"skipped: need of {self.need} GPUs already met by higher-ranked victims"

    @property
    def reasons(self) -> tuple[VictimReason, ...]:
        """One entry per candidate: eligible ones in ranking order, then the ineligible."""
        met = self.not_needed
        return (
            *self.ranked,
            *(VictimReason(allocation_id, met) for allocation_id in self.not_needed_ids),
            *map(VictimReason, self.ineligible_ids, self.ineligible_reasons),
        )


VictimOrder = Callable[[VictimCandidate, datetime], tuple[float | str, ...]]
"""Sort key within one priority tier (after borrowed before guaranteed)."""


def least_lost_work_first(candidate: VictimCandidate, now: datetime) -> tuple[float | str, ...]:
    return (candidate.lost_work_gpu_seconds(now),)


def choose_victims(
    candidates: Iterable[VictimCandidate],
    need: int,
    now: datetime,
    *,
    min_runtime_s: float = 0.0,
    max_victims: int | None = None,
    within_tier: VictimOrder = least_lost_work_first,
    island_of: Mapping[GpuRef, str] | None = None,
) -> VictimChoice:
    """Pick shared-pool training allocations to evict until ``need`` GPUs are freed.

    Never p0-urgent, inference or a run younger than ``min_runtime_s``. Order: p2-offline
    before p1-normal; within a tier borrowed before guaranteed, then ``within_tier``
    (least lost work), then one that frees whole nodes, then one that frees whole NVLink
    islands (``island_of`` names each GPU's island; GPUs it does not name are an
    island with the rest of their node), then the larger (fewer evictions). A
    candidate is one allocation, and an allocation holds a whole gang, so a gang is
    evicted whole or not at all. Stops as soon as ``freed >= need``, so it
    frees at most one victim's worth more than ``need``. At most ``max_victims`` are
    chosen (the eviction rate limit): what eligible victims could still free is
    ``deferred``; what none can free is ``shortfall``.
    """
    if now.tzinfo is None or now.utcoffset() is None:
        raise ValueError(f"now must be timezone-aware, got {now.isoformat()}")
    _check_count("need", need)
    if max_victims is not None:
        _check_count("max_victims", max_victims)
    # Allocation id order first: the ineligible are listed in it, and it is the last
    # tie-break of the ranking (the sorts below are stable).
    pool = sorted(candidates, key=_allocation_id)
    for before, after in itertools.pairwise(pool):
        if before.allocation_id == after.allocation_id:
            raise ValueError("candidates list an allocation twice")
    now_ts = now.timestamp()
    # The fractional tenants of one GPU are one unit, ranked as one GPU by the first of
    # them (its "representative") and evicted together.
    units, pool, unit_lost, unit_ineligible = _units(pool, now_ts, min_runtime_s)
    # Nodes where one allocation holds every allocated GPU: evicting it frees the node.
    # (Plain loops, few containers: a victim choice on thousands of candidates must not
    # leave garbage-collector work behind; see bench/bench_preemption.py.)
    holders: dict[str, int] = {}
    for candidate in pool:
        seen = ""
        for ref in candidate.gpu_refs:
            if ref.node != seen:
                seen = ref.node
                holders[seen] = holders.get(seen, 0) + 1
    # A node an allocation revisits after another node counts it twice: harmless, it
    # only makes that allocation look like it does not free the node.

    eligible: list[VictimCandidate] = []
    ineligible_ids: list[str] = []
    ineligible_reasons: list[str] = []
    for candidate in pool:
        members = units.get(candidate.allocation_id)
        refused = unit_ineligible.get(candidate.allocation_id)
        if members is not None and refused is not None:
            for member, why in zip(members, refused, strict=True):
                ineligible_ids.append(member.allocation_id)
                ineligible_reasons.append(why)
            continue
        reason = _ineligibility(candidate, now_ts, min_runtime_s)
        if reason is None:
            eligible.append(candidate)
        else:
            ineligible_ids.append(candidate.allocation_id)
            ineligible_reasons.append(reason)
    if units:
        # A unit's tenants were listed at their representative: back to id order.
        pairs = sorted(zip(ineligible_ids, ineligible_reasons, strict=True))
        ineligible_ids = [allocation_id for allocation_id, _ in pairs]
        ineligible_reasons = [reason for _, reason in pairs]
    whole: set[str] = set()
    for candidate in eligible:
        if _holds_its_nodes_alone(candidate, holders):
            whole.add(candidate.allocation_id)
    islands: set[str] = set()
    if island_of:
        island_holders: dict[str, int] = {}
        for candidate in pool:
            for key in _islands(candidate, island_of):
                island_holders[key] = island_holders.get(key, 0) + 1
        for candidate in eligible:
            if candidate.allocation_id not in whole and all(
                island_holders[key] == 1 for key in _islands(candidate, island_of)
            ):
                islands.add(candidate.allocation_id)
    # The ranking, least significant key first (stable sorts on scalar keys allocate no
    # key tuples): larger first, then whole nodes, then whole islands, then within_tier,
    # then borrowed before guaranteed, then the priority tier.
    eligible.sort(
        key=lambda c: (
            (0 if c.allocation_id in whole else 1 if c.allocation_id in islands else 2) * _MANY_GPUS
            - c.gpus
        )
    )
    if within_tier is least_lost_work_first:
        if unit_lost:
            eligible.sort(key=lambda c: unit_lost.get(c.allocation_id, c.lost_work_at(now_ts)))
        else:
            eligible.sort(key=lambda c: c.lost_work_at(now_ts))
    else:
        eligible.sort(key=lambda c: within_tier(c, now))
    eligible.sort(key=lambda c: c.priority_class.preemption_rank * 2 + (not c.borrowed))

    victims: list[VictimCandidate] = []
    ranked: list[VictimReason] = []
    freed = 0
    # What the ranking would free without the rate limit: the shortfall is measured
    # against it, so a limit never raises a shortfall alert by itself.
    could_free = 0
    not_needed: tuple[str, ...] = ()
    for rank, candidate in enumerate(eligible):
        if could_free >= need:
            not_needed = tuple(
                member.allocation_id
                for c in eligible[rank:]
                for member in units.get(c.allocation_id, (c,))
            )
            break
        could_free += candidate.gpus
        members = units.get(candidate.allocation_id, (candidate,))
        if max_victims is not None and len(victims) + len(members) > max_victims:
            for member in members:
                ranked.append(
                    VictimReason(
                        member.allocation_id,
                        f"skipped: eviction rate limit reached ({max_victims} more this minute)",
                    )
                )
            continue
        victims.extend(members)
        freed += candidate.gpus
        frees = (
            ", frees whole nodes"
            if candidate.allocation_id in whole
            else ", frees whole NVLink islands"
            if candidate.allocation_id in islands
            else ""
        )
        if len(members) > 1:
            gpu = candidate.gpu_refs[0]
            frees += f", one of {len(members)} tenants of GPU {gpu} evicted together"
        for member in members:
            chosen = _chosen(member, now, freed, need, frees)
            ranked.append(VictimReason(member.allocation_id, chosen))
    return VictimChoice(
        victims=tuple(victims),
        freed=freed,
        shortfall=max(0, need - could_free),
        ranked=tuple(ranked),
        not_needed_ids=not_needed,
        ineligible_ids=tuple(ineligible_ids),
        ineligible_reasons=tuple(ineligible_reasons),
        need=need,
        deferred=max(0, min(need, could_free) - freed),
    )


def _units(
    pool: list[VictimCandidate], now_ts: float, min_runtime_s: float
) -> tuple[
    dict[str, tuple[VictimCandidate, ...]],
    list[VictimCandidate],
    dict[str, float],
    dict[str, list[str]],
]:
    """The fractional tenants of each GPU as one unit: its representative (the first
    tenant by allocation id, standing for one whole GPU: the least preemptible class of
    the tenants, the youngest start, borrowed only if all are) in place of the tenants.
    Returns the units by representative id, the pool with representatives, each unit's
    lost work (its tenants', summed) and, for a unit that cannot be a victim, why for
    each tenant: a tenant cannot be evicted, or the GPU has tenants not listed."""
    if not any(candidate.fraction for candidate in pool):
        return {}, pool, {}, {}
    by_gpu: dict[GpuRef, list[VictimCandidate]] = {}
    out: list[VictimCandidate] = []
    for candidate in pool:
        if candidate.fraction:
            by_gpu.setdefault(candidate.gpu_refs[0], []).append(candidate)
        else:
            out.append(candidate)
    units: dict[str, tuple[VictimCandidate, ...]] = {}
    lost: dict[str, float] = {}
    refused: dict[str, list[str]] = {}
    for ref, members in by_gpu.items():
        first = members[0]
        least = max(members, key=lambda m: m.priority_class.preemption_rank)
        youngest = max(members, key=lambda m: m.started_ts)
        representative = VictimCandidate(
            first.allocation_id,
            first.job_id,
            first.team,
            least.priority_class,
            1,
            (ref,),
            youngest.started_at,
            None,
            False,
            pool=next((m.pool for m in members if m.pool is not Pool.SHARED), Pool.SHARED),
            borrowed=all(m.borrowed for m in members),
        )
        units[first.allocation_id] = tuple(members)
        lost[first.allocation_id] = sum(m.lost_work_at(now_ts) for m in members)
        out.append(representative)
        listed = max(m.tenants for m in members)
        reasons = [_ineligibility(m, now_ts, min_runtime_s) for m in members]
        if len(members) < listed:
            refused[first.allocation_id] = [
                f"skipped: shares GPU {ref} with {listed - len(members)} tenant(s) that are "
                "not candidates (being evicted, or never evicted for inference)"
            ] * len(members)
        elif any(reasons):
            blocker = next(
                f"{m.allocation_id} ({r.removeprefix('skipped: ')})"
                for m, r in zip(members, reasons, strict=True)
                if r
            )
            refused[first.allocation_id] = [
                r or f"skipped: shares GPU {ref} with {blocker}" for r in reasons
            ]
    out.sort(key=_allocation_id)
    return units, out, lost, refused


def _chosen(
    candidate: VictimCandidate, now: datetime, freed: int, need: int, frees_whole: str
) -> str:
    lost = candidate.lost_work_gpu_seconds(now)
    since = (
        "last checkpoint"
        if candidate.lost_work_since() != candidate.started_at
        else ("start of run")
    )
    quota = "borrowed" if candidate.borrowed else "guaranteed"
    return (
        f"chosen: {candidate.priority_class} ({quota}), {lost:.0f} GPU-seconds since {since} "
        f"at risk{frees_whole}, frees {candidate.gpus} GPUs ({freed} of {need})"
    )


_MANY_GPUS = 1 << 20  # more GPUs than any allocation holds: packs two sort keys in one


def _allocation_id(candidate: VictimCandidate) -> str:
    return candidate.allocation_id


def _islands(candidate: VictimCandidate, island_of: Mapping[GpuRef, str]) -> set[str]:
    return {island_of.get(ref) or f"{ref.node}/*" for ref in candidate.gpu_refs}


def _holds_its_nodes_alone(candidate: VictimCandidate, holders: dict[str, int]) -> bool:
    # A loop, not all(<generator>): one generator object per candidate is GC work.
    for ref in candidate.gpu_refs:  # noqa: SIM110
        if holders[ref.node] != 1:
            return False
    return True


_PREEMPTIBLE = frozenset(c for c in PriorityClass if c.preemptible)


def _ineligibility(candidate: VictimCandidate, now_ts: float, min_runtime_s: float) -> str | None:
    if candidate.priority_class not in _PREEMPTIBLE:
        return f"skipped: {candidate.priority_class} is never preempted for inference"
    if candidate.pool is not Pool.SHARED:
        return f"skipped: runs in the {candidate.pool} pool, not the shared pool"
    ran = now_ts - candidate.started_ts
    if ran < min_runtime_s:
        return f"skipped: inside its min runtime (ran {ran:.0f}s of {min_runtime_s:.0f}s)"
    return None
