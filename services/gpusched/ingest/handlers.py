"""Ingest's service layer: pool membership from the ledger, inference stats, snapshots out.

GPU telemetry is folded in memory by fold.TelemetryFold (docs/ingest.md); what reaches
the database from it is each replica's share of every pool, which the snapshot sums.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime, timedelta

from prometheus_client import Counter
from pydantic import ValidationError

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
from gpusched.contracts.validation import DEFAULT_MAX_CLOCK_SKEW_S
from gpusched.domain.inventory import GpuRef
from gpusched.infra.db import UnitOfWork
from gpusched.infra.errors import Rejected
from gpusched.infra.settings import IngestSettings
from gpusched.ingest import rollup, store

log = logging.getLogger(__name__)

NAME = "ingest"

SET_ASIDE = Counter(
    "gpusched_ingest_set_aside_total",
    "stored readings or services the snapshot loop skipped because they were unusable",
    ["kind"],
)


# After a membership change, how many replica flushes a snapshot waits for at most.
MEMBERSHIP_SETTLE_FLUSHES = 3


class UnknownNode(Exception):
    """A sample from a node the inventory does not (yet) hold. Not Rejected at once: the
    inventory event may simply not have reached this replica yet (docs/ingest.md)."""


# --- telemetry ----------------------------------------------------------------------------
def check_sample(sample: GpuSample, gpus: int | None) -> None:
    """The inventory's rule for one node's sample (`gpus`: the node's GPU count, None
    if the inventory does not hold it), whichever source it came from."""
    check_indexes(sample.node, [g.index for g in sample.gpus], gpus)


def check_indexes(node: str, indexes: Iterable[int], gpus: int | None) -> None:
    """`check_sample` for a sample given by its node and GPU indexes."""
    if gpus is None:
        raise UnknownNode(f"node {node!r} is not in the inventory")
    beyond = sorted(index for index in indexes if index >= gpus)
    if beyond:
        raise Rejected(f"node {node!r} has {gpus} GPUs: no GPU index {', '.join(map(str, beyond))}")


async def on_inference_stats(envelope: Envelope, uow: UnitOfWork) -> None:
    await store.add_service_stats(uow, envelope.payload(InferenceStats))


# --- pool membership (admission's ledger events) ---------------------------------------
async def on_inventory_loaded(envelope: Envelope, uow: UnitOfWork) -> None:
    inventory = envelope.payload(InventoryLoaded)
    await store.load_inventory(uow, inventory.nodes)
    await store.membership_changed(uow)


async def on_inventory_changed(envelope: Envelope, uow: UnitOfWork) -> None:
    changed = envelope.payload(InventoryChanged)
    if changed.change in (NodeChange.ADDED, NodeChange.RECOVERED):
        await store.add_node(uow, changed.node)
    elif changed.change in (NodeChange.FAILED, NodeChange.REMOVED):
        await store.remove_node(uow, changed.node.name, forget=changed.change is NodeChange.REMOVED)
    else:
        return
    await store.membership_changed(uow)


async def on_gpus_reserved(envelope: Envelope, uow: UnitOfWork) -> None:
    reserved = envelope.payload(GpusReserved)
    # `pending` last: a GPU listed in both is lent but still held by training.
    known = await store.mark_lent(uow, reserved.reservation_id, reserved.gpus, pending=False)
    known |= await store.mark_lent(uow, reserved.reservation_id, reserved.pending, pending=True)
    await store.membership_changed(uow)
    unknown = {GpuRef(g.node, g.index) for g in (*reserved.gpus, *reserved.pending)} - known
    if unknown:
        # Not refused: the rest of the reservation still moves GPUs between pools.
        log.warning(
            "reservation %s names GPUs outside the inventory: %s",
            reserved.reservation_id,
            ", ".join(sorted(map(str, unknown))),
        )


async def on_allocation_released(envelope: Envelope, uow: UnitOfWork) -> None:
    released = envelope.payload(AllocationReleased)
    held = {(g.node, g.index) for g in released.still_held}
    await store.clear_pending(uow, [g for g in released.gpus if (g.node, g.index) not in held])
    await store.membership_changed(uow)


async def on_gpus_returned(envelope: Envelope, uow: UnitOfWork) -> None:
    await store.mark_returned(uow, envelope.payload(GpusReturned).gpus)
    await store.membership_changed(uow)


# --- the snapshot loop --------------------------------------------------------------------
async def publish_snapshot(
    uow: UnitOfWork,
    settings: IngestSettings,
    now: datetime,
    max_clock_skew_s: float = DEFAULT_MAX_CLOCK_SKEW_S,
) -> PoolSnapshot | None:
    """Prune what left the window, sum the replicas' partials, emit one pool snapshot.

    Nothing is emitted while no GPU and no service reported: an empty snapshot would
    read as an idle cluster. A partial or a service that cannot be used (a value the
    edge would refuse, e.g. a row written by hand) is set aside, logged and counted:
    one bad row or service never blinds the controller.
    """
    # A replica's share counts while it is inside the window: one that stopped (killed,
    # partitioned away) leaves its GPUs reporting for at most a window, as their last
    # samples would, then they count as silent.
    since = now - timedelta(seconds=settings.window_s)
    stale = now - timedelta(seconds=max(settings.window_s, settings.stale_after_s))
    future = now + timedelta(seconds=max_clock_skew_s)
    await store.prune(uow, before=stale, after=future)
    fresh, versions = await store.fresh_partials(uow, since=since, until=future)
    version, changed_s_ago = await store.membership_age(uow)
    if versions - {version} and changed_s_ago < MEMBERSHIP_SETTLE_FLUSHES * (
        settings.flush_interval_s
    ):
        # The pools just changed and some replica has not folded against it yet: its
        # share would count GPUs in their old pools. Its next flush is due in a moment.
        return None
    partials, bad_partials = rollup.usable_partials(fresh)
    if bad_partials:
        SET_ASIDE.labels("pool_partial").inc(bad_partials)
        log.warning("set aside %d unusable pool partials", bad_partials)
    pools = rollup.pool_utilization(await store.pool_sizes(uow), partials)
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
        services=_service_states(services),
    )
    await uow.emit(uow.subjects.event(NAME, T.POOL_SNAPSHOT), T.POOL_SNAPSHOT, snapshot)
    return snapshot


def _service_states(services: tuple[rollup.ServiceReading, ...]) -> list[ServiceState]:
    states: list[ServiceState] = []
    for s in services:
        try:
            states.append(
                ServiceState(
                    service=s.service,
                    p99_ms=s.p99_ms,
                    queue_depth=s.queue_depth,
                    requests=s.requests,
                )
            )
        except ValidationError as exc:
            SET_ASIDE.labels("service").inc()
            log.warning("set aside service %r: its latest stats are unusable: %s", s.service, exc)
    return states
