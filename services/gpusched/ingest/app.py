"""Ingest's composition root (DESIGN §3.2): telemetry and ledger events in, snapshots out."""

from __future__ import annotations

import asyncio

from gpusched.contracts.envelope import utcnow
from gpusched.contracts.messages import GpuSample, T
from gpusched.contracts.subjects import telemetry_partition
from gpusched.infra import bus, metrics
from gpusched.infra.migrations import migrations_dir
from gpusched.infra.runtime import ServiceRuntime, run_service
from gpusched.infra.settings import IngestSettings, Settings
from gpusched.ingest import handlers, promql, scrape
from gpusched.ingest.fold import TelemetryFold
from gpusched.ingest.metrics import IngestView

NAME = handlers.NAME
SCHEMA = "ingest"


async def build(rt: ServiceRuntime) -> TelemetryFold:
    """Wire ingest into `rt`; returns the telemetry fold (its window, its scrape sink)."""
    s = rt.subjects
    settings = rt.settings.ingest
    # GPU telemetry: this replica's partitions, folded in memory (docs/ingest.md).
    fold = TelemetryFold(
        rt.nc,
        rt.js,
        s,
        settings,
        rt.dead_letters,
        rt.uow,
        service=NAME,
        max_clock_skew_s=rt.settings.bus.max_clock_skew_s,
    )
    rt.background("telemetry-fold", fold.run)

    async def flush_tick() -> None:
        async with rt.uow() as uow:
            await fold.flush(uow, utcnow())
            await uow.commit()

    rt.every("telemetry-flush", settings.flush_interval_s, flush_tick)
    # Pulled telemetry (docs/dcgm-input.md): dcgm-exporter scrapes or a Prometheus,
    # folded into the same window.
    if settings.scrape_targets_file or settings.scrape_url_template or settings.prometheus_url:
        rt.background("telemetry-pull", lambda stop: pull_telemetry(fold, settings, stop))
    # Inference stats: a few messages a second per service, applied one at a time.
    rt.consume(
        bus.Consumer(
            durable="ingest-inference",
            stream=s.stream("TELEMETRY"),
            subjects=[s.all_inference_telemetry],
            handlers={T.INFERENCE_STATS: handlers.on_inference_stats},
        )
    )
    # One consumer for all ledger events keeps them in admission's order.
    rt.consume(
        bus.Consumer(
            durable="ingest-admission",
            stream=s.stream("EVENTS"),
            subjects=[s.events_of("admission")],
            handlers={
                T.INVENTORY_LOADED: handlers.on_inventory_loaded,
                T.INVENTORY_CHANGED: handlers.on_inventory_changed,
                T.GPUS_RESERVED: handlers.on_gpus_reserved,
                T.ALLOCATION_RELEASED: handlers.on_allocation_released,
                T.GPUS_RETURNED: handlers.on_gpus_returned,
            },
        )
    )

    # The cluster gauges (pools, inference P99 and SLO, each GPU), counted when scraped.
    view = IngestView(
        fold,
        rt.settings.preemption.slo_ms,
        settings.gpu_metrics,
        snapshot_fresh_s=max(10.0, 5 * settings.snapshot_interval_s),
    )
    metrics.on_scrape(NAME, view.scrape)

    async def snapshot_tick() -> None:
        async with rt.uow() as uow:
            snapshot = await handlers.publish_snapshot(
                uow, settings, utcnow(), rt.settings.bus.max_clock_skew_s
            )
            await uow.commit()
        view.published(snapshot)

    rt.every("pool-snapshot", settings.snapshot_interval_s, snapshot_tick, singleton=True)
    return fold


async def pull_telemetry(
    fold: TelemetryFold, settings: IngestSettings, stop: asyncio.Event
) -> None:
    """Scrape the exporters and/or query Prometheus until `stop`; each replica folds
    only the nodes of its own partitions (and scrapes only those of the inventory)."""
    owned = set(fold.partitions)

    async def sink(samples: list[GpuSample]) -> dict[str, str]:
        return fold.accept_samples([x for x in samples if telemetry_partition(x.node) in owned])

    async def inventory_nodes() -> list[str]:
        known = fold.membership.nodes if fold.membership is not None else {}
        return [n for n in known if telemetry_partition(n) in owned]

    async with scrape.client_session(
        settings.scrape_concurrency, settings.scrape_interval_s
    ) as session:
        runs = []
        targets = scrape.configured_targets(settings, inventory_nodes)
        if targets is not None:
            runs.append(scrape.Scraper.from_settings(session, sink, settings).run(targets, stop))
        source = promql.PrometheusSource.from_settings(session, sink, settings)
        if source is not None:
            runs.append(source.run(stop))
        await asyncio.gather(*runs)


def main() -> None:
    run_service(ServiceRuntime(NAME, SCHEMA, Settings(), migrations_dir(__file__)), build)
