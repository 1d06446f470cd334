"""GPU sharing: what the tenants of one GPU hold, fractionally or in MIG slices.

Pure rules on plain values; the ledger keeps one ``SharedGpu`` per GPU that is in
sharing and asks these functions what fits. Nothing here reads a clock.

Two ways to share one GPU (DESIGN §7):
- fractional: tenants hold a compute share in 1/1000 (``milli``) and a memory cap. The
  milli of all tenants never exceed 1000; their memory may exceed the GPU's by the
  overcommit factor, 1.2 when every tenant is inference and 1.0 as soon as one is
  training (a training step that finds its memory taken fails hours of work; an
  inference request that does is rejected and retried). The cluster agent enforces
  both at the edge the way NVIDIA MPS does.
- MIG: the GPU carries a layout of MIG profiles (hardware slices); each tenant holds
  one slice. A layout is valid when its compute slices sum to at most 7 and its memory
  slices to at most 8: a simplification of NVIDIA's placement rules, which also fix
  where each profile may start on the GPU.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, time, timedelta
from enum import StrEnum

__all__ = [
    "COMPUTE_SLICES",
    "MEMORY_SLICES",
    "MIG_PROFILES",
    "WHOLE_GPU_MILLI",
    "GpuShare",
    "MigMode",
    "MigProfile",
    "ModeSchedule",
    "Overcommit",
    "PodShape",
    "ShareAsk",
    "SharedGpu",
    "SharingError",
    "Tenant",
    "WorkloadMix",
    "best_fraction",
    "can_change_layout",
    "fill_layout",
    "fraction_memory_mib",
    "layout_valid",
    "mig_capable",
    "profile",
    "profiles_of",
    "smallest_profile",
    "target_layout",
]

WHOLE_GPU_MILLI = 1000
COMPUTE_SLICES = 7
MEMORY_SLICES = 8
_MIB_PER_GIB = 1024


class SharingError(ValueError):
    """A share or a layout that breaks the rules of this module."""


@dataclass(frozen=True, slots=True)
class MigProfile:
    name: str
    compute: int  # of COMPUTE_SLICES
    memory_slices: int  # of MEMORY_SLICES
    memory_gib: int  # nominal, as in the profile's name

    @property
    def milli(self) -> int:
        """Its share of the GPU's compute in 1/1000, rounded down (what billing charges)."""
        return self.compute * WHOLE_GPU_MILLI // COMPUTE_SLICES


def _profiles(memory_unit_gib: int) -> tuple[MigProfile, ...]:
    # The same five shapes on every MIG-capable model; only the memory unit differs.
    shapes = ((1, 1), (2, 2), (3, 4), (4, 4), (7, 8))
    return tuple(
        MigProfile(
            f"{compute}g.{slices * memory_unit_gib}gb", compute, slices, slices * memory_unit_gib
        )
        for compute, slices in shapes
    )


# Smallest first, so the first that fits is the smallest.
MIG_PROFILES: Mapping[str, tuple[MigProfile, ...]] = {
    "A100-40GB": _profiles(5),
    "A100-80GB": _profiles(10),
    "H100-80GB": _profiles(10),
}


def profiles_of(model: str) -> tuple[MigProfile, ...]:
    return MIG_PROFILES.get(model, ())


def mig_capable(model: str) -> bool:
    return model in MIG_PROFILES


def profile(model: str, name: str) -> MigProfile:
    for candidate in profiles_of(model):
        if candidate.name == name:
            return candidate
    known = ", ".join(p.name for p in profiles_of(model)) or "none"
    raise SharingError(f"{model} has no MIG profile {name!r} (known: {known})")


def smallest_profile(model: str, memory_gib: float) -> MigProfile | None:
    """The smallest profile whose memory holds ``memory_gib`` (15 -> 2g.20gb on A100-80GB)."""
    for candidate in profiles_of(model):
        if candidate.memory_gib >= memory_gib:
            return candidate
    return None


def layout_valid(model: str, names: Sequence[str]) -> bool:
    try:
        chosen = [profile(model, name) for name in names]
    except SharingError:
        return False
    return (
        sum(p.compute for p in chosen) <= COMPUTE_SLICES
        and sum(p.memory_slices for p in chosen) <= MEMORY_SLICES
    )


def fill_layout(model: str, wanted: MigProfile) -> tuple[str, ...]:
    """A layout for an empty GPU that gives ``wanted``: as many of it as fit, the rest
    of the GPU in the smallest profile, so the change serves more than one replica."""
    smallest = profiles_of(model)[0]
    layout: list[str] = []
    compute = memory = 0
    for candidate in (wanted, smallest):
        while (
            compute + candidate.compute <= COMPUTE_SLICES
            and memory + candidate.memory_slices <= MEMORY_SLICES
        ):
            layout.append(candidate.name)
            compute += candidate.compute
            memory += candidate.memory_slices
    return tuple(layout)


# --- fractional sharing ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Overcommit:
    """How far the tenants' memory caps may exceed the GPU's memory (DESIGN §7)."""

    inference: float = 1.2
    training: float = 1.0

    def __post_init__(self) -> None:
        if self.inference < 1.0 or self.training < 1.0:
            raise SharingError("an overcommit factor below 1.0 would waste memory")

    def factor(self, any_training: bool) -> float:
        return self.training if any_training else self.inference

    def limit_mib(self, gpu_memory_mib: int, any_training: bool) -> int:
        return math.floor(gpu_memory_mib * self.factor(any_training))


def fraction_memory_mib(milli: int, gpu_memory_mib: int) -> int:
    """The default memory cap of a fraction: its share of the GPU's memory, rounded
    down, so fractions whose compute adds up to the whole GPU fit its memory too."""
    return max(1, milli * gpu_memory_mib // WHOLE_GPU_MILLI)


@dataclass(frozen=True, slots=True)
class ShareAsk:
    """A request for part of one GPU: a fraction (``milli``) or, without milli, the
    smallest MIG slice whose memory holds ``memory_mib``."""

    milli: int | None = None
    # The memory cap; for a fraction None means its share of the GPU's memory.
    memory_mib: int | None = None
    overcommit: Overcommit = Overcommit()
    # MIG: a placement may change the layout of an empty GPU, at most once per interval.
    now: datetime | None = None
    change_interval: timedelta = timedelta(hours=1)

    def __post_init__(self) -> None:
        if self.milli is None:
            if self.memory_mib is None:
                raise SharingError("a MIG slice is chosen by memory: give memory_mib")
        elif not 1 <= self.milli < WHOLE_GPU_MILLI:
            raise SharingError(f"a fraction is 1..{WHOLE_GPU_MILLI - 1} milli, not {self.milli}")
        if self.memory_mib is not None and self.memory_mib < 1:
            raise SharingError(f"a memory cap must be positive, not {self.memory_mib} MiB")

    @property
    def mig(self) -> bool:
        return self.milli is None

    def fraction_for(self, gpu_memory_mib: int) -> GpuShare:
        assert self.milli is not None  # only asked of fractions
        memory = self.memory_mib or fraction_memory_mib(self.milli, gpu_memory_mib)
        return GpuShare(self.milli, memory)

    def slice_profile(self, model: str) -> MigProfile | None:
        assert self.memory_mib is not None
        return smallest_profile(model, self.memory_mib / _MIB_PER_GIB)


@dataclass(frozen=True, slots=True)
class GpuShare:
    """What one tenant holds of one GPU."""

    milli: int
    memory_mib: int
    profile: str | None = None  # MIG: the profile of its slice
    slice: int | None = None  # MIG: the slice's position in the GPU's layout

    def __post_init__(self) -> None:
        if not 1 <= self.milli <= WHOLE_GPU_MILLI:
            raise SharingError(f"a share holds 1..{WHOLE_GPU_MILLI} milli, not {self.milli}")
        if self.memory_mib < 1:
            raise SharingError(f"a share needs a memory cap, not {self.memory_mib} MiB")
        if (self.profile is None) != (self.slice is None):
            raise SharingError("a MIG share names both its profile and its slice")

    @property
    def mig(self) -> bool:
        return self.profile is not None


@dataclass(frozen=True, slots=True)
class Tenant:
    allocation_id: str
    training: bool
    share: GpuShare


@dataclass(frozen=True, slots=True)
class SharedGpu:
    """One GPU in sharing: its MIG layout (empty: fractional) and its tenants."""

    memory_mib: int
    layout: tuple[str, ...] = ()
    tenants: tuple[Tenant, ...] = ()
    # A new layout the cluster agent has not reported applied yet: no slice is used
    # before it is (the change may fail on the node).
    pending: bool = False

    @property
    def mig(self) -> bool:
        return bool(self.layout)

    @property
    def empty(self) -> bool:
        return not self.tenants

    @property
    def milli_used(self) -> int:
        return sum(t.share.milli for t in self.tenants)

    @property
    def memory_used(self) -> int:
        return sum(t.share.memory_mib for t in self.tenants)

    @property
    def any_training(self) -> bool:
        return any(t.training for t in self.tenants)

    def fits_fraction(self, share: GpuShare, training: bool, overcommit: Overcommit | None) -> bool:
        """Room for one more fraction; ``overcommit`` None (replaying stored grants,
        whose factors may have changed since) checks compute only."""
        if self.mig or share.mig or self.milli_used + share.milli > WHOLE_GPU_MILLI:
            return False
        if overcommit is None:
            return True
        limit = overcommit.limit_mib(self.memory_mib, self.any_training or training)
        return self.memory_used + share.memory_mib <= limit

    def free_slices(self) -> tuple[int, ...]:
        taken = {t.share.slice for t in self.tenants}
        return tuple(i for i in range(len(self.layout)) if i not in taken)

    def free_slice(self, name: str) -> int | None:
        for index in self.free_slices():
            if self.layout[index] == name:
                return index
        return None

    def admits(self, tenant: Tenant, overcommit: Overcommit | None) -> bool:
        share = tenant.share
        if share.mig:
            return share.slice is not None and (
                not self.pending
                and share.slice < len(self.layout)
                and self.layout[share.slice] == share.profile
                and share.slice in self.free_slices()
            )
        return self.fits_fraction(share, tenant.training, overcommit)

    def with_tenant(self, tenant: Tenant) -> SharedGpu:
        return replace(self, tenants=(*self.tenants, tenant))

    def without(self, allocation_id: str) -> SharedGpu:
        return replace(
            self, tenants=tuple(t for t in self.tenants if t.allocation_id != allocation_id)
        )


def best_fraction(
    candidates: Iterable[tuple[object, SharedGpu]],
    share: GpuShare,
    training: bool,
    overcommit: Overcommit,
) -> object | None:
    """Best fit: the shared GPU that ``share`` leaves with the least compute free."""
    best: tuple[int, int] | None = None
    chosen: object | None = None
    for key, gpu in candidates:
        if gpu.fits_fraction(share, training, overcommit):
            left = (WHOLE_GPU_MILLI - gpu.milli_used - share.milli, gpu.memory_mib)
            if best is None or left < best:
                best, chosen = left, key
    return chosen


# --- the workload mix (what placement scores expect) -------------------------------------


@dataclass(frozen=True, slots=True)
class PodShape:
    """What one pod of the workload asks: whole GPUs (``milli`` 1000) or a fraction of one,
    host CPU and memory, and the GPU models it accepts (empty: any)."""

    gpus: int
    milli: int
    cpu_milli: int
    memory_mib: int
    models: tuple[str, ...] = ()


WHOLE_GPU_POD = PodShape(1, WHOLE_GPU_MILLI, 0, 0)
# The mix is ranked anew on each of the first _WARMUP observations, then every _RERANK:
# a new mix makes the placement score start afresh on every node.
_WARMUP = 64
_RERANK = 1024


class WorkloadMix:
    """The shapes of recent placement requests and how often each came: what the
    fragmentation score expects the next pods to be.

    Counts are halved every ``halve_every`` observations so the mix follows a changing
    workload; only the ``top`` most frequent shapes are scored (every node is scored
    against each, so the list stays short). It starts with one whole
    1-GPU pod seen: until real requests outweigh it, a fraction keeps off a free GPU
    when a shared one holds it (without whole-GPU pods in the mix, a whole GPU left
    whole would be worth nothing).
    """

    __slots__ = ("_counts", "_halve_every", "_kept", "_seen", "_top", "_typical")

    def __init__(self, top: int = 16, halve_every: int = 4096) -> None:
        self._counts: dict[PodShape, float] = {WHOLE_GPU_POD: 1.0}
        self._top = top
        self._halve_every = halve_every
        self._seen = 0
        self._typical: tuple[tuple[PodShape, float], ...] | None = None
        self._kept: tuple[tuple[PodShape, float], ...] = ()

    def observe(self, shape: PodShape) -> None:
        self._counts[shape] = self._counts.get(shape, 0.0) + 1.0
        self._seen += 1
        if self._seen % self._halve_every == 0:
            self._counts = {s: c / 2 for s, c in self._counts.items() if c >= 1.0}
        # A new ranking costs the next decisions a full scoring of every node: it is
        # redone every _RERANK observations (each one at first).
        if self._seen < _WARMUP or self._seen % _RERANK == 0:
            self._typical = None

    def typical(self) -> tuple[tuple[PodShape, float], ...]:
        """The most frequent shapes with their probabilities (summing to 1), most frequent
        first. The same object while a new ranking would only move the probabilities a
        little (under _DRIFT each): the placement score then keeps what it computed."""
        if self._typical is None:
            ranked = sorted(self._counts.items(), key=lambda item: -item[1])[: self._top]
            total = sum(count for _, count in ranked)
            typical = tuple((shape, count / total) for shape, count in ranked)
            if not _alike(typical, self._kept):
                self._kept = typical
            self._typical = self._kept
        return self._typical


# A new ranking whose probabilities all moved less than this (relative) keeps the old.
_DRIFT = 0.1


def _alike(
    new: tuple[tuple[PodShape, float], ...], old: tuple[tuple[PodShape, float], ...]
) -> bool:
    before = dict(old)
    return len(new) == len(before) and all(
        shape in before and abs(weight - before[shape]) <= _DRIFT * before[shape]
        for shape, weight in new
    )


# --- layout changes and time-of-day modes ------------------------------------------


def can_change_layout(changed_at: datetime | None, now: datetime, interval: timedelta) -> bool:
    """A change resets the GPU, so it is rationed: at most one per ``interval``."""
    return changed_at is None or now - changed_at >= interval


class MigMode(StrEnum):
    DAY = "day"  # many small slices for inference
    NIGHT = "night"  # whole GPUs for training


@dataclass(frozen=True, slots=True)
class ModeSchedule:
    """Day from ``day_start`` to ``day_end`` (UTC clock times; may wrap past midnight)."""

    day_start: time
    day_end: time

    def mode_at(self, now: datetime) -> MigMode:
        clock = now.astimezone(UTC).time()
        start, end = self.day_start, self.day_end
        day = start <= clock < end if start <= end else clock >= start or clock < end
        return MigMode.DAY if day else MigMode.NIGHT


def target_layout(model: str, mode: MigMode) -> tuple[str, ...]:
    """The layout a mode wants on an empty GPU: all smallest slices by day, none by night."""
    if mode is MigMode.NIGHT or not mig_capable(model):
        return ()
    return fill_layout(model, profiles_of(model)[0])
