"""Ingest's SQL on its own schema: pool membership, samples and service stats."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime

from gpusched.contracts.messages import GpuRef as WireGpuRef
from gpusched.contracts.messages import GpuSample, InferenceStats, InventoryNode
from gpusched.domain.inventory import GpuRef
from gpusched.infra.db import UnitOfWork
from gpusched.ingest.rollup import GpuMember, Reading, ServiceReading


def _refs(gpus: Iterable[WireGpuRef]) -> tuple[list[str], list[int]]:
    nodes: list[str] = []
    indexes: list[int] = []
    for gpu in gpus:
        nodes.append(gpu.node)
        indexes.append(gpu.index)
    return nodes, indexes


# --- pool membership ------------------------------------------------------------------
async def load_inventory(uow: UnitOfWork, nodes: Sequence[InventoryNode]) -> None:
    """Replace the membership with this inventory; lending survives a reload."""
    names = [node.name for node in nodes for _ in range(node.gpus)]
    indexes = [i for node in nodes for i in range(node.gpus)]
    pools = [node.pool for node in nodes for _ in range(node.gpus)]
    s = uow.schema
    await uow.execute(
        f"DELETE FROM {s}.gpu_pool g WHERE NOT EXISTS ("
        " SELECT 1 FROM unnest(CAST(:nodes AS text[]), CAST(:idx AS int[])) AS n(node, idx)"
        " WHERE n.node = g.node AND n.idx = g.idx)",
        {"nodes": names, "idx": indexes},
    )
    await uow.execute(
        f"INSERT INTO {s}.gpu_pool (node, idx, pool) "
        "SELECT * FROM unnest(CAST(:nodes AS text[]), CAST(:idx AS int[]), CAST(:pools AS text[])) "
        "ON CONFLICT (node, idx) DO UPDATE SET pool = EXCLUDED.pool",
        {"nodes": names, "idx": indexes, "pools": pools},
    )
    await uow.execute(f"DELETE FROM {s}.nodes")
    await uow.execute(
        f"INSERT INTO {s}.nodes (name, gpus) "
        "SELECT * FROM unnest(CAST(:names AS text[]), CAST(:gpus AS int[]))",
        {"names": [node.name for node in nodes], "gpus": [node.gpus for node in nodes]},
    )


async def add_node(uow: UnitOfWork, node: InventoryNode) -> None:
    """A node joins (added, or back from a failure): its GPUs count in its pool again."""
    await uow.execute(
        f"INSERT INTO {uow.schema}.gpu_pool (node, idx, pool) "
        "SELECT :node, idx, :pool FROM generate_series(0, :gpus - 1) AS idx "
        "ON CONFLICT (node, idx) DO UPDATE SET pool = EXCLUDED.pool",
        {"node": node.name, "pool": node.pool, "gpus": node.gpus},
    )
    await uow.execute(
        f"INSERT INTO {uow.schema}.nodes (name, gpus) VALUES (:node, :gpus) "
        "ON CONFLICT (name) DO UPDATE SET gpus = EXCLUDED.gpus",
        {"node": node.name, "gpus": node.gpus},
    )


async def remove_node(uow: UnitOfWork, name: str, *, forget: bool) -> None:
    """A node failed or was removed: its GPUs leave every pool count. A removed node is
    forgotten too (its samples are refused from then on); a failed one stays known."""
    await uow.execute(f"DELETE FROM {uow.schema}.gpu_pool WHERE node = :node", {"node": name})
    if forget:
        await uow.execute(f"DELETE FROM {uow.schema}.nodes WHERE name = :node", {"node": name})


async def node_gpus(uow: UnitOfWork, name: str) -> int | None:
    """How many GPUs a node of the inventory has (None: not in the inventory)."""
    rows = await uow.execute(
        f"SELECT gpus FROM {uow.schema}.nodes WHERE name = :node", {"node": name}
    )
    row = rows.first()
    return None if row is None else int(row.gpus)


async def mark_lent(
    uow: UnitOfWork, reservation_id: str, gpus: Iterable[WireGpuRef], pending: bool
) -> set[GpuRef]:
    """Mark GPUs lent; returns those the inventory knows."""
    nodes, indexes = _refs(gpus)
    rows = await uow.execute(
        f"UPDATE {uow.schema}.gpu_pool g SET lent = true, pending = :pending, reservation_id = :r "
        "FROM unnest(CAST(:nodes AS text[]), CAST(:idx AS int[])) AS n(node, idx) "
        "WHERE n.node = g.node AND n.idx = g.idx RETURNING g.node, g.idx",
        {"nodes": nodes, "idx": indexes, "pending": pending, "r": reservation_id},
    )
    return {GpuRef(r.node, r.idx) for r in rows}


async def clear_pending(uow: UnitOfWork, gpus: Iterable[WireGpuRef]) -> None:
    """The allocation holding these GPUs is gone: the pending ones now serve inference."""
    nodes, indexes = _refs(gpus)
    await uow.execute(
        f"UPDATE {uow.schema}.gpu_pool g SET pending = false "
        "FROM unnest(CAST(:nodes AS text[]), CAST(:idx AS int[])) AS n(node, idx) "
        "WHERE n.node = g.node AND n.idx = g.idx AND g.pending",
        {"nodes": nodes, "idx": indexes},
    )


async def mark_returned(uow: UnitOfWork, gpus: Iterable[WireGpuRef]) -> None:
    nodes, indexes = _refs(gpus)
    await uow.execute(
        f"UPDATE {uow.schema}.gpu_pool g "
        "SET lent = false, pending = false, reservation_id = NULL "
        "FROM unnest(CAST(:nodes AS text[]), CAST(:idx AS int[])) AS n(node, idx) "
        "WHERE n.node = g.node AND n.idx = g.idx",
        {"nodes": nodes, "idx": indexes},
    )


async def members(uow: UnitOfWork) -> list[GpuMember]:
    rows = await uow.execute(f"SELECT node, idx, pool, lent, pending FROM {uow.schema}.gpu_pool")
    return [GpuMember(GpuRef(r.node, r.idx), r.pool, r.lent, r.pending) for r in rows]


# --- telemetry --------------------------------------------------------------------------
async def add_gpu_sample(uow: UnitOfWork, sample: GpuSample) -> None:
    if not sample.gpus:
        return
    # One statement per node sample, however many GPUs it carries: telemetry is the
    # highest-volume input of the system.
    await uow.execute(
        f"INSERT INTO {uow.schema}.samples (node, idx, time, util, mem_used_mib, mem_total_mib) "
        "SELECT :node, r.idx, :time, r.util, r.used, r.total FROM unnest("
        " CAST(:idx AS int[]), CAST(:util AS float8[]),"
        " CAST(:used AS bigint[]), CAST(:total AS bigint[])) AS r(idx, util, used, total)",
        {
            "node": sample.node,
            "time": sample.time,
            "idx": [g.index for g in sample.gpus],
            "util": [g.util for g in sample.gpus],
            "used": [g.mem_used_mib for g in sample.gpus],
            "total": [g.mem_total_mib for g in sample.gpus],
        },
    )


async def add_service_stats(uow: UnitOfWork, stats: InferenceStats) -> None:
    await uow.execute(
        f"INSERT INTO {uow.schema}.service_stats "
        "(service, time, window_s, requests, queue_depth, p50_ms, p99_ms) "
        "VALUES (:service, :time, :window_s, :requests, :queue_depth, :p50, :p99)",
        {
            "service": stats.service,
            "time": stats.time,
            "window_s": stats.window_s,
            "requests": stats.requests,
            "queue_depth": stats.queue_depth,
            "p50": stats.p50_ms,
            "p99": stats.p99_ms,
        },
    )


async def prune(
    uow: UnitOfWork, samples_before: datetime, stats_before: datetime, after: datetime
) -> None:
    """Drop what left the window, and anything stamped after `after` (beyond the clock
    skew the edge accepts): a bogus future timestamp cannot keep a row alive."""
    s = uow.schema
    await uow.execute(
        f"DELETE FROM {s}.samples WHERE time <= :t OR time > :after",
        {"t": samples_before, "after": after},
    )
    await uow.execute(
        f"DELETE FROM {s}.service_stats WHERE time <= :t OR time > :after",
        {"t": stats_before, "after": after},
    )


async def readings_since(uow: UnitOfWork, since: datetime) -> list[Reading]:
    rows = await uow.execute(
        f"SELECT node, idx, time, util FROM {uow.schema}.samples WHERE time > :t", {"t": since}
    )
    return [Reading(GpuRef(r.node, r.idx), r.time, r.util) for r in rows]


async def latest_service_stats(uow: UnitOfWork) -> list[ServiceReading]:
    rows = await uow.execute(
        "SELECT DISTINCT ON (service) service, time, p99_ms, queue_depth, requests "
        f"FROM {uow.schema}.service_stats ORDER BY service, time DESC"
    )
    return [ServiceReading(r.service, r.time, r.p99_ms, r.queue_depth, r.requests) for r in rows]
