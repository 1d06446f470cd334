"""Ingest's cluster metrics: pool utilization, inference latency against its SLO, and
each GPU's utilization and memory, the series the core alerts of DESIGN §7 read
(deploy/prometheus/alerts.yml, group gpusched-cluster).

All of it is held in memory already: the last pool snapshot (by the replica that
publishes snapshots) and the telemetry window with each node's newest sample (every
replica, for its own partitions, so replicas never report the same GPU). It is counted
when Prometheus scrapes, never per sample.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client.metrics_core import Metric

from gpusched.contracts.messages import PoolSnapshot
from gpusched.infra.metrics import Build, gauge_family
from gpusched.ingest.fold import TelemetryFold
from gpusched.ingest.reader import SampleView

# The families counted at scrape time (not in the registry until scraped).
SCRAPED_FAMILIES = (
    "gpusched_inference_slo_ms",
    "gpusched_pool_utilization",
    "gpusched_pool_gpus",
    "gpusched_pool_reporting_gpus",
    "gpusched_inference_p99_ms",
    "gpusched_inference_queue_depth",
    "gpusched_gpu_utilization",
    "gpusched_gpu_memory_used_ratio",
)


@dataclass
class IngestView:
    """What the scrape reads: the fold's window and the last snapshot this replica sent."""

    fold: TelemetryFold
    # P99 SLO per inference service (the preemption settings' slo_ms).
    slo_ms: Mapping[str, float]
    gpu_metrics: bool
    # A snapshot older than this is not reported (this replica stopped publishing them).
    snapshot_fresh_s: float
    snapshot: PoolSnapshot | None = None
    snapshot_at: float = field(default=0.0)

    def published(self, snapshot: PoolSnapshot | None) -> None:
        if snapshot is not None:
            self.snapshot, self.snapshot_at = snapshot, time.monotonic()

    def scrape(self) -> Build:
        """On the event loop: what the families are made of (see infra.metrics.Build)."""
        snapshot = self.snapshot
        if snapshot is not None and time.monotonic() - self.snapshot_at >= self.snapshot_fresh_s:
            snapshot = None
        readings = gpu_readings(self.fold) if self.gpu_metrics else None
        slo_ms = dict(self.slo_ms)

        def build() -> list[Metric]:
            slo = gauge_family(
                "gpusched_inference_slo_ms",
                "P99 latency objective of an inference service (configured)",
                "service",
            )
            for service, objective in sorted(slo_ms.items()):
                slo.add_metric([service], objective)
            families: list[Metric] = [slo]
            if snapshot is not None:
                families.extend(snapshot_families(snapshot))
            if readings is not None:
                families.extend(gpu_families(readings))
            return families

        return build


def snapshot_families(snapshot: PoolSnapshot) -> list[Metric]:
    util = gauge_family(
        "gpusched_pool_utilization",
        "Mean GPU utilization of a pool over the telemetry window (0-1)",
        "pool",
    )
    gpus = gauge_family("gpusched_pool_gpus", "GPUs serving a pool", "pool")
    reporting = gauge_family(
        "gpusched_pool_reporting_gpus", "GPUs of a pool with telemetry in the window", "pool"
    )
    for pool in snapshot.pools:
        util.add_metric([pool.pool], pool.util)
        gpus.add_metric([pool.pool], pool.gpus)
        reporting.add_metric([pool.pool], pool.reporting_gpus)
    p99 = gauge_family(
        "gpusched_inference_p99_ms",
        "P99 latency an inference service reported for its last interval",
        "service",
    )
    queue = gauge_family(
        "gpusched_inference_queue_depth", "Requests waiting at an inference service", "service"
    )
    for service in snapshot.services:
        p99.add_metric([service.service], service.p99_ms)
        queue.add_metric([service.service], service.queue_depth)
    return [util, gpus, reporting, p99, queue]


@dataclass(frozen=True)
class GpuReadings:
    """What the GPU gauges are made of, copied from the fold on the event loop: each
    GPU's window mean, the pools GPUs serve, and each node's newest sample (immutable)."""

    means: list[tuple[str, int, float]]
    serving: Mapping[str, tuple[str | None, ...]]
    newest: list[SampleView]


def gpu_readings(fold: TelemetryFold) -> GpuReadings:
    membership = fold.membership
    in_window = fold.window.node_names()
    return GpuReadings(
        means=list(fold.window.gpu_means()),
        serving=membership.serving if membership is not None else {},
        # A node silent for a whole window has no current reading.
        newest=[sample for node, sample in fold.latest.items() if node in in_window],
    )


def gpu_families(readings: GpuReadings) -> list[Metric]:
    """Each GPU of this replica's partitions with samples in the window: its mean
    utilization (node, gpu, pool: the pool it serves now, "none" outside any) and the
    memory used in its newest sample."""
    util = gauge_family(
        "gpusched_gpu_utilization",
        "Mean utilization of a GPU over the telemetry window (0-1)",
        "node",
        "gpu",
        "pool",
    )
    memory = gauge_family(
        "gpusched_gpu_memory_used_ratio",
        "Memory used over memory total of a GPU, in its newest sample (0-1)",
        "node",
        "gpu",
    )
    for node, index, mean in readings.means:
        pools = readings.serving.get(node, ())
        pool = pools[index] if index < len(pools) else None
        util.add_metric([node, str(index), pool or "none"], mean)
    for sample in readings.newest:
        for index, used, total in sample.memory:
            if total > 0:
                memory.add_metric([sample.node, str(index)], used / total)
    return [util, memory]
