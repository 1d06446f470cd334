"""Ingest's SQL on its own schema: pool membership, pool partials and service stats."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime

from gpusched.contracts.messages import GpuRef as WireGpuRef
from gpusched.contracts.messages import InferenceStats, InventoryNode
from gpusched.domain.inventory import GpuRef, Pool
from gpusched.infra.db import UnitOfWork
from gpusched.ingest.rollup import GpuMember, ServiceReading, membership
from gpusched.ingest.window import Membership, Partial


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


async def membership_changed(uow: UnitOfWork) -> None:
    """Every change of the membership bumps its version, in the same transaction, so
    each replica reloads it at its next flush (docs/ingest.md)."""
    await uow.execute(
        f"UPDATE {uow.schema}.membership_version SET version = version + 1, changed = now()"
    )


async def membership_version(uow: UnitOfWork) -> int:
    rows = await uow.execute(f"SELECT version FROM {uow.schema}.membership_version")
    return int(rows.one().version)


async def membership_age(uow: UnitOfWork) -> tuple[int, float]:
    """The membership's version and how many seconds ago it changed (database clock)."""
    rows = await uow.execute(
        "SELECT version, extract(epoch FROM now() - changed) AS age "
        f"FROM {uow.schema}.membership_version"
    )
    row = rows.one()
    return int(row.version), float(row.age)


async def load_membership(uow: UnitOfWork) -> Membership:
    """The whole membership, as of one version."""
    version = await membership_version(uow)
    nodes = await uow.execute(f"SELECT name, gpus FROM {uow.schema}.nodes")
    gpus = await uow.execute(f"SELECT node, idx, pool, lent, pending FROM {uow.schema}.gpu_pool")
    return membership(
        version,
        {r.name: int(r.gpus) for r in nodes},
        (GpuMember(GpuRef(r.node, r.idx), r.pool, r.lent, r.pending) for r in gpus),
    )


async def pool_sizes(uow: UnitOfWork) -> dict[str, int]:
    """How many GPUs each pool serves with now (lent GPUs in inference)."""
    rows = await uow.execute(
        f"SELECT CASE WHEN lent AND NOT pending THEN '{Pool.INFERENCE}' ELSE pool END AS serving,"
        f" count(*) AS gpus FROM {uow.schema}.gpu_pool GROUP BY 1 ORDER BY 1"
    )
    return {r.serving: int(r.gpus) for r in rows}


# --- telemetry aggregates ----------------------------------------------------------------
async def write_partials(
    uow: UnitOfWork, partials: Sequence[Partial], now: datetime, version: int
) -> None:
    """One replica's shares of the pools, folded against membership `version`, in one
    statement for all of them."""
    if not partials:
        return
    await uow.execute(
        f"INSERT INTO {uow.schema}.pool_partials"
        " (partition, pool, util_sum, reporting, updated, version) "
        "SELECT p, pool, u, n, :now, :version FROM unnest(CAST(:p AS int[]),"
        " CAST(:pool AS text[]), CAST(:u AS float8[]), CAST(:n AS int[])) AS r(p, pool, u, n) "
        "ON CONFLICT (partition, pool) DO UPDATE SET util_sum = EXCLUDED.util_sum,"
        " reporting = EXCLUDED.reporting, updated = EXCLUDED.updated,"
        " version = EXCLUDED.version",
        {
            "now": now,
            "version": version,
            "p": [x.partition for x in partials],
            "pool": [x.pool for x in partials],
            "u": [x.util_sum for x in partials],
            "n": [x.reporting for x in partials],
        },
    )


async def fresh_partials(
    uow: UnitOfWork, since: datetime, until: datetime
) -> tuple[list[Partial], set[int]]:
    """The partials some replica wrote after `since` (and not after `until`, beyond
    which a replica's clock is too far ahead to trust), and the membership versions
    they were folded against."""
    rows = (
        await uow.execute(
            f"SELECT partition, pool, util_sum, reporting, version FROM {uow.schema}.pool_partials "
            "WHERE updated > :since AND updated <= :until",
            {"since": since, "until": until},
        )
    ).all()
    partials = [Partial(r.partition, r.pool, r.util_sum, r.reporting) for r in rows]
    return partials, {int(r.version) for r in rows}


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


async def prune(uow: UnitOfWork, before: datetime, after: datetime) -> None:
    """Drop service stats and partials that left the window, and anything stamped after
    `after` (beyond the clock skew the edge accepts): a bogus future timestamp cannot
    keep a row alive."""
    s = uow.schema
    await uow.execute(
        f"DELETE FROM {s}.service_stats WHERE time <= :t OR time > :after",
        {"t": before, "after": after},
    )
    await uow.execute(
        f"DELETE FROM {s}.pool_partials WHERE updated <= :t OR updated > :after",
        {"t": before, "after": after},
    )


async def latest_service_stats(uow: UnitOfWork) -> list[ServiceReading]:
    rows = await uow.execute(
        "SELECT DISTINCT ON (service) service, time, p99_ms, queue_depth, requests "
        f"FROM {uow.schema}.service_stats ORDER BY service, time DESC"
    )
    return [ServiceReading(r.service, r.time, r.p99_ms, r.queue_depth, r.requests) for r in rows]
