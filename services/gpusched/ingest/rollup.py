"""Sliding-window arithmetic of ingest: pure functions over readings, no I/O, no clock.

Conventions (also the snapshot's contract):
- A GPU's utilization is the mean of its samples whose time lies within the window
  ``(now - window_s, ...]``. Samples stamped after ``now`` (a node clock slightly
  ahead) still count: dropping them would hide a busy node.
- A pool's utilization is the mean over the GPUs of that pool that reported in the
  window. GPUs that did not report are excluded rather than counted as idle: a
  silent node must not look like spare capacity and trigger a shrink.
  ``reporting_gpus`` says how many GPUs the figure stands on; 0 means unknown.
- A shared GPU lent to inference serves in the inference pool; one whose lending is
  still pending (training holds it until its allocation is released) stays shared.
- Samples of GPUs the inventory does not know are ignored: they have no pool.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from gpusched.domain.inventory import GpuRef, Pool

__all__ = [
    "GpuMember",
    "PoolUtilization",
    "Reading",
    "ServiceReading",
    "gpu_means",
    "live_services",
    "pool_utilization",
    "usable_readings",
    "window_start",
]

# Always present in a snapshot, so a consumer can tell "empty" from "missing".
ELASTIC_POOLS: tuple[str, ...] = (Pool.INFERENCE, Pool.SHARED)


@dataclass(frozen=True, slots=True)
class GpuMember:
    """One GPU of the inventory and whether it is lent to inference."""

    ref: GpuRef
    home_pool: str
    lent: bool = False
    pending: bool = False  # lent, but training still holds it

    @property
    def serving_pool(self) -> str:
        if self.lent and not self.pending:
            return Pool.INFERENCE
        return self.home_pool


@dataclass(frozen=True, slots=True)
class Reading:
    ref: GpuRef
    time: datetime
    util: float


@dataclass(frozen=True, slots=True)
class PoolUtilization:
    pool: str
    gpus: int
    util: float
    reporting_gpus: int


@dataclass(frozen=True, slots=True)
class ServiceReading:
    service: str
    time: datetime
    p99_ms: float
    queue_depth: int
    requests: int


def usable_readings(readings: Sequence[Reading]) -> tuple[list[Reading], int]:
    """The readings whose utilization is a finite fraction, and how many were not."""
    usable = [r for r in readings if math.isfinite(r.util) and 0.0 <= r.util <= 1.0]
    return usable, len(readings) - len(usable)


def window_start(now: datetime, window_s: float) -> datetime:
    return now - timedelta(seconds=window_s)


def gpu_means(readings: Iterable[Reading], now: datetime, window_s: float) -> dict[GpuRef, float]:
    """Mean utilization per GPU over the samples inside the window."""
    since = window_start(now, window_s)
    totals: dict[GpuRef, float] = defaultdict(float)
    counts: dict[GpuRef, int] = defaultdict(int)
    for reading in readings:
        if reading.time > since:
            totals[reading.ref] += reading.util
            counts[reading.ref] += 1
    return {ref: totals[ref] / counts[ref] for ref in totals}


def pool_utilization(
    members: Iterable[GpuMember], means: dict[GpuRef, float]
) -> tuple[PoolUtilization, ...]:
    """Size and mean utilization of each serving pool; inference and shared always,
    other home pools (dedicated training) when the inventory has them."""
    sizes: dict[str, int] = dict.fromkeys(ELASTIC_POOLS, 0)
    reported: dict[str, list[float]] = {pool: [] for pool in ELASTIC_POOLS}
    for member in members:
        pool = member.serving_pool
        sizes[pool] = sizes.get(pool, 0) + 1
        mean = means.get(member.ref)
        if mean is not None:
            reported.setdefault(pool, []).append(mean)
    return tuple(
        PoolUtilization(
            pool=pool,
            gpus=size,
            # min(): a float sum of values <= 1 may land a hair above 1.
            util=min(1.0, sum(reported[pool]) / len(reported[pool])) if reported[pool] else 0.0,
            reporting_gpus=len(reported[pool]),
        )
        for pool, size in sizes.items()
    )


def live_services(
    latest: Iterable[ServiceReading], now: datetime, stale_after_s: float
) -> tuple[ServiceReading, ...]:
    """The latest stats of each service that reported within ``stale_after_s``."""
    newest: dict[str, ServiceReading] = {}
    for reading in latest:
        if reading.time <= now - timedelta(seconds=stale_after_s):
            continue
        known = newest.get(reading.service)
        if known is None or reading.time > known.time:
            newest[reading.service] = reading
    return tuple(newest[name] for name in sorted(newest))
