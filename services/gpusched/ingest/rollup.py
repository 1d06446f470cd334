"""Pool arithmetic of ingest: pure functions, no I/O, no clock.

Conventions (also the snapshot's contract; window.py holds the per-GPU half):
- A GPU's utilization is the mean of its samples whose time lies within the window
  ``(now - window_s, ...]`` (window.TelemetryWindow).
- A pool's utilization is the mean over the GPUs of that pool that reported in the
  window. GPUs that did not report are excluded rather than counted as idle: a
  silent node must not look like spare capacity and trigger a shrink.
  ``reporting_gpus`` says how many GPUs the figure stands on; 0 means unknown.
  Each ingest replica contributes the partials of its telemetry partitions; the pool
  figure is their sum.
- A shared GPU lent to inference serves in the inference pool; one whose lending is
  still pending (training holds it until its allocation is released) stays shared.
- Samples of GPUs the inventory does not know are ignored: they have no pool.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from gpusched.domain.inventory import GpuRef, Pool
from gpusched.ingest.window import Membership, Partial

__all__ = [
    "ELASTIC_POOLS",
    "GpuMember",
    "PoolUtilization",
    "ServiceReading",
    "live_services",
    "membership",
    "pool_utilization",
    "usable_partials",
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


def membership(version: int, nodes: Mapping[str, int], members: Iterable[GpuMember]) -> Membership:
    """The membership a replica folds against: each GPU's serving pool by node/index."""
    serving: dict[str, list[str | None]] = {}
    for member in members:
        node, index = member.ref.node, member.ref.index
        gpus = nodes.get(node)
        if gpus is None or not 0 <= index < gpus:
            continue  # a pool row of a GPU the inventory does not (any longer) have
        serving.setdefault(node, [None] * gpus)[index] = member.serving_pool
    pools = set(ELASTIC_POOLS).union(p for row in serving.values() for p in row if p is not None)
    return Membership(
        version=version,
        nodes=dict(nodes),
        serving={node: tuple(row) for node, row in serving.items()},
        pools=tuple(sorted(pools)),
    )


def usable_partials(partials: Sequence[Partial]) -> tuple[list[Partial], int]:
    """The partials that can be a share of a pool (a finite sum of at most one per
    reporting GPU), and how many could not (e.g. a row written by hand)."""
    usable = [
        p
        for p in partials
        if p.reporting >= 0 and math.isfinite(p.util_sum) and 0.0 <= p.util_sum <= p.reporting
    ]
    return usable, len(partials) - len(usable)


def pool_utilization(
    sizes: Mapping[str, int], partials: Iterable[Partial]
) -> tuple[PoolUtilization, ...]:
    """Size and mean utilization of each serving pool, from the pools' sizes and the
    replicas' usable partials; inference and shared always, other pools (dedicated
    training) when the inventory has them."""
    gpus: dict[str, int] = dict.fromkeys(ELASTIC_POOLS, 0)
    gpus.update(sizes)
    util_sum: dict[str, float] = dict.fromkeys(gpus, 0.0)
    reporting: dict[str, int] = dict.fromkeys(gpus, 0)
    for partial in partials:
        if partial.pool in gpus:
            util_sum[partial.pool] += partial.util_sum
            reporting[partial.pool] += partial.reporting
    pools: list[PoolUtilization] = []
    for pool, size in gpus.items():
        # A lending that moved GPUs between two replicas' flushes may count a GPU in
        # two pools for a second: never more reporting GPUs than the pool has.
        n = min(reporting[pool], size)
        util = min(1.0, util_sum[pool] / reporting[pool]) if reporting[pool] else 0.0
        pools.append(PoolUtilization(pool=pool, gpus=size, util=util, reporting_gpus=n))
    return tuple(pools)


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
