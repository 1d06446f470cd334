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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.metrics_core import Metric

from gpusched.contracts.messages import PoolSnapshot
from gpusched.infra.metrics import gauge_family
from gpusched.ingest.fold import TelemetryFold

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

    def families(self) -> Iterable[Metric]:
        families: list[Metric] = []
        slo = gauge_family(
            "gpusched_inference_slo_ms",
            "P99 latency objective of an inference service (configured)",
            "service",
        )
        for service, objective in sorted(self.slo_ms.items()):
            slo.add_metric([service], objective)
        families.append(slo)
        if self.snapshot is not None and time.monotonic() - self.snapshot_at < (
            self.snapshot_fresh_s
        ):
            families.extend(snapshot_families(self.snapshot))
        if self.gpu_metrics:
            families.extend(gpu_families(self.fold))
        return families


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


def gpu_families(fold: TelemetryFold) -> list[Metric]:
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
    membership = fold.membership
    serving = membership.serving if membership is not None else {}
    for node, index, mean in fold.window.gpu_means():
        pools = serving.get(node, ())
        pool = pools[index] if index < len(pools) else None
        util.add_metric([node, str(index), pool or "none"], mean)
    in_window = fold.window.node_names()
    for node, sample in fold.latest.items():
        if node not in in_window:
            continue  # silent for a whole window: no reading is current
        for reading in sample.gpus:
            if reading.mem_total_mib > 0:
                ratio = reading.mem_used_mib / reading.mem_total_mib
                memory.add_metric([node, str(reading.index)], ratio)
    return [util, memory]
