"""Ingest on the real NATS and PostgreSQL: GPU samples and ledger events in, pool
snapshots out."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timedelta
from typing import Any

import pytest
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import ConsumerConfig, DeliverPolicy
from pydantic import BaseModel
from tests.support.waiting import eventually, stream_messages

from gpusched.contracts.envelope import Envelope, make_envelope, utcnow
from gpusched.contracts.messages import (
    AllocationReleased,
    GpuReading,
    GpuRef,
    GpuSample,
    GpusReserved,
    GpusReturned,
    InferenceStats,
    InventoryLoaded,
    InventoryNode,
    PoolSnapshot,
    PoolState,
    T,
)
from gpusched.contracts.subjects import node_token, telemetry_partition
from gpusched.infra.migrations import migrations_dir
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import IngestSettings, Settings
from gpusched.ingest import app
from gpusched.ingest.fold import TelemetryFold

INVENTORY = InventoryLoaded(
    nodes=[
        InventoryNode(name="inf-1", pool="inference", gpu_model="A100-80GB", gpus=2),
        InventoryNode(name="sh-1", pool="shared", gpu_model="A100-80GB", gpus=2),
    ]
)


@contextlib.asynccontextmanager
async def running_ingest(
    settings: Settings, **ingest: Any
) -> AsyncIterator[tuple[ServiceRuntime, TelemetryFold]]:
    """An ingest replica on the real servers, with its telemetry fold."""
    fast = settings.model_copy(
        update={
            "ingest": IngestSettings(
                **{"window_s": 30.0, "snapshot_interval_s": 0.1, "flush_interval_s": 0.1} | ingest
            )
        }
    )
    runtime = ServiceRuntime(app.NAME, app.SCHEMA, fast, migrations_dir(app.__file__))
    await runtime.start()
    fold = await app.build(runtime)
    task = asyncio.create_task(runtime.run())
    try:
        yield runtime, fold
    finally:
        runtime.request_stop()
        await asyncio.wait_for(task, 15)


@pytest.fixture
async def ingest(settings: Settings) -> AsyncIterator[ServiceRuntime]:
    async with running_ingest(settings) as (runtime, _):
        yield runtime


async def publish(rt: ServiceRuntime, subject: str, message_type: str, data: BaseModel) -> None:
    await rt.js.publish(subject, make_envelope(message_type, data, source="test").to_bytes())


async def admission_event(rt: ServiceRuntime, message_type: T, data: BaseModel) -> None:
    await publish(rt, rt.subjects.event("admission", message_type), message_type, data)


async def gpu_sample(
    rt: ServiceRuntime, node: str, utils: dict[int, float], at: datetime | None = None
) -> None:
    sample = GpuSample(
        node=node,
        time=at or utcnow(),
        gpus=[
            GpuReading(index=i, util=u, mem_used_mib=1000, mem_total_mib=81920)
            for i, u in utils.items()
        ],
    )
    await publish(rt, rt.subjects.telemetry_gpu(node), T.GPU_SAMPLE, sample)


def pools(snapshot: PoolSnapshot) -> dict[str, PoolState]:
    return {pool.pool: pool for pool in snapshot.pools}


async def snapshot_where(
    rt: ServiceRuntime, matching: Callable[[PoolSnapshot], bool], within: float = 20.0
) -> PoolSnapshot:
    """The first snapshot on the bus that matches; fails with the last one seen."""
    sub = await rt.js.subscribe(
        rt.subjects.event("ingest", T.POOL_SNAPSHOT),
        config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
        manual_ack=False,
    )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    last: PoolSnapshot | None = None
    try:
        while (remaining := deadline - loop.time()) > 0:
            try:
                msg = await sub.next_msg(timeout=remaining)
            except NatsTimeout:
                break
            last = Envelope.from_bytes(msg.data).payload(PoolSnapshot)
            if matching(last):
                return last
    finally:
        await sub.unsubscribe()
    raise AssertionError(f"no matching snapshot in {within}s (last: {last!r})")


def sizes(inference: int, shared: int) -> Callable[[PoolSnapshot], bool]:
    def check(snapshot: PoolSnapshot) -> bool:
        by_pool = pools(snapshot)
        return by_pool["inference"].gpus == inference and by_pool["shared"].gpus == shared

    return check


async def test_a_snapshot_holds_each_pools_mean_utilization_over_the_window(
    ingest: ServiceRuntime,
) -> None:
    await admission_event(ingest, T.INVENTORY_LOADED, INVENTORY)
    now = utcnow()
    await gpu_sample(ingest, "inf-1", {0: 0.9, 1: 0.7}, now - timedelta(seconds=2))
    await gpu_sample(ingest, "inf-1", {0: 0.7, 1: 0.9}, now)
    # sh-1/1 reported only before the window: it is left out, not counted as idle.
    await gpu_sample(ingest, "sh-1", {1: 1.0}, now - timedelta(seconds=120))
    await gpu_sample(ingest, "sh-1", {0: 0.3}, now)
    stats = InferenceStats(
        service="chat", time=now, window_s=10, requests=500, queue_depth=7, p50_ms=20, p99_ms=180
    )
    await publish(ingest, ingest.subjects.telemetry_inference("chat"), T.INFERENCE_STATS, stats)

    snapshot = await snapshot_where(
        ingest,
        lambda s: (
            pools(s)["inference"].reporting_gpus == 2
            and pools(s)["shared"].reporting_gpus == 1
            and bool(s.services)
        ),
    )

    inference, shared = pools(snapshot)["inference"], pools(snapshot)["shared"]
    assert (inference.gpus, inference.util) == (2, pytest.approx(0.8))
    assert (shared.gpus, shared.util) == (2, pytest.approx(0.3))
    assert snapshot.window_s == 30.0
    [chat] = snapshot.services
    assert (chat.service, chat.p99_ms, chat.queue_depth, chat.requests) == ("chat", 180, 7, 500)


async def test_nodes_named_as_kubernetes_names_them_report_into_their_pools(
    ingest: ServiceRuntime,
) -> None:
    """EKS names nodes `ip-10-0-1-23.ec2.internal`: their samples travel on the subject
    with the dots written `~`, and count for the node the inventory names; a sample that
    names another node than its subject's is dead-lettered."""
    inf, shared = "ip-10-0-1-23.ec2.internal", "ip-10-0-1-24.ec2.internal"
    await admission_event(
        ingest,
        T.INVENTORY_LOADED,
        InventoryLoaded(
            nodes=[
                InventoryNode(name=inf, pool="inference", gpu_model="A100-80GB", gpus=2),
                InventoryNode(name=shared, pool="shared", gpu_model="A100-80GB", gpus=2),
            ]
        ),
    )
    assert ingest.subjects.telemetry_gpu(inf).endswith(".ip-10-0-1-23~ec2~internal")
    forged = GpuSample(
        node=inf,
        time=utcnow(),
        gpus=[GpuReading(index=0, util=0.01, mem_used_mib=1, mem_total_mib=81920)],
    )
    await publish(ingest, ingest.subjects.telemetry_gpu(shared), T.GPU_SAMPLE, forged)
    await gpu_sample(ingest, inf, {0: 0.9, 1: 0.7})
    await gpu_sample(ingest, shared, {0: 0.3, 1: 0.5})

    snapshot = await snapshot_where(
        ingest,
        lambda s: pools(s)["inference"].reporting_gpus + pools(s)["shared"].reporting_gpus == 4,
    )
    assert pools(snapshot)["inference"].util == pytest.approx(0.8)
    assert pools(snapshot)["shared"].util == pytest.approx(0.4)
    [dead] = await stream_messages(ingest.js, ingest.subjects.dead_letter("ingest"), 1)
    assert dead.headers["Gpusched-Original-Subject"] == ingest.subjects.telemetry_gpu(shared)
    assert "does not match the subject" in dead.headers["Gpusched-Error"]


async def test_a_lent_gpu_serves_inference_once_training_has_released_it(
    ingest: ServiceRuntime,
) -> None:
    await admission_event(ingest, T.INVENTORY_LOADED, INVENTORY)
    await gpu_sample(ingest, "inf-1", {0: 0.9, 1: 0.9})
    await gpu_sample(ingest, "sh-1", {0: 0.3, 1: 0.5})
    await snapshot_where(ingest, lambda s: sum(p.reporting_gpus for p in s.pools) == 4)

    # sh-1/0 was free and is lent at once; sh-1/1 still runs training.
    sh0, sh1 = (
        GpuRef(node="sh-1", index=0, model="A100"),
        GpuRef(node="sh-1", index=1, model="A100"),
    )
    await admission_event(
        ingest, T.GPUS_RESERVED, GpusReserved(reservation_id="r1", gpus=[sh0, sh1], pending=[sh1])
    )
    lent = await snapshot_where(ingest, sizes(inference=3, shared=1))
    assert pools(lent)["inference"].util == pytest.approx((0.9 + 0.9 + 0.3) / 3)
    assert pools(lent)["shared"].util == pytest.approx(0.5)

    # A fraction's tenant leaves sh-1/1 while another still trains there: still pending.
    async def pending() -> tuple[bool, int]:
        async with ingest.uow() as uow:
            row = await uow.fetchrow(
                f"SELECT (SELECT pending FROM {ingest.schema}.gpu_pool "
                "WHERE node = 'sh-1' AND idx = 1) AS pending, "
                f"(SELECT count(*) FROM {ingest.schema}.inbox) AS seen"
            )
        assert row is not None
        return bool(row["pending"]), int(row["seen"])

    _, seen = await pending()
    tenant = AllocationReleased(
        allocation_id="a0", job_id="j0", team="ml", gpus=[sh1], released_at=utcnow(),
        reason="evicted", still_held=[sh1],
    )  # fmt: skip
    await admission_event(ingest, T.ALLOCATION_RELEASED, tenant)

    async def applied() -> bool:
        return (await pending())[1] > seen

    await eventually(applied, within=20)
    assert (await pending())[0] is True
    released = AllocationReleased(
        allocation_id="a1", job_id="j1", team="ml", gpus=[sh1], released_at=utcnow(), reason="x"
    )
    await admission_event(ingest, T.ALLOCATION_RELEASED, released)
    await snapshot_where(ingest, sizes(inference=4, shared=0))
    assert (await pending())[0] is False

    await admission_event(
        ingest, T.GPUS_RETURNED, GpusReturned(reservation_id="r1", gpus=[sh0, sh1])
    )
    await snapshot_where(ingest, sizes(inference=2, shared=2))


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        json.dumps(
            {"id": "bad-1", "type": "gpu.sample", "source": "agent", "time": "2026-01-01T00:00:00Z",
             "data": {"node": "sh-1", "time": "2026-01-01T00:00:00Z",
                      "gpus": [{"index": 0, "util": 1.5, "mem_used_mib": 1, "mem_total_mib": 2}]}}
        ).encode(),
    ],
    ids=["garbage", "util-out-of-range"],
)  # fmt: skip
async def test_malformed_telemetry_is_dead_lettered_and_ingest_keeps_snapshotting(
    ingest: ServiceRuntime, raw: bytes
) -> None:
    await admission_event(ingest, T.INVENTORY_LOADED, INVENTORY)
    subject = ingest.subjects.telemetry_gpu("sh-1")
    await ingest.js.publish(subject, raw)

    [dead] = await stream_messages(ingest.js, ingest.subjects.dead_letter("ingest"), 1)
    assert dead.data == raw
    assert dead.headers["Gpusched-Original-Subject"] == subject
    assert dead.headers["Gpusched-Reason"] == "malformed"

    await gpu_sample(ingest, "sh-1", {0: 0.4})
    snapshot = await snapshot_where(ingest, lambda s: pools(s)["shared"].reporting_gpus == 1)
    assert pools(snapshot)["shared"].util == pytest.approx(0.4)


async def test_malformed_ledger_event_is_dead_lettered(ingest: ServiceRuntime) -> None:
    subject = ingest.subjects.event("admission", T.GPUS_RESERVED)
    bad = make_envelope(T.GPUS_RESERVED, InventoryLoaded(nodes=[]), source="admission")
    await ingest.js.publish(subject, bad.to_bytes())

    [dead] = await stream_messages(ingest.js, ingest.subjects.dead_letter("ingest"), 1)
    assert dead.headers["Gpusched-Reason"] == "malformed"
    await admission_event(ingest, T.INVENTORY_LOADED, INVENTORY)
    await gpu_sample(ingest, "inf-1", {0: 0.6})
    await snapshot_where(ingest, sizes(inference=2, shared=2))


async def test_no_snapshot_is_emitted_while_nothing_reported(ingest: ServiceRuntime) -> None:
    await admission_event(ingest, T.INVENTORY_LOADED, INVENTORY)
    # Samples of a node outside the inventory have no pool and do not count either.
    await gpu_sample(ingest, "stranger", {0: 0.9})

    with pytest.raises(AssertionError, match="no matching snapshot"):
        await snapshot_where(ingest, lambda s: True, within=1.5)

    await gpu_sample(ingest, "inf-1", {1: 0.5})
    first = await snapshot_where(ingest, lambda s: True)
    assert [(p.pool, p.gpus, p.reporting_gpus) for p in first.pools] == [
        ("inference", 2, 1),
        ("shared", 2, 0),
    ]


async def test_a_sample_for_a_gpu_the_node_does_not_have_is_dead_lettered_unfolded(
    ingest: ServiceRuntime,
) -> None:
    await admission_event(ingest, T.INVENTORY_LOADED, INVENTORY)
    await gpu_sample(ingest, "inf-1", {0: 0.5})
    await snapshot_where(ingest, lambda s: pools(s)["inference"].reporting_gpus == 1)

    # inf-1 has two GPUs: index 5 is no GPU of it, and the whole sample is refused.
    await gpu_sample(ingest, "inf-1", {1: 0.1, 5: 0.9})

    [dead] = await stream_messages(ingest.js, ingest.subjects.dead_letter("ingest"), 1)
    assert dead.headers["Gpusched-Reason"] == "rejected"
    assert "no GPU index 5" in dead.headers["Gpusched-Error"]
    await gpu_sample(ingest, "sh-1", {0: 0.2})
    after = await snapshot_where(ingest, lambda s: pools(s)["shared"].reporting_gpus == 1)
    assert pools(after)["inference"].reporting_gpus == 1
    assert pools(after)["inference"].util == pytest.approx(0.5)


async def test_bad_rows_neither_linger_nor_blind_the_snapshot(ingest: ServiceRuntime) -> None:
    """Rows the edge would refuse may be in the database (written by hand, or by an
    older version): a partial dated 9999 or not finite is set aside and pruned, and a
    service whose latest stats are not finite is set aside while the others are still
    reported."""
    await admission_event(ingest, T.INVENTORY_LOADED, INVENTORY)
    now = utcnow()
    async with ingest.uow() as uow:
        await uow.execute(
            "INSERT INTO ingest.pool_partials"
            " (partition, pool, util_sum, reporting, updated, version) "
            "VALUES (90, 'inference', 0.99, 1, '9999-01-01T00:00:00Z', 1),"
            " (91, 'inference', 'NaN', 1, :t, 1), (92, 'inference', 5.0, 1, :t, 1)",
            {"t": now},
        )
        await uow.execute(
            "INSERT INTO ingest.service_stats "
            "(service, time, window_s, requests, queue_depth, p50_ms, p99_ms) "
            "VALUES ('broken', :t, 10, 1, 0, 1, 'Infinity'), ('chat', :t, 10, 5, 1, 2, 30)",
            {"t": now},
        )
        await uow.commit()

    snapshot = await snapshot_where(ingest, lambda s: bool(s.services))

    assert [s.service for s in snapshot.services] == ["chat"]
    assert pools(snapshot)["inference"].reporting_gpus == 0

    async def future_row_gone() -> bool:
        # Pruned by the snapshot step: the one that reported "chat" may have read the
        # stats after the rows were inserted but pruned before (each statement sees
        # what was committed when it began), so this may take one snapshot more.
        async with ingest.uow() as uow:
            rows = await uow.execute(
                "SELECT count(*) AS n FROM ingest.pool_partials WHERE partition = 90"
            )
            return bool(rows.one().n == 0)

    assert await eventually(future_row_gone, within=10)


async def test_a_node_outside_the_inventory_is_dead_lettered_after_its_grace_once_a_minute(
    settings: Settings,
) -> None:
    async with running_ingest(settings, unknown_node_grace_s=0.5) as (runtime, fold):
        await admission_event(runtime, T.INVENTORY_LOADED, INVENTORY)
        for _ in range(4):
            await gpu_sample(runtime, "stranger", {0: 0.9})
            await asyncio.sleep(0.3)
        await gpu_sample(runtime, "sh-1", {0: 0.4})

        [dead] = await stream_messages(runtime.js, runtime.subjects.dead_letter("ingest"), 1)
        assert dead.headers["Gpusched-Reason"] == "unknown_node"
        assert dead.headers["Gpusched-Original-Subject"].endswith(".stranger")
        assert "not in the inventory" in dead.headers["Gpusched-Error"]
        snapshot = await snapshot_where(runtime, lambda s: pools(s)["shared"].reporting_gpus == 1)
        assert pools(snapshot)["inference"].reporting_gpus == 0
        assert "stranger" not in fold.window.node_names()
        # Four refusals, one dead letter: the rest are counted, not sent.
        info = await runtime.js.stream_info(runtime.subjects.stream("DLQ"))
        assert info.state.messages == 1


async def test_scraped_dcgm_readings_take_the_bus_samples_path_into_the_snapshot(
    settings: Settings,
) -> None:
    """Exporter text parsed by ingest.dcgm and folded through the scrape sink: a known
    node lands in the snapshot, an unknown one is refused at once, not folded."""
    from pathlib import Path

    from gpusched.ingest import dcgm

    text = (Path(__file__).parents[1] / "unit" / "data" / "dcgm-exporter.txt").read_text()
    series = dcgm.parse_exporter_text(text)
    async with running_ingest(settings) as (runtime, fold):
        await admission_event(runtime, T.INVENTORY_LOADED, INVENTORY)
        for _ in range(100):
            if fold.membership is not None and "sh-1" in fold.membership.nodes:
                break
            await asyncio.sleep(0.1)
        known = dcgm.samples_from_series(series, utcnow(), node="sh-1").samples
        stranger = dcgm.samples_from_series(series, utcnow()).samples  # Hostname node-a
        refused = fold.accept_samples(known + stranger)

        assert list(refused) == ["node-a"]
        snapshot = await snapshot_where(runtime, lambda s: pools(s)["shared"].reporting_gpus == 2)
        assert pools(snapshot)["shared"].util == pytest.approx((0.87 + 0.5) / 2)


async def test_the_stream_stores_each_node_under_the_partition_ingest_computes(
    ingest: ServiceRuntime,
) -> None:
    """The TELEMETRY stream's subject transform and telemetry_partition agree, so a
    scraped sample lands in the share of the replica that owns its node."""
    # Names as Kubernetes gives them (EKS) too: their tokens write dots as `~`.
    nodes = [f"node-{i}" for i in range(40)] + [f"ip-10-0-1-{i}.ec2.internal" for i in range(20)]
    for node in nodes:
        await gpu_sample(ingest, node, {0: 0.5})
    prefix = ingest.subjects.prefix
    stored = await stream_messages(ingest.js, f"{prefix}.telemetry.gpu.*.*", len(nodes))
    partitions = {m.subject.split(".")[4]: int(m.subject.split(".")[3]) for m in stored}
    assert partitions == {node_token(node): telemetry_partition(node) for node in nodes}
    assert {m.subject for m in stored} == {ingest.subjects.stored_telemetry_gpu(n) for n in nodes}
    assert len(set(partitions.values())) > 8  # the nodes spread over the partitions


async def test_a_second_sample_with_the_same_node_and_time_is_a_duplicate(
    ingest: ServiceRuntime,
) -> None:
    await admission_event(ingest, T.INVENTORY_LOADED, INVENTORY)
    at = utcnow()
    await gpu_sample(ingest, "sh-1", {0: 0.2}, at)
    await gpu_sample(ingest, "sh-1", {0: 1.0}, at)  # a replayed publish, another message id
    await gpu_sample(ingest, "sh-1", {1: 0.6}, at + timedelta(milliseconds=1))

    snapshot = await snapshot_where(ingest, lambda s: pools(s)["shared"].reporting_gpus == 2)
    assert pools(snapshot)["shared"].util == pytest.approx((0.2 + 0.6) / 2)


async def test_a_restarted_replica_rebuilds_its_window_from_the_stream(settings: Settings) -> None:
    async with running_ingest(settings) as (runtime, _):
        await admission_event(runtime, T.INVENTORY_LOADED, INVENTORY)
        await gpu_sample(runtime, "inf-1", {0: 0.9, 1: 0.3})
        await gpu_sample(runtime, "sh-1", {0: 0.4})
        await snapshot_where(runtime, lambda s: sum(p.reporting_gpus for p in s.pools) == 3)

    restarted = utcnow()
    async with running_ingest(settings) as (runtime, fold):
        # No new sample: the new process folds the stream's last window again.
        async def shares() -> dict[str, tuple[int, float]]:
            async with runtime.uow() as uow:
                rows = await uow.execute(
                    "SELECT pool, sum(util_sum) AS u, sum(reporting) AS n "
                    "FROM ingest.pool_partials WHERE updated > :t GROUP BY pool ORDER BY pool",
                    {"t": restarted},
                )
                return {r.pool: (r.n, round(r.u, 6)) for r in rows}

        rebuilt = {"inference": (2, 1.2), "shared": (1, 0.4)}
        for _ in range(100):
            if await shares() == rebuilt:
                break
            await asyncio.sleep(0.1)
        assert await shares() == rebuilt
        assert len(fold.window) == 2


NODES_OF_TWO = InventoryLoaded(
    nodes=[
        InventoryNode(name=f"n{i}", pool="shared", gpu_model="A100-80GB", gpus=8) for i in range(24)
    ]
)


async def test_two_replicas_split_the_nodes_and_the_pool_is_their_sum(settings: Settings) -> None:
    """Replica 0 and 1 of 2 fold the even and odd partitions; the snapshot (made by
    either) sums both shares; when one stops, its GPUs count as silent after a window."""
    async with contextlib.AsyncExitStack() as stack:
        replicas = [
            await stack.enter_async_context(
                running_ingest(settings, replicas=2, replica=i, window_s=4.0)
            )
            for i in range(2)
        ]
        rt0, fold0 = replicas[0]
        rt1, fold1 = replicas[1]
        await admission_event(rt0, T.INVENTORY_LOADED, NODES_OF_TWO)

        async def report() -> None:
            while True:
                for i in range(24):
                    await gpu_sample(rt0, f"n{i}", {g: 0.5 for g in range(8)})
                await asyncio.sleep(0.5)

        reporting = asyncio.create_task(report())
        stack.callback(reporting.cancel)
        full = await snapshot_where(rt0, lambda s: pools(s)["shared"].reporting_gpus == 192)
        assert pools(full)["shared"].util == pytest.approx(0.5)

        assert fold0.partitions == tuple(range(0, 16, 2))
        assert fold1.partitions == tuple(range(1, 16, 2))
        held = [fold0.window.node_names(), fold1.window.node_names()]
        assert held[0] | held[1] == {f"n{i}" for i in range(24)}
        assert not held[0] & held[1]
        for names, fold in zip(held, (fold0, fold1), strict=True):
            assert names and {telemetry_partition(n) for n in names} <= set(fold.partitions)

        # Replica 1 stops: its share ages out of the window, replica 0's stays.
        rt1.request_stop()
        left = 8 * len(held[0])
        alone = await snapshot_where(
            rt0, lambda s: pools(s)["shared"].reporting_gpus == left, within=30
        )
        assert pools(alone)["shared"].gpus == 192


async def test_a_replica_scrapes_the_exporters_of_its_inventory_into_the_snapshot(
    settings: Settings,
) -> None:
    """The service wiring: with a URL template, ingest scrapes one dcgm-exporter per
    node of the inventory (a real HTTP server here) and folds what it reads."""
    from tests.support.dcgm import fixture_text, http_server, text

    routes = {"/sh-1/metrics": text(fixture_text("sh-1"))}
    async with http_server(routes) as base:
        pulled = {
            "scrape_url_template": base + "/{node}/metrics",
            "scrape_interval_s": 0.5,
            "scrape_timeout_s": 0.4,
        }
        async with running_ingest(settings, **pulled) as (runtime, _):
            await admission_event(runtime, T.INVENTORY_LOADED, INVENTORY)
            snapshot = await snapshot_where(
                runtime, lambda s: pools(s)["shared"].reporting_gpus == 2
            )
            assert pools(snapshot)["shared"].util == pytest.approx((0.87 + 0.5) / 2)
            assert pools(snapshot)["inference"].reporting_gpus == 0  # inf-1: 404, refused
