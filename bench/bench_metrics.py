"""What a Prometheus scrape costs the services whose gauges are counted at scrape time.

ingest: the per-GPU gauges (utilization over the window, memory ratio) read from a
telemetry window of N nodes x 8 GPUs; baseline, in the same run: the exposition of the
same series kept in an ordinary labelled prometheus_client Gauge (what keeping them up
to date per sample would have to print anyway). admission: the queue and GPU-state
gauges for a deep queue and the openb-sized ledger. Figures are CPU milliseconds per
scrape, on the service's event loop (it serves /metrics there).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from bench.harness import Context, Figure
from gpusched.admission.index import QueueIndex
from gpusched.admission.metrics import SchedulerView
from gpusched.admission.queue import JobState, ask_of
from gpusched.admission.store import JobRecord
from gpusched.contracts.messages import GpuReading, GpuRequest, GpuSample, SubmitJob
from gpusched.domain.inventory import GpuSpec, Inventory, NodeSpec, Pool
from gpusched.domain.ledger import Ledger
from gpusched.ingest.metrics import gpu_families, gpu_readings
from gpusched.ingest.reader import SampleView
from gpusched.ingest.window import Membership, TelemetryWindow

NAME = "metrics"
GPUS = 8
T0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)


@dataclass
class Fold:
    """What gpu_families reads of ingest's TelemetryFold."""

    window: TelemetryWindow
    membership: Membership
    latest: dict[str, SampleView] = field(default_factory=dict)


class Families(Collector):
    """The two steps of a scrape (infra.metrics.Build) in a row."""

    def __init__(self, fold: Fold) -> None:
        self._fold = fold

    def collect(self) -> Any:
        return gpu_families(gpu_readings(self._fold))  # type: ignore[arg-type]


def telemetry(nodes: int) -> Fold:
    window = TelemetryWindow(30.0)
    names = [f"node-{i:05d}" for i in range(nodes)]
    membership = Membership(
        version=1,
        nodes=dict.fromkeys(names, GPUS),
        serving={name: ("shared",) * GPUS for name in names},
        pools=("shared",),
    )
    fold = Fold(window, membership)
    now = T0.timestamp()
    for i, name in enumerate(names):
        readings = [(g, (i + g) % 100 / 100) for g in range(GPUS)]
        for k in range(3):  # three samples each in the window
            window.add(name, i % 16, GPUS, now - k, readings, now)
        fold.latest[name] = SampleView.of(
            GpuSample(
                node=name,
                time=T0,
                gpus=[
                    GpuReading(
                        index=g,
                        util=u,
                        mem_used_mib=40_000,
                        mem_total_mib=81_920,
                        temp_c=60.0,
                        power_w=300.0,
                    )
                    for g, u in readings
                ],
            )
        )
    return fold


def cpu_ms_per_scrape(registry: CollectorRegistry, rounds: int) -> float:
    generate_latest(registry)  # warm
    started = time.process_time()
    for _ in range(rounds):
        generate_latest(registry)
    return (time.process_time() - started) * 1000 / rounds


def gauge_baseline(fold: Fold) -> CollectorRegistry:
    registry = CollectorRegistry()
    util = Gauge("u", "u", ["node", "gpu", "pool"], registry=registry)
    memory = Gauge("m", "m", ["node", "gpu"], registry=registry)
    for node, index, mean in fold.window.gpu_means():
        util.labels(node, str(index), "shared").set(mean)
    for node, sample in fold.latest.items():
        for index, used, total in sample.memory:
            memory.labels(node, str(index)).set(used / total)
    return registry


def queued(jobs: int, teams: int) -> QueueIndex:
    index = QueueIndex()
    for i in range(jobs):
        spec = SubmitJob(name=f"j{i}", team=f"team-{i % teams}", gpus=GpuRequest(count=1))
        index.put(
            JobRecord(
                job_id=f"job-{i:012x}",
                ask=ask_of(spec),
                spec_json=spec.model_dump_json(),
                state=JobState.QUEUED,
                attempt=0,
                allocation_id=None,
                resume_from=None,
                submitted_at=T0 + timedelta(milliseconds=i),
                warnings=(),
                wait_audited=False,
                trace={},
            )
        )
    return index


def ledger(nodes: int) -> Ledger:
    return Ledger.from_inventory(
        Inventory(
            tuple(
                NodeSpec(
                    f"n{i:05d}",
                    Pool.SHARED if i % 3 else Pool.INFERENCE,
                    tuple(GpuSpec(f"n{i:05d}", g, "A100-80GB", 81920) for g in range(GPUS)),
                    96000,
                    1048576,
                )
                for i in range(nodes)
            )
        )
    )


class ViewCollector(Collector):
    def __init__(self, view: SchedulerView) -> None:
        self._view = view

    def collect(self) -> list[Metric]:
        return list(self._view.families())


async def run(ctx: Context) -> list[Figure]:
    figures: list[Figure] = []
    for nodes in (1_000, 10_000):
        ctx.progress(f"ingest gauges of {nodes} nodes x {GPUS} GPUs")
        fold = telemetry(nodes)
        scraped = CollectorRegistry()
        scraped.register(Families(fold))
        rounds = 20 if nodes <= 1_000 else 3
        value = cpu_ms_per_scrape(scraped, rounds)
        baseline = cpu_ms_per_scrape(gauge_baseline(fold), rounds)
        figures.append(
            Figure(NAME, f"ingest_gpu_gauges_scrape_{nodes}_nodes", value, "ms", baseline)
        )
        # The part on the event loop: the copy of the window (the rest runs in a thread).
        started = time.process_time()
        for _ in range(rounds):
            gpu_readings(fold)  # type: ignore[arg-type]
        on_loop = (time.process_time() - started) * 1000 / rounds
        figures.append(
            Figure(NAME, f"ingest_gpu_gauges_on_loop_{nodes}_nodes", on_loop, "ms", value)
        )
    ctx.progress("admission gauges: 50,000 queued jobs of 50 teams, 776 nodes x 8 GPUs")
    view = SchedulerView(lambda: T0, leader_for_s=3600.0)
    view.queue, view.ledger, view.ticked_at = queued(50_000, 50), ledger(776), time.monotonic()
    registry = CollectorRegistry()
    registry.register(ViewCollector(view))
    figures.append(Figure(NAME, "admission_gauges_scrape", cpu_ms_per_scrape(registry, 20), "ms"))
    return figures
