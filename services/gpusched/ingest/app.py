"""Ingest's composition root (DESIGN §3.2): telemetry and ledger events in, snapshots out."""

from __future__ import annotations

from gpusched.contracts.envelope import utcnow
from gpusched.contracts.messages import T
from gpusched.infra import bus
from gpusched.infra.migrations import migrations_dir
from gpusched.infra.runtime import ServiceRuntime, run_service
from gpusched.infra.settings import Settings
from gpusched.ingest import handlers
from gpusched.ingest.fold import TelemetryFold

NAME = handlers.NAME
SCHEMA = "ingest"


async def build(rt: ServiceRuntime) -> TelemetryFold:
    """Wire ingest into `rt`; returns the telemetry fold (its window, its scrape sink)."""
    s = rt.subjects
    settings = rt.settings.ingest
    # GPU telemetry: this replica's partitions, folded in memory (docs/ingest.md).
    fold = TelemetryFold(
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

    async def snapshot_tick() -> None:
        async with rt.uow() as uow:
            await handlers.publish_snapshot(
                uow, settings, utcnow(), rt.settings.bus.max_clock_skew_s
            )
            await uow.commit()

    rt.every("pool-snapshot", settings.snapshot_interval_s, snapshot_tick, singleton=True)
    return fold


def main() -> None:
    run_service(ServiceRuntime(NAME, SCHEMA, Settings(), migrations_dir(__file__)), build)
