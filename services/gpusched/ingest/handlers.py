"""Ingest's service layer: telemetry in, pool membership from the ledger, snapshots out."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from gpusched.contracts.envelope import Envelope
from gpusched.contracts.messages import (
    AllocationReleased,
    GpuSample,
    GpusReserved,
    GpusReturned,
    InferenceStats,
    InventoryChanged,
    InventoryLoaded,
    NodeChange,
    PoolSnapshot,
    PoolState,
    ServiceState,
    T,
)
from gpusched.domain.inventory import GpuRef
from gpusched.infra.db import UnitOfWork
from gpusched.infra.settings import IngestSettings
from gpusched.ingest import rollup, store

log = logging.getLogger(__name__)

NAME = "ingest"


# --- telemetry ----------------------------------------------------------------------------
async def on_gpu_sample(envelope: Envelope, uow: UnitOfWork) -> None:
    await store.add_gpu_sample(uow, envelope.payload(GpuSample))


async def on_inference_stats(envelope: Envelope, uow: UnitOfWork) -> None:
    await store.add_service_stats(uow, envelope.payload(InferenceStats))


# --- pool membership (admission's ledger events) ---------------------------------------
async def on_inventory_loaded(envelope: Envelope, uow: UnitOfWork) -> None:
    inventory = envelope.payload(InventoryLoaded)
    await store.load_inventory(uow, inventory.nodes)


async def on_inventory_changed(envelope: Envelope, uow: UnitOfWork) -> None:
    changed = envelope.payload(InventoryChanged)
    if changed.change in (NodeChange.ADDED, NodeChange.RECOVERED):
        await store.add_node(uow, changed.node)
    elif changed.change in (NodeChange.FAILED, NodeChange.REMOVED):
        await store.remove_node(uow, changed.node.name)


async def on_gpus_reserved(envelope: Envelope, uow: UnitOfWork) -> None:
    reserved = envelope.payload(GpusReserved)
    # `pending` last: a GPU listed in both is lent but still held by training.
    known = await store.mark_lent(uow, reserved.reservation_id, reserved.gpus, pending=False)
    known |= await store.mark_lent(uow, reserved.reservation_id, reserved.pending, pending=True)
    unknown = {GpuRef(g.node, g.index) for g in (*reserved.gpus, *reserved.pending)} - known
    if unknown:
        # Not refused: the rest of the reservation still moves GPUs between pools.
        log.warning(
            "reservation %s names GPUs outside the inventory: %s",
            reserved.reservation_id,
            ", ".join(sorted(map(str, unknown))),
        )


async def on_allocation_released(envelope: Envelope, uow: UnitOfWork) -> None:
    await store.clear_pending(uow, envelope.payload(AllocationReleased).gpus)


async def on_gpus_returned(envelope: Envelope, uow: UnitOfWork) -> None:
    await store.mark_returned(uow, envelope.payload(GpusReturned).gpus)


# --- the snapshot loop --------------------------------------------------------------------
async def publish_snapshot(
    uow: UnitOfWork, settings: IngestSettings, now: datetime
) -> PoolSnapshot | None:
    """Prune what left the window, roll up what is in it, emit one pool snapshot.

    Nothing is emitted while no GPU and no service reported: an empty snapshot would
    read as an idle cluster.
    """
    since = rollup.window_start(now, settings.window_s)
    stale = now - timedelta(seconds=max(settings.window_s, settings.stale_after_s))
    await store.prune(uow, samples_before=since, stats_before=stale)
    means = rollup.gpu_means(await store.readings_since(uow, since), now, settings.window_s)
    pools = rollup.pool_utilization(await store.members(uow), means)
    services = rollup.live_services(
        await store.latest_service_stats(uow), now, settings.stale_after_s
    )
    if not services and not any(pool.reporting_gpus for pool in pools):
        return None
    snapshot = PoolSnapshot(
        time=now,
        window_s=settings.window_s,
        pools=[
            PoolState(pool=p.pool, gpus=p.gpus, util=p.util, reporting_gpus=p.reporting_gpus)
            for p in pools
        ],
        services=[
            ServiceState(
                service=s.service, p99_ms=s.p99_ms, queue_depth=s.queue_depth, requests=s.requests
            )
            for s in services
        ],
    )
    await uow.emit(uow.subjects.event(NAME, T.POOL_SNAPSHOT), T.POOL_SNAPSHOT, snapshot)
    return snapshot
